"""Channel threads left blocked at a close are waited for at exit, a bounded time
(``rrfp_async.channels._strays``)."""

from __future__ import annotations

import threading
import time

import pytest

from rrfp_async.channels import _strays

pytestmark = pytest.mark.timeout(30)


def test_a_left_thread_is_waited_for_until_it_ends() -> None:
    go = threading.Event()
    t = threading.Thread(target=go.wait, daemon=True)
    t.start()
    _strays.leave([t])
    assert t in _strays.left()
    threading.Timer(0.2, go.set).start()
    _strays._drain(limit=5.0)  # what the exit runs
    assert not t.is_alive() and t not in _strays.left()


def test_a_thread_that_never_ends_is_waited_for_the_limit_only() -> None:
    never = threading.Event()
    t = threading.Thread(target=never.wait, daemon=True)
    t.start()
    _strays.leave([t])
    t0 = time.monotonic()
    _strays._drain(limit=0.3)
    assert 0.25 < time.monotonic() - t0 < 2.0 and t.is_alive()
    never.set()
    t.join(5)


def test_finished_threads_are_not_left() -> None:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    _strays.leave([t])
    assert t not in _strays.left()
