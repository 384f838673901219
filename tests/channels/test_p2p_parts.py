"""The p2p channel's parts, each built alone with its collaborators passed in (no process,
no process group): the wire's ABORT header and its failure kind, the ``ControlPath``, the
``Inlet``, one outbound edge's ``Sender`` on a recording group, and ``Names``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

import rrfp_async as rr
from rrfp_async._errors import FailureKind, PeerStepError, StepDiffersError
from rrfp_async._streams import Device
from rrfp_async.channels._p2p_control import ControlPath
from rrfp_async.channels._p2p_inlet import Inlet
from rrfp_async.channels._p2p_io import Limits, Names
from rrfp_async.channels._p2p_send import Sender
from rrfp_async.channels._wire import (
    ABORT,
    CLEAN,
    CLOSE,
    DATA,
    DATA_INLINE,
    FAILED,
    HEADER_BYTES,
    HEADER_LEN,
    LEFT,
    LOST,
    MAGIC,
    MAX_FAILURE_KIND,
    PLAN_FIELD,
    POLICY,
    TIMED_OUT,
    decode_abort,
    encode_abort,
    encode_header,
    pack_inline,
    read_header,
)

pytestmark = pytest.mark.timeout(30)


# ---------------------------------------------------------------------- the wire


@pytest.mark.parametrize("kind", [0, 1, MAX_FAILURE_KIND])
def test_an_abort_header_carries_its_failure_kind(kind: int) -> None:
    header, text = encode_abort(7, 3, "PlanError: the ranks are a step apart", kind)
    assert len(header) == HEADER_LEN and header[:2] == [MAGIC, ABORT]
    # Through the bytes a receiver reads: the header packed as it is sent, read back.
    got = read_header(pack_inline(header, None))
    assert decode_abort(got) == (7, 3, len(text), kind)


def test_an_abort_of_no_kind_is_other() -> None:
    header, _ = encode_abort(1, 0, "boom")
    assert decode_abort(header)[3] == FailureKind.OTHER
    assert int(FailureKind.OTHER) == 0


def test_a_kind_out_of_range_is_refused_both_ways() -> None:
    with pytest.raises(ValueError, match="failure kind"):
        encode_abort(1, 0, "boom", MAX_FAILURE_KIND + 1)
    header, _ = encode_abort(1, 0, "boom")
    for bad in (-1, MAX_FAILURE_KIND + 1):
        forged = list(header)
        forged[2] = bad
        with pytest.raises(rr.errors.ProtocolError, match="corrupt ABORT header"):
            decode_abort(forged)


def test_a_peer_step_error_has_kind_other_by_default() -> None:
    e = PeerStepError("x", step=1, origin=0, cause="boom")
    assert e.kind == FailureKind.OTHER
    assert PeerStepError("x", step=1, origin=0, cause="c", kind=1).kind == 1


# ---------------------------------------------------------------------- ControlPath


class _Sink:
    def __init__(self) -> None:
        self.got: list[tuple[int, rr.Task, Any, int]] = []
        self.errors: list[BaseException] = []
        self.aborted: list[tuple[int, BaseException]] = []

    def deliver(self, step: int, task: rr.Task, payload: Any, src: int) -> None:
        self.got.append((step, task, payload, src))

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def step_aborted(self, step: int, exc: BaseException) -> None:
        self.aborted.append((step, exc))


class _Outlets:
    """What a ``ControlPath`` sends, recorded instead."""

    def __init__(self) -> None:
        self.control: list[tuple[list[int], bytes, int | None]] = []
        self.closes: list[list[int]] = []

    def send_control(
        self, msgs: list[torch.Tensor], what: tuple[int, object], skip: int | None
    ) -> None:
        text = bytes(msgs[1].tolist()) if len(msgs) > 1 else b""
        self.control.append((read_header(msgs[0]), text, skip))

    def close_edges(self, hdr: list[int]) -> None:
        self.closes.append(list(hdr))


def _control(rank: int = 1) -> tuple[ControlPath, Inlet, _Sink, _Outlets]:
    inlet, sink, out = Inlet(), _Sink(), _Outlets()
    inlet.bind(sink)
    ctl = ControlPath(
        Names(rank, {0: 10, 1: 11, 2: 12}),
        inlet,
        send_control=out.send_control,
        close_edges=out.close_edges,
    )
    return ctl, inlet, sink, out


def test_abort_sends_its_kind_once_and_only_when_open() -> None:
    ctl, _, _, out = _control()
    assert not ctl.abort(3, "boom")  # not open yet: nothing goes out
    ctl.open()
    assert not ctl.abort(3, "boom")  # this step's ABORT counted as sent already
    assert ctl.abort(4, "PlanError: step differs", kind=FailureKind.STEP_DIFFERS)
    assert not ctl.abort(4, "again", kind=FailureKind.STEP_DIFFERS)
    ((hdr, text, skip),) = out.control
    assert decode_abort(hdr) == (4, 11, len(text), FailureKind.STEP_DIFFERS)
    assert text == b"PlanError: step differs" and skip is None


@pytest.mark.parametrize("kind", [FailureKind.OTHER, FailureKind.STEP_DIFFERS, 9])
def test_a_peer_abort_is_relayed_with_its_kind_and_reaches_the_sink(kind: int) -> None:
    ctl, _, sink, out = _control()
    ctl.open()
    ctl.peer_aborted(0, 5, 10, "cause text", kind)
    ctl.peer_aborted(2, 5, 10, "cause text", kind)  # the same step from the other side
    ((hdr, text, skip),) = out.control  # passed on once, not back to the sender
    assert skip == 0 and decode_abort(hdr) == (5, 10, len(text), kind) and text == b"cause text"
    ((step, exc),) = sink.aborted
    assert step == 5 and isinstance(exc, PeerStepError)
    assert (exc.step, exc.origin, exc.cause, exc.kind) == (5, 10, "cause text", kind)
    if kind in (0, 1):
        assert isinstance(exc.kind, FailureKind)  # a known code comes back as the enum
    assert "step 5 failed on rank 0 (global 10): cause text" in str(exc)


def test_a_stuck_policy_abort_goes_out_and_is_passed_on_after_the_step_failed() -> None:
    """Every rank's watchdog fires at once: the stuck rank failed the step for a peer's ABORT
    first, yet its POLICY ABORT goes out, and a peer that failed the step too passes it on
    once and keeps it (issue 41 (d))."""
    ctl, _, _, out = _control()
    ctl.open()
    ctl.peer_aborted(0, 2, 10, "StepTimeoutError: rank 0 timed out")  # rank 0's, first
    assert ctl.abort(2, "StepTimeoutError: the policy", kind=FailureKind.POLICY)
    assert not ctl.abort(2, "again", kind=FailureKind.POLICY)
    ctl.policy_stuck(2)
    assert ctl.cause == (POLICY, 2, (11,))
    assert [decode_abort(h)[3] for h, _, _ in out.control] == [
        FailureKind.OTHER,
        FailureKind.POLICY,
    ]

    peer, _, sink, pout = _control(rank=2)
    peer.open()
    peer.abort(2, "StepTimeoutError: rank 2 timed out")  # its own watchdog, first
    peer.blame(2, [1])
    peer.peer_aborted(1, 2, 11, "StepTimeoutError: the policy", FailureKind.POLICY)
    peer.peer_aborted(0, 2, 11, "StepTimeoutError: the policy", FailureKind.POLICY)  # once
    assert [(decode_abort(h)[3], skip) for h, _, skip in pout.control] == [
        (FailureKind.OTHER, None),
        (FailureKind.POLICY, 1),
    ]
    assert sink.aborted == []  # the step had failed here already
    assert peer.cause == (POLICY, 2, (11,))  # its CLOSE passes the stuck policy on
    assert asyncio.run(peer.stuck_policy(2, 0.0)) == (11, "StepTimeoutError: the policy")
    assert asyncio.run(peer.stuck_policy(3, 0.01)) is None


def test_a_failing_close_carries_the_first_cause() -> None:
    ctl, inlet, _, out = _control()
    ctl.send_close(failed=True)
    assert out.closes == []  # never opened: nothing to close
    ctl.open()
    ctl.blame(2, [0, 7])  # rank 7 is no rank of this channel: not named
    ctl.lose(2, rr.errors.PeerError("later"))  # the first cause wins
    assert ctl.cause == (TIMED_OUT, 2, (10,))
    assert isinstance(inlet.failed, rr.errors.PeerError)
    ctl.send_close(failed=True)
    ctl.send_close(failed=True)  # once
    ((hdr,),) = [out.closes]
    assert hdr[:6] == [MAGIC, CLOSE, TIMED_OUT, 2, 1, 10] and ctl.closing


def test_a_failing_close_without_a_cause_blames_this_rank() -> None:
    ctl, _, _, out = _control()
    ctl.open()
    ctl.at_step(6)
    ctl.send_close(failed=True)
    assert out.closes[0][:6] == [MAGIC, CLOSE, FAILED, 6, 1, 11]


def test_a_peer_failure_is_kept_as_text_and_passed_on() -> None:
    ctl, _, _, _ = _control()
    ctl.open()
    ctl.peer_failed(2, LOST, 3, (10,))
    assert ctl.closed_in(2) and ctl.cause == (LOST, 3, (10,))
    (text,) = ctl.peer_failures().values()
    # The origin first (the global rank it blamed, named), then who passed it on.
    assert text.startswith("rank 0 (global 10) was lost at step 3 (rank 2 (global 12) lost it")


def test_a_clean_close_carries_the_last_step_and_a_failure_after_it_passes_it_on() -> None:
    ctl, _, _, out = _control()
    ctl.open()
    ctl.at_step(4)
    ctl.peer_left(2, 1)  # rank 2 (global 12) left after step 1
    assert ctl.closed_in(2) and ctl.cause is None
    ctl.send_close(failed=True)
    assert out.closes[0][:6] == [MAGIC, CLOSE, LEFT, 1, 1, 12]


def test_a_clean_close_says_its_last_step() -> None:
    ctl, _, _, out = _control()
    ctl.open()
    ctl.at_step(6)
    ctl.send_close()
    assert out.closes[0][:6] == [MAGIC, CLOSE, CLEAN, 6, 1, 11]


# ---------------------------------------------------------------------- Inlet


def test_the_inlet_keeps_early_messages_and_counts_arrivals() -> None:
    inlet = Inlet()
    inlet.deliver(1, rr.Task(1, "F", 0), "a", 0)
    inlet.deliver(1, rr.Task(1, "F", 1), "b", 0)
    sink = _Sink()
    inlet.bind(sink)
    assert [p for _, _, p, _ in sink.got] == ["a", "b"]  # replayed in order
    inlet.deliver(2, rr.Task(1, "F", 0), "c", 2)
    assert inlet.arrivals(1) == {0: 2} and inlet.arrivals(2) == {2: 1}
    for step in range(3, 8):
        inlet.deliver(step, rr.Task(1, "F", 0), None, 0)
    assert inlet.arrivals(1) == {}  # only the last few steps are kept
    first, second = rr.errors.PeerError("first"), rr.errors.PeerError("second")
    inlet.fail(first)
    inlet.fail(second)
    assert inlet.failed is first and sink.errors == [first, second]


def test_the_inlet_fails_a_step_whose_messages_carry_another_plan() -> None:
    """The plan tag (``Inlet``'s design note): a message of the running step sent under
    another tag fails that step at once with a ``StepDiffersError`` and is not handed on,
    nor are the step's later messages; a message of a step not started yet is compared when
    it starts; tag 0 on either side compares nothing."""
    inlet, sink = Inlet("rank 1 (global 1)"), _Sink()
    inlet.bind(sink)
    inlet.at_step(1, 0xAB)
    assert inlet.plan_of(1) == 0xAB and inlet.plan_of(2) == 0
    inlet.deliver(1, rr.Task(1, "F", 0), "same", 0, 0xAB)
    inlet.deliver(1, rr.Task(1, "F", 1), "untagged", 0, 0)
    assert [p for _, _, p, _ in sink.got] == ["same", "untagged"] and not sink.aborted
    inlet.deliver(1, rr.Task(1, "F", 2), "other", 0, 0xCD)
    inlet.deliver(1, rr.Task(1, "F", 3), "later", 0, 0xAB)  # the step's tags differ: dropped
    assert [p for _, _, p, _ in sink.got] == ["same", "untagged"]
    ((step, e),) = sink.aborted
    assert step == 1 and isinstance(e, StepDiffersError)
    assert str(e).startswith("rank 1 (global 1) step 1: the ranks do not run the same step:")
    assert "pipeline rank 0 sent a message of plan #000000cd, this rank runs plan #000000ab" in (
        str(e)
    )
    inlet.deliver(2, rr.Task(1, "F", 0), "early", 0, 0xCD)  # before this rank starts step 2
    assert sink.got[-1][2] == "early" and len(sink.aborted) == 1
    inlet.at_step(2, 0xAB)
    assert [s for s, _ in sink.aborted] == [1, 2]
    inlet.at_step(3, 0)  # no tag: nothing compared
    inlet.deliver(3, rr.Task(1, "F", 0), "any", 0, 0xCD)
    assert sink.got[-1][2] == "any" and len(sink.aborted) == 2


def test_a_data_header_carries_the_plan_tag() -> None:
    h = encode_header(3, 7, rr.Task(1, "F", 2), torch.zeros(2, 3), inline=True, plan=0xABC)
    assert len(h) == HEADER_LEN and h[PLAN_FIELD] == 0xABC
    assert read_header(pack_inline(h, torch.zeros(2, 3)))[PLAN_FIELD] == 0xABC
    assert encode_header(0, 0, rr.Task(1, "F", 0), None)[PLAN_FIELD] == 0


def test_a_sink_that_raises_fails_its_stage() -> None:
    class Raising(_Sink):
        def deliver(self, step: int, task: rr.Task, payload: Any, src: int) -> None:
            raise RuntimeError("bad delivery")

    inlet, sink = Inlet(), Raising()
    inlet.bind(sink)
    inlet.deliver(1, rr.Task(1, "F", 0), None, 0)
    assert [str(e) for e in sink.errors] == ["bad delivery"]


# ---------------------------------------------------------------------- Sender


class _Work:
    def wait(self, *_: Any) -> bool:
        return True


class _Group:
    """A process group that records what is sent (a copy: the buffer may be reused)."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[torch.Tensor, int, int]] = []
        self.fail = fail
        self.lock = threading.Lock()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        with self.lock:
            self.sent.append((tensors[0].clone(), dst, tag))
        return _Work()


def _sender(
    pg: _Group, *, inline_send: int = 1 << 20, max_bytes: int = 1 << 20
) -> tuple[Sender, list[rr.RRFPError]]:
    lost: list[rr.RRFPError] = []
    s = Sender(
        1,
        names=Names(0, {0: 4, 1: 5}),
        pg=pg,
        peer=1,
        dev=Device("cpu"),
        limits=Limits(
            max_bytes=max_bytes,
            bound_name="Stage(max_message_bytes=...)",
            inline0=HEADER_BYTES + 64,
            inline_send=inline_send,
        ),
        lost=lost.append,
    )
    return s, lost


def test_a_small_message_leaves_from_the_caller_inline() -> None:
    pg = _Group()
    s, _ = _sender(pg)
    s.send(0, rr.Task(1, "F", 0), torch.ones(4))
    ((msg, dst, tag),) = pg.sent
    h = read_header(msg)
    assert (dst, tag) == (1, 0) and h[:3] == [MAGIC, DATA_INLINE, 0]
    assert (s.seq, s.direct_sent, s.inline_sent) == (1, 1, 1)


def test_an_edge_grows_after_a_large_message() -> None:
    """The capacity rule: a payload over the capacity goes as header + payload, and then
    the capacity holds it, so the next one of that size is inline again."""
    pg = _Group()
    s, _ = _sender(pg)
    big = torch.arange(256, dtype=torch.float32)  # 1 KiB > 64 bytes inline
    s.send(0, rr.Task(1, "F", 0), big)
    assert [read_header(m)[1] for m, _, _ in pg.sent[:1]] == [DATA] and len(pg.sent) == 2
    assert torch.equal(pg.sent[1][0], big)
    assert s.cap >= HEADER_BYTES + big.nbytes
    s.send(0, rr.Task(1, "F", 1), big)
    assert len(pg.sent) == 3 and read_header(pg.sent[2][0])[:3] == [MAGIC, DATA_INLINE, 1]


def test_a_payload_over_the_bound_is_refused_where_it_is_sent() -> None:
    pg = _Group()
    s, _ = _sender(pg, max_bytes=100)
    with pytest.raises(rr.errors.ProtocolError, match=r"Stage\(max_message_bytes=\.\.\.\)"):
        s.send(0, rr.Task(1, "F", 0), torch.ones(100))
    assert pg.sent == [] and s.seq == 0


def test_a_failed_post_blames_the_peer() -> None:
    s, lost = _sender(_Group(fail=True))
    with pytest.raises(
        rr.errors.PeerError, match=r"lost rank 1 \(global 5\): sending message seq 0"
    ):
        s.send(0, rr.Task(1, "F", 0), torch.ones(4))
    (err,) = lost  # handed to the loop, like a failed send on the thread
    assert "edge rank 0 -> rank 1 (global 4 -> 5)" in str(err)


def test_the_sender_thread_posts_queued_messages_then_the_close() -> None:
    pg = _Group()
    s, _ = _sender(pg, inline_send=0)  # every payload through the thread
    s.start()
    for mb in range(3):
        s.send(0, rr.Task(1, "F", mb), torch.full((4,), float(mb)))
    header, _ = encode_abort(0, 4, "")
    s.queue_control([pack_inline(header, None)], (-1, "the ABORT of step 0"))
    s.end([MAGIC, CLOSE] + [0] * (HEADER_LEN - 2))
    s.thread.join(10)
    assert not s.thread.is_alive() and s.direct_sent == 0
    kinds = [read_header(m)[1] for m, _, _ in pg.sent]
    assert kinds == [DATA_INLINE] * 3 + [ABORT, CLOSE]  # in order
    assert [read_header(m)[2] for m, _, _ in pg.sent[:3]] == [0, 1, 2]


# ---------------------------------------------------------------------- Names


def test_names() -> None:
    n = Names(1, {0: 3, 1: 5})
    assert (
        n.me() == "rank 1 (global 5)" and n.names([0, 1]) == "rank 0 (global 3), rank 1 (global 5)"
    )
    assert n.name_global(3) == "rank 0 (global 3)" and n.name_global(9) == "global rank 9"
    assert n.names_global([]) == "an unknown rank" and n.names([]) == "no rank"
    assert n.edge_out(0) == "edge rank 1 -> rank 0 (global 5 -> 3)"
    assert n.edge_in(0) == "edge rank 0 -> rank 1 (global 3 -> 5)"
