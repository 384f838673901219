"""The job's board (``rrfp_async.distributed._pulse``): heartbeats that tell a stopped or dead
rank from one that waits, and the failures ranks leave for their peers; against a real
``TCPStore`` on 127.0.0.1 (the one process hosts it; a child process beats as rank 1)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from rrfp_async.distributed import _pulse as pulse

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def store() -> object:
    s = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    return dist.PrefixStore("default_pg", s)  # type: ignore[attr-defined]  # as init_process_group wraps it


def test_a_beating_rank_is_not_silent_and_a_stopped_beat_is(store: object) -> None:
    me = pulse.Pulse(*pulse._tcp_store(store) or ("", 0), rank=0, world=3, period=0.05)
    other = pulse.Pulse(me.host, me.port, rank=1, world=3, period=0.05)
    me.start()
    other.start()
    try:
        time.sleep(0.3)
        counts = me.counts()
        assert counts is not None and counts[0] > 0 and counts[1] > 0 and counts[2] == 0
        # Rank 2 never beat: silent; rank 1 beats; this rank is never named.
        assert me.silent(window=0.4) == [2]
        other.stop()
        assert not other.beating
        assert me.silent(window=0.4) == [1, 2]
    finally:
        me.stop()
        other.stop()


def test_the_board_keeps_a_ranks_failure_by_step(store: object) -> None:
    host, port = pulse._tcp_store(store) or ("", 0)
    a = pulse.Pulse(host, port, rank=0, world=2)
    b = pulse.Pulse(host, port, rank=1, world=2)
    assert b.note(pulse.OPEN, "ResourceError: rank 1 could not start a thread\nmore lines")
    assert b.note(3, "RuntimeError: boom")
    assert a.notes([3]) == {1: "RuntimeError: boom"}
    assert a.notes([4]) == {}
    assert a.notes([pulse.OPEN]) == {1: "ResourceError: rank 1 could not start a thread"}
    assert b.notes([3]) == {}  # its own note is not news to itself


def test_a_later_stage_of_the_job_does_not_read_an_earlier_stages_note(store: object) -> None:
    """Each stage numbers its steps from 0: a note is the opening's it was left in (every
    rank counts its openings alike), so step 0 of the next stage finds nothing stale."""
    host, port = pulse._tcp_store(store) or ("", 0)
    a = pulse.Pulse(host, port, rank=0, world=2)
    b = pulse.Pulse(host, port, rank=1, world=2)
    pulse.opened()
    assert b.note(0, "RuntimeError: the first stage's step 0 failed")
    assert a.notes([0]) == {1: "RuntimeError: the first stage's step 0 failed"}
    before = pulse.opening()
    assert pulse.opened() == before + 1  # the next stage opens (here: on both ranks)
    assert a.notes([0]) == {}
    assert b.note(0, "RuntimeError: the second stage's")
    assert a.notes([0]) == {1: "RuntimeError: the second stage's"}


def test_a_store_that_is_gone_gives_no_answer_not_a_hang() -> None:
    s = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
    )
    p = pulse.Pulse("127.0.0.1", int(s.port), rank=0, world=2)
    assert p.counts() == [0, 0]
    del s  # the server closes
    t0 = time.monotonic()
    assert p.silent(window=0.1) is None
    assert p.notes([0]) is None
    assert time.monotonic() - t0 < 15.0


def test_start_is_once_per_store_and_rank_and_none_without_a_tcp_store(store: object) -> None:
    first = pulse.start(store, 0, 2)
    try:
        assert first is not None and first.beating
        assert pulse.start(store, 0, 2) is first
        assert pulse.current() is first
        assert pulse.start(None, 0, 2) is None  # another store (none): the old one stops
        assert pulse.current() is None
        if first._thread is not None:
            first._thread.join(2.0)  # (it ends at its next beat)
        assert not first.beating
        assert pulse.start(store, 0, 1) is None  # one rank: nobody to ask
        again = pulse.start(store, 0, 2)
        assert again is not None and again.beating
        pulse.stop()  # (the default group's destroy_process_group)
        assert pulse.current() is None
    finally:
        if first is not None:
            first.stop()


_CHILD = """
import sys, time
from rrfp_async.distributed import _pulse as pulse
p = pulse.Pulse("127.0.0.1", int(sys.argv[1]), rank=1, world=2, period=0.05)
p.start()
print("beating", flush=True)
time.sleep(120)
"""


def test_a_sigstopped_process_is_silent_and_named_again_alive_once_continued(
    store: object,
) -> None:
    """The case the pulse is for: a process that is stopped breaks no connection; its beat
    stops with it, and starts again when it continues."""
    host, port = pulse._tcp_store(store) or ("", 0)
    me = pulse.Pulse(host, port, rank=0, world=2, period=0.05)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(port)], stdout=subprocess.PIPE, text=True, env=env
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "beating"
            assert me.silent(window=0.5) == []
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(0.2)
            assert me.silent(window=0.5) == [1]
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.2)
            assert me.silent(window=0.5) == []
        finally:
            child.kill()


def test_describe_names_the_ranks_and_says_lost_only_when_a_connection_broke() -> None:
    def name(g: int) -> str:
        return f"rank {g} (global {g})"

    stopped = pulse.describe([2], name, broke=False)
    assert stopped.startswith("rank 2 (global 2) stopped responding (its heartbeat"), stopped
    lost = pulse.describe([0, 2], name, broke=True)
    assert lost.startswith("rank 0 (global 0), rank 2 (global 2) were lost ("), lost


def test_a_beat_thread_still_in_a_store_call_at_exit_is_an_exit_risk() -> None:
    """The exit joins the beat threads (``_stop_all``); one still in a store call after that
    would return into a finalizing interpreter (SIGABRT): the exit is told (``exit_risks``),
    and a program ending with an uncaught exception then ends at once with status 1."""
    import threading

    from rrfp_async._in_flight import exit_risks

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    pulse._left.append(stuck)
    try:
        assert any(risk() for risk in exit_risks)
    finally:
        release.set()
        stuck.join()
    assert not pulse._left[-1].is_alive()
    pulse._left.clear()
    assert 2 * pulse._TIMEOUT.total_seconds() < pulse._EXIT_JOIN_S
