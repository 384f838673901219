"""The optional hooks of a channel's sink (``ClosingSink``, ``AbortSink``): a sink with the
hook hears of a closed peer or an aborted step, one without it is left alone.

The p2p channel's control path is driven without processes: a ``ControlPath`` built alone,
its collaborators passed in (the names, an ``Inlet`` bound to the sink, outlets that record
what would be sent).
"""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.channels import AbortSink, ClosingSink
from rrfp_async.channels._p2p_control import ControlPath
from rrfp_async.channels._p2p_inlet import Inlet
from rrfp_async.channels._p2p_io import Names

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
    inlet = Inlet()
    inlet.bind(sink)
    ch = ControlPath(
        Names(0, {0: 0, 1: 1}),
        inlet,
        send_control=lambda *a: None,
        close_edges=lambda hdr: None,
    )
    ch.open()
    return ch


@pytest.mark.parametrize("cls", [PlainSink, HookedSink])
def test_peer_closed_reaches_a_sink_that_has_it(cls: type[PlainSink]) -> None:
    sink = cls()
    assert isinstance(sink, ClosingSink) == (cls is HookedSink)
    ch = _channel(sink)
    ch.peer_closed(1)
    assert ch.closed_in(1)
    if isinstance(sink, HookedSink):
        assert sink.closed == [1]


def test_a_closing_channel_does_not_tell_its_sink() -> None:
    sink = HookedSink()
    ch = _channel(sink)
    ch.send_close()
    assert ch.closing
    ch.peer_closed(1)
    assert sink.closed == [] and ch.closed_in(1)


@pytest.mark.parametrize("cls", [PlainSink, HookedSink])
def test_an_abort_reaches_a_sink_that_has_step_aborted_once(cls: type[PlainSink]) -> None:
    sink = cls()
    assert isinstance(sink, AbortSink) == (cls is HookedSink)
    ch = _channel(sink)
    ch.peer_aborted(1, 4, 1, "boom")
    ch.peer_aborted(1, 4, 1, "boom")  # passed on once
    assert ch.aborted == {4}
    if isinstance(sink, HookedSink):
        ((step, exc),) = sink.aborted
        assert step == 4 and isinstance(exc, rr.PeerStepError) and exc.origin == 1
        assert "step 4 failed on" in str(exc) and "boom" in str(exc)
