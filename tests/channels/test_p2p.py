"""The torch.distributed p2p channel: out-of-order delivery, variable shapes, bad headers."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import torch

import rrfp_async as rr
from rrfp_async.channels._p2p import P2PChannel
from rrfp_async.channels._wire import HEADER_LEN, LOST, MAGIC, encode_header
from tests._pool import pooled_spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("p2p_io"),  # every test under both receive modes
]


class _Sink:
    def __init__(self, want: int) -> None:
        self.got: list[tuple[int, rr.Task, Any, int]] = []
        self.errors: list[BaseException] = []
        self.want = want
        self.done = asyncio.Event()

    def deliver(self, step: int, task: rr.Task, payload: Any, src: int) -> None:
        self.got.append((step, task, payload, src))
        if len(self.got) >= self.want:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.done.set()


def _channel(rank: int) -> P2PChannel:
    return P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[1 - rank] if rank else [],
        outbound=[1] if rank == 0 else [],
    )


async def _out_of_order(rank: int) -> list[tuple[int, str, tuple[int, ...], str, float]]:
    ch = _channel(rank)
    sink = _Sink(4)
    ch.bind(sink)
    async with ch:
        if rank == 0:
            ch.send(1, 0, rr.Task(1, "F", 3), torch.full((1, 7, 4), 3.0))  # mb 3 first
            ch.send(1, 0, rr.Task(1, "F", 2), torch.full((1, 3, 4), 2.0))  # then mb 2
            ch.send(1, 1, rr.Task(1, "B", 0), torch.arange(5))  # int64, next step
            ch.send(1, 0, rr.Task(1, "W", 1), None)  # no payload
            return []
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        return [
            (
                step,
                str(t),
                tuple(p.shape) if p is not None else (),
                str(getattr(p, "dtype", None)),
                float(p.sum()) if p is not None else 0.0,
            )
            for step, t, p, src in sink.got
        ]


async def _forged(rank: int, header: list[int], group: Any) -> str:
    import torch.distributed as dist

    if rank == 0:  # forge the header by hand, no channel on this side
        dist.send(torch.tensor(header, dtype=torch.int64), 1, group=group)
        return ""
    ch = P2PChannel(1, global_ranks={0: 0, 1: 1}, inbound=[0], outbound=[], group=group)
    sink = _Sink(1)
    ch.bind(sink)
    async with ch:
        await asyncio.wait_for(sink.done.wait(), 60)
        return repr(sink.errors[0]) if sink.errors else "no error"


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {"ordered": rr.run(_out_of_order(rank))}
    dist.barrier()
    good = encode_header(0, 0, rr.Task(1, "F", 0), torch.zeros(2, 3))
    cases = {
        "magic": [0xBAD, *good[1:]],
        "gap": [*good[:2], 5, *good[3:]],
        "huge": [*good[:8], 2, 1 << 20, 1 << 20, *good[11:]],
        "dtype": [*good[:7], 99, *good[8:]],
        "ndim": [*good[:8], 12, *good[9:]],
    }
    for name, h in cases.items():
        assert len(h) == HEADER_LEN
        # A channel that saw a corrupt message is done; each case gets a fresh group so
        # nothing of the previous case can reach it.
        group = dist.new_group([0, 1])
        out[name] = rr.run(_forged(rank, h, group))
        dist.barrier()
    return out


def test_out_of_order_variable_shapes_and_bad_headers() -> None:
    res = pooled_spawn(_worker, 2, timeout=150)[1]
    assert res["ordered"] == [
        (0, "1F3", (1, 7, 4), "torch.float32", 84.0),
        (0, "1F2", (1, 3, 4), "torch.float32", 24.0),
        (1, "1B0", (5,), "torch.int64", 10.0),
        (0, "1W1", (), "None", 0.0),
    ]
    for name, why in [
        ("magic", "bad magic"),
        ("gap", "sequence number 5, expected 0"),
        ("huge", "more than the bound of 268435456 bytes (256 MiB): refused before allocating"),
        ("dtype", "unknown dtype code 99"),
        ("ndim", "ndim 12 out of range"),
    ]:
        msg = res[name]
        assert "ProtocolError" in msg, (name, msg)
        assert why in msg, (name, msg)
        assert "edge rank 0 -> rank 1" in msg and "seq 0" in msg, (name, msg)


def test_header_encoding_is_pure_and_checked() -> None:
    h = encode_header(7, 2, rr.Task(3, "I", 5), torch.zeros(2, 3, dtype=torch.bfloat16))
    assert h[:9] == [MAGIC, 1, 7, 2, 3, 2, 5, 2, 2] and h[9:11] == [2, 3]
    with pytest.raises(rr.errors.ProtocolError, match="unsupported dtype"):
        encode_header(0, 0, rr.Task(0, "F", 0), torch.zeros(1, dtype=torch.complex64))
    with pytest.raises(rr.errors.ProtocolError, match="dims"):
        encode_header(0, 0, rr.Task(0, "F", 0), torch.zeros([1] * 8))


async def _growing(rank: int) -> dict[str, Any]:
    # inline_bytes=64: a 1 KiB payload first travels as header + payload, then the edge's
    # capacity has grown on both sides and the same size goes inline; a tiny one after it is
    # inline too; a larger one grows it again. Every inline payload is copied out.
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[0] if rank else [],
        outbound=[1] if rank == 0 else [],
        inline_bytes=64,
        max_bytes=8192,
    )
    sizes = [4, 256, 256, 2, 1024, 1024, 0]
    sink = _Sink(len(sizes))
    ch.bind(sink)
    async with ch:
        if rank == 0:
            refused = ""
            for i, n in enumerate(sizes):
                if i == 3:  # too large for max_bytes: refused here, and it takes no seq
                    try:
                        ch.send(1, 0, rr.Task(1, "F", 99), torch.zeros(4096))
                    except rr.errors.ProtocolError as e:
                        refused = str(e)
                payload = torch.arange(n, dtype=torch.float32) + i if n else None
                ch.send(1, 0, rr.Task(1, "F", i), payload)
            return {"inline_sent": ch.inline_sent, "sent": ch.sent, "refused": refused}
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        return {
            "got": [
                (
                    str(t),
                    None
                    if p is None
                    else (p.numel(), float(p.sum()), p.untyped_storage().nbytes()),
                )
                for _, t, p, _ in sink.got
            ]
        }


def _grow_worker(rank: int, world: int) -> dict[str, Any]:
    return rr.run(_growing(rank))


def test_inline_capacity_grows_in_step_on_both_sides() -> None:
    sender, receiver = pooled_spawn(_grow_worker, 2, timeout=120)
    sizes = [4, 256, 256, 2, 1024, 1024, 0]
    got = receiver["got"]
    assert [t for t, _ in got] == [f"1F{i}" for i in range(len(sizes))]
    for i, (n, (_, p)) in enumerate(zip(sizes, got, strict=True)):
        if n == 0:
            assert p is None
            continue
        numel, total, storage = p
        assert numel == n and total == sum(range(n)) + i * n
        # Every payload holds its own bytes, exactly: none pins the receive buffer (sized
        # for the largest seen, and more), which a byte budget could not predict.
        assert storage == 4 * n, (i, storage)
    # Sizes 256 floats and 1024 floats did not fit the first time; every other message went
    # inline (the None payload included).
    assert sender["sent"] == len(sizes) and sender["inline_sent"] == len(sizes) - 2
    # The refused payload named its size; the receiver saw no gap in the sequence numbers.
    assert "has 16384 bytes, more than the bound of 8192 bytes" in sender["refused"]
    assert "P2PChannel(max_bytes=...)" in sender["refused"]


async def _mixed(rank: int) -> dict[str, Any]:
    # Small payloads (<= inline_send_bytes) are posted by send() itself, large ones by the
    # edge's sender thread: sent back to back, they must still leave in send() order.
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[0] if rank else [],
        outbound=[1] if rank == 0 else [],
        inline_send_bytes=1024,
    )
    sizes = [4, 4096, 16, 0, 300, 2, 65536, 8, 1, 256] * 6
    sink = _Sink(len(sizes))
    ch.bind(sink)
    async with ch:
        if rank == 0:
            for i, n in enumerate(sizes):
                payload = torch.arange(n, dtype=torch.float32) + i if n else None
                ch.send(1, 0, rr.Task(1, "F", i), payload)
            return {"sent": ch.sent, "direct": ch.direct_sent}
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        return {
            "got": [
                (t.mb, None if p is None else (p.numel(), float(p.sum())))
                for _, t, p, _ in sink.got
            ]
        }


def _mixed_worker(rank: int, world: int) -> dict[str, Any]:
    return rr.run(_mixed(rank))


def test_direct_and_queued_sends_keep_their_order() -> None:
    sender, receiver = pooled_spawn(_mixed_worker, 2, timeout=120)
    sizes = [4, 4096, 16, 0, 300, 2, 65536, 8, 1, 256] * 6
    # Both paths were taken: 4 of 10 sizes are over 1024 bytes (queued), and a small one
    # right behind a queued one waits in the queue too.
    assert sender["sent"] == len(sizes)
    assert 0 < sender["direct"] <= 6 * 6
    # Every message arrived once, in order, with its own values: the payloads copied out of
    # the reused receive buffer were not overwritten by the later messages.
    want = [(i, None if n == 0 else (n, sum(range(n)) + i * n)) for i, n in enumerate(sizes)]
    assert receiver["got"] == want


class _BrokenGroup:
    """A process group whose sends fail, like one whose peer died."""

    def send(self, *args: Any) -> Any:
        raise RuntimeError("Connection closed by peer")


async def _direct_failure(rank: int) -> dict[str, Any]:
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1},
        inbound=[0] if rank else [],
        outbound=[1] if rank == 0 else [],
    )
    sink = _Sink(1)
    ch.bind(sink)
    out: dict[str, Any] = {}
    async with ch:
        if rank == 0:
            edge = ch._senders[1]  # the edge's part: its group fails from now on
            pg, edge.pg = edge.pg, _BrokenGroup()
            try:
                ch.send(1, 0, rr.Task(1, "F", 0), torch.ones(4))
            except rr.errors.PeerError as e:
                out["raised"] = str(e)
            await asyncio.sleep(0.05)  # the loss reaches the stage through the loop
            out["stage_got"] = [str(e) for e in sink.errors]
            out["cause"] = ch._control.cause
            edge.pg = pg  # the CLOSE still goes out
    return out


def _direct_failure_worker(rank: int, world: int) -> dict[str, Any]:
    return rr.run(_direct_failure(rank))


def test_a_send_failing_where_it_is_posted_blames_the_peer() -> None:
    sender, _ = pooled_spawn(_direct_failure_worker, 2, timeout=120)
    assert (
        "rank 0 (global 0) lost rank 1 (global 1): sending message seq 0 (1F0)"
        in (sender["raised"])
    )
    # The cause in the receive side's words: which side of a dead peer's edge notices first
    # is a race (test_dead_rank saw the send first), the message is not.
    assert "failed (the connection broke: the process died or was killed): " in sender["raised"]
    # Like a send that fails on the sender thread: the stage fails and the CLOSE says LOST.
    assert sender["stage_got"] == [sender["raised"]]
    assert sender["cause"][0] == LOST and sender["cause"][2] == (1,)  # global rank 1


def test_inline_send_bytes_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="inline_send_bytes must be >= 0"):
        P2PChannel(0, global_ranks={0: 0}, inbound=[], outbound=[], inline_send_bytes=-1)


# ---------------------------------------------------------------------- the trust bound


class _Out:
    """Each task returns a float32 tensor of ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        self.numel = numel

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0)
        return torch.zeros(self.numel)


def _bound_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=1)
    sched = rr.StepSchedule.build(plan, "1f1b")
    out: dict[str, Any] = {}

    # 1. A forged header announces 2 GiB (what the old default accepted) to a stage with the
    #    default bound: refused, and nothing that size is allocated.
    if rank == 0:
        header = encode_header(0, 0, rr.Task(1, "F", 0), torch.zeros(2))
        header[8:10] = [1, 1 << 29]  # 2**29 float32 = 2 GiB
        dist.send(torch.tensor(header, dtype=torch.int64), 1, group=groups.p2p)
        close = torch.zeros(HEADER_LEN, dtype=torch.int64)
        dist.recv(close, 1, group=groups.p2p)  # the failed stage's CLOSE, with its cause
        out["close"] = close.tolist()
    else:
        big: list[int] = []
        empty = torch.empty

        def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
            t = empty(*args, **kwargs)
            if t.numel() * t.element_size() > 64 << 20:
                big.append(t.numel() * t.element_size())
            return t

        torch.empty = spy  # type: ignore[assignment]
        stage = rr.DistributedStage(layout, sched, _Out(2), groups=groups, verify_plan=False)
        try:
            rr.run(_run_one(stage, out))
        finally:
            torch.empty = empty  # type: ignore[assignment]
        out["big_allocations"] = big
        out["default_bound"] = stage.max_message_bytes
    dist.barrier()

    # 2. The sender's side: an output over the bound is refused where it is sent; the peer
    #    learns why from the CLOSE.
    stage = rr.DistributedStage(
        layout, sched, _Out(512 if rank == 0 else 1), groups=groups, max_message_bytes=1024
    )
    sent: dict[str, Any] = {}
    rr.run(_run_one(stage, sent))
    out["sender_case"] = sent
    stage.channel.close(10.0)
    return out


async def _run_one(stage: rr.DistributedStage, out: dict[str, Any]) -> None:
    try:
        async with stage:
            await stage.run_step([0])
    except rr.RRFPError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)


def test_messages_over_the_bound_are_refused_on_both_sides() -> None:
    sender, receiver = pooled_spawn(_bound_worker, 2, timeout=150)
    assert receiver["default_bound"] == 256 << 20
    msg = receiver["message"]
    assert receiver["error"] == "ProtocolError", msg
    assert "edge rank 0 -> rank 1 (global 0 -> 1): message seq 0 (1F0 of step 0)" in msg
    assert "announces a payload of 2147483648 bytes" in msg
    assert "more than the bound of 268435456 bytes (256 MiB): refused before allocating" in msg
    assert "DistributedStage(max_message_bytes=...)" in msg
    assert receiver["big_allocations"] == []
    # The failed rank's CLOSE says it failed (cause 1), at step 0, blaming itself (global 1).
    close = sender["close"]
    assert close[:2] == [MAGIC, 2] and close[2:6] == [1, 0, 1, 1], close

    s, r = sender["sender_case"], receiver["sender_case"]
    assert s["error"] == "ProtocolError", s
    head = "rank 0 step 0: the message for 1F0 ((512,) torch.float32) has 2048 bytes"
    assert head in s["message"], s
    assert "more than the bound of 1024 bytes (1 KiB)" in s["message"]
    assert "edge rank 0 -> rank 1 (global 0 -> 1)" in s["message"]
    assert "DistributedStage(max_message_bytes=...) on every rank" in s["message"]
    # The peer's step fails at once with the sender's cause (its ABORT), not its CLOSE.
    assert r["error"] == "PeerStepError", r
    assert "step 0 failed on rank 0 (global 0): ProtocolError: " + head in r["message"], r


# ------------------------------------------------------------- several inbound edges

# What each sender sends, in rounds: (payload kind, elements). Edge 1 grows its capacity
# far beyond the others' (300 KiB payloads go as header + payload the first time, inline
# after), edge 2 stays small, edge 3 mixes pytrees, empty messages and a 1 MiB payload:
# with shared I/O the receive buffer is sized for the largest edge and every edge's
# messages land in it, their payloads received from their own source only.
_SCRIPTS: dict[int, list[tuple[str, int]]] = {
    1: [("t", 75_000), ("t", 3), ("t", 75_000), ("none", 0), ("t", 16), ("t", 75_000)],
    2: [("t", 1), ("t", 4), ("t", 2), ("t", 8), ("none", 0), ("t", 5)],
    3: [("tree", 40), ("t", 262_144), ("none", 0), ("t", 7), ("tree", 3), ("t", 262_144)],
}
_ROUNDS = 4  # each round, the senders take turns in a different order (below)
_TURNS = [[1, 2, 3], [1, 3, 2], [3, 1, 2], [3, 2, 1]]  # 11 changes of sender


def _message(src: int, i: int) -> tuple[rr.Task, Any]:
    """The ``i``-th message from ``src``: a task that names it, values that name it too."""
    kind, n = _SCRIPTS[src][i % len(_SCRIPTS[src])]
    task = rr.Task(
        0, cast(rr.Kind, "FBIW"[i % 4]), 100 * src + (97 - i)
    )  # microbatches out of order
    v = float(1000 * src + i)
    if kind == "none":
        return task, None
    if kind == "tree":
        return task, (torch.full((n,), v), {"i": torch.tensor([i]), "src": src})
    return task, torch.full((n,), v)


def _summary(payload: Any) -> Any:
    if payload is None:
        return None
    if isinstance(payload, torch.Tensor):
        return ("t", payload.numel(), float(payload.min()), float(payload.max()))
    t, d = payload
    return ("tree", t.numel(), float(t.min()), float(t.max()), int(d["i"]), d["src"])


async def _multi_edge(rank: int, sides: Any) -> dict[str, Any]:
    import torch.distributed as dist

    ch = P2PChannel(
        rank,
        global_ranks={r: r for r in range(4)},
        inbound=[1, 2, 3] if rank == 0 else [],
        outbound=[0] if rank else [],
    )
    per = len(_SCRIPTS[1])
    sink = _Sink(3 * _ROUNDS * per)
    ch.bind(sink)
    async with ch:
        if rank:
            i = 0
            for turns in _TURNS[:_ROUNDS]:
                for who in turns:
                    # One sender at a time sends a burst (the others wait at the barrier),
                    # so arrivals interleave the edges in an order that changes every round.
                    if who == rank:
                        for _ in range(per):
                            ch.send(0, i // per, *_message(rank, i))
                            i += 1
                    await asyncio.to_thread(dist.barrier, sides)
            return {}
        await asyncio.wait_for(sink.done.wait(), 120)
        assert not sink.errors, sink.errors
        return {
            "got": [(src, step, str(t), _summary(p)) for step, t, p, src in sink.got],
            "handoffs": ch.handoffs,
            "io": ch.io,
        }


def _multi_edge_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    sides = dist.new_group([1, 2, 3])  # every rank calls new_group, in the same order
    return rr.run(_multi_edge(rank, sides))


def test_several_inbound_edges_in_adversarial_orders_land_in_the_right_place(
    p2p_io: str,
) -> None:
    got = pooled_spawn(_multi_edge_worker, 4, timeout=160)[0]
    assert got["io"] == p2p_io
    arrivals = got["got"]
    per = len(_SCRIPTS[1])
    for src in (1, 2, 3):
        mine = [a for a in arrivals if a[0] == src]
        want = []
        for i in range(_ROUNDS * per):
            task, payload = _message(src, i)
            want.append((src, i // per, str(task), _summary(payload)))
        # Every message once, on its own edge, in that edge's order, with its own values
        # (a payload received from the wrong source, or a buffer reused under a view that
        # was handed on, shows up here).
        assert mine == want, src
    # Not vacuous: the edges really interleaved (a burst of each sender, in turns).
    # Each edge's messages arrived in several runs, between the other edges' (a large
    # message that leaves from a sender thread may arrive after the turn has passed, so
    # not all 12 runs are required).
    runs = [a[0] for i, a in enumerate(arrivals) if i == 0 or arrivals[i - 1][0] != a[0]]
    assert all(runs.count(src) >= 3 for src in (1, 2, 3)), runs
    batches, items = got["handoffs"]
    if p2p_io == "shared":  # every completion went through the inbox
        assert 0 < batches <= items and items >= len(arrivals)
    else:
        assert (batches, items) == (-1, -1)


class _LateWork:
    """A send that reads its buffer only when waited for: what a ``Work`` may do until
    ``wait()`` returns (gloo writes the rest from its own thread once the socket is full)."""

    def __init__(self, fn: Any) -> None:
        self._fn: Any = fn

    def wait(self, *_: Any) -> bool:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
        return True


class _LateSends:
    """A process group whose sends happen at ``wait()`` (everything else passes through)."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _LateWork:
        return _LateWork(lambda: self._pg.send(tensors, dst, tag).wait())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)


async def _reused_buffer(rank: int, n: int) -> list[float]:
    ch = _channel(rank)
    sink = _Sink(n)
    ch.bind(sink)
    async with ch:
        if rank == 0:
            edge = ch._senders[1]
            edge.pg = _LateSends(edge.pg)
            # One output buffer for every microbatch, overwritten by the next forward (as a
            # CUDA graph's static output is): 2 MiB, over the inline capacity, so the first
            # goes as header + payload, and over inline_send_bytes, so through the sender.
            buf = torch.empty(512 * 1024)
            for mb in range(n):
                buf.fill_(float(mb))
                ch.send(1, 0, rr.Task(1, "F", mb), buf)
            buf.fill_(-1.0)
            return []
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        out: list[Any] = []
        for _, task, p, _ in sorted(sink.got, key=lambda g: g[1].mb):
            assert task.mb == len(out)
            out.append(float(p.min()) if float(p.min()) == float(p.max()) else float("nan"))
        return out


def _reused_worker(rank: int, world: int) -> list[float]:
    return rr.run(_reused_buffer(rank, 4))


def test_a_reused_output_buffer_is_not_torn_in_flight() -> None:
    """A tensor handed to ``send`` cannot change in flight (ARCHITECTURE invariant 10): each
    message carries the values the buffer had at ``send``. Red before: the message over the
    inline capacity went to the sender thread without a copy and carried the next values."""
    got = pooled_spawn(_reused_worker, 2, timeout=150)[1]
    assert got == [0.0, 1.0, 2.0, 3.0]


class _AbortSink(_Sink):
    """A sink with the ``step_aborted`` hook: it records the ABORTs it is told of."""

    def __init__(self) -> None:
        super().__init__(1)
        self.aborted: list[tuple[int, BaseException]] = []

    def step_aborted(self, step: int, exc: BaseException) -> None:
        self.aborted.append((step, exc))
        self.done.set()


async def _abort_kind(rank: int) -> tuple[int, int, int, str] | None:
    from rrfp_async._errors import FailureKind

    # A chain 0 <-> 1 <-> 2: rank 2 is no neighbour of rank 0, the ABORT's origin.
    ch = P2PChannel(
        rank,
        global_ranks={0: 0, 1: 1, 2: 2},
        inbound=[r for r in (rank - 1, rank + 1) if 0 <= r < 3],
        outbound=[r for r in (rank - 1, rank + 1) if 0 <= r < 3],
    )
    sink = _AbortSink()
    ch.bind(sink)
    async with ch:
        if rank == 0:
            assert ch.abort(
                5, "PlanError: the ranks are a step apart", kind=FailureKind.STEP_DIFFERS
            )
            return None
        await asyncio.wait_for(sink.done.wait(), 60)
        assert not sink.errors, sink.errors
        ((step, exc),) = sink.aborted
        assert isinstance(exc, rr.PeerStepError)
        return step, exc.origin, int(exc.kind), exc.cause


def _abort_kind_worker(rank: int, world: int) -> tuple[int, int, int, str] | None:
    return rr.run(_abort_kind(rank))


def test_an_abort_kind_reaches_a_rank_that_is_no_neighbour() -> None:
    """The failure kind travels as a code in the ABORT's header and is relayed hop by hop
    unchanged: rank 2 hears of rank 0's failure through rank 1, with its kind."""
    got = pooled_spawn(_abort_kind_worker, 3, timeout=150)
    want = (5, 0, 1, "PlanError: the ranks are a step apart")  # 1: FailureKind.STEP_DIFFERS
    assert got == [None, want, want]
