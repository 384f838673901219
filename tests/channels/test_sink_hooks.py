"""The optional hooks of a channel's sink (``ClosingSink``, ``AbortSink``): a sink with the
hook hears of a closed peer or an aborted step, one without it is left alone.

The p2p channel's control path is driven without processes: its state is set by hand on an
instance that no ``__init__`` ran for (the paths read nothing else).
"""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.channels import AbortSink, ClosingSink, P2PChannel
from rrfp_async.channels._p2p_control import ControlPath

pytestmark = pytest.mark.timeout(30)


class PlainSink:
    def deliver(self, step: int, task: Any, payload: Any, src: int) -> None:
        raise AssertionError("no message in these tests")

    def fail(self, exc: BaseException) -> None:
        raise AssertionError("no failure in these tests")


class HookedSink(PlainSink):
    def __init__(self) -> None:
        self.closed: list[int] = []
        self.aborted: list[tuple[int, BaseException]] = []

    def peer_closed(self, src: int) -> None:
        self.closed.append(src)

    def step_aborted(self, step: int, exc: BaseException) -> None:
        self.aborted.append((step, exc))


def _channel(sink: Any) -> ControlPath:
    ch = object.__new__(P2PChannel)
    ch._sink = sink
    ch._closed_in = set()
    ch._closing = False
    ch._aborted = set()
    ch._failed = None
    ch._rank = 0
    ch._global = {0: 0, 1: 1}
    ch._by_global = {0: 0, 1: 1}
    ch._send_abort = lambda *a, **k: None  # type: ignore[method-assign]
    return ch


@pytest.mark.parametrize("cls", [PlainSink, HookedSink])
def test_peer_closed_reaches_a_sink_that_has_it(cls: type[PlainSink]) -> None:
    sink = cls()
    assert isinstance(sink, ClosingSink) == (cls is HookedSink)
    ch = _channel(sink)
    ch._peer_closed(1)
    assert ch._closed_in == {1}
    if isinstance(sink, HookedSink):
        assert sink.closed == [1]


def test_a_closing_channel_does_not_tell_its_sink() -> None:
    sink = HookedSink()
    ch = _channel(sink)
    ch._closing = True
    ch._peer_closed(1)
    assert sink.closed == [] and ch._closed_in == {1}


@pytest.mark.parametrize("cls", [PlainSink, HookedSink])
def test_an_abort_reaches_a_sink_that_has_step_aborted_once(cls: type[PlainSink]) -> None:
    sink = cls()
    assert isinstance(sink, AbortSink) == (cls is HookedSink)
    ch = _channel(sink)
    ch._peer_aborted(1, 4, 1, "boom")
    ch._peer_aborted(1, 4, 1, "boom")  # passed on once
    assert ch._aborted == {4}
    if isinstance(sink, HookedSink):
        ((step, exc),) = sink.aborted
        assert step == 4 and isinstance(exc, rr.PeerStepError) and exc.origin == 1
        assert "step 4 failed on" in str(exc) and "boom" in str(exc)
