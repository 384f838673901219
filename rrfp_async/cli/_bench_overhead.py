"""Overheads of the runtime in isolation, each against its raw baseline (``bench overhead``).

Four sections, each a function returning rows (plain dicts; nothing is printed here):

* :func:`decision_latency` -- the policy call plus the stage's bookkeeping per dispatch, no
  compute: a real ``StageLoop`` (one rank, in-process channel) whose executor returns at
  once, on a hint whose admitted ready set holds ``k`` tasks at every decision; per decision
  = step wall time / tasks run. uvloop and asyncio, several policies.
* :func:`message_cost` -- one message through ``channels.P2PChannel`` (header + payload,
  sender / listener threads, delivery to a sink on the loop) against a raw blocking gloo
  ``send``/``recv`` of the same tensor: ping-pong between 2 processes, one-way = round
  trip / 2.
* :func:`tp_coordination` -- one TP decision through ``channels.DecisionChannel`` (leader
  publishes, followers receive) against a raw blocking ``dist.broadcast`` of the same
  ``int64[6]`` on the same group, TP = 2 and 4 processes; plus the coordination measured
  inside a real ``DistributedStage`` (coordinated vs uncoordinated step time), and the share
  of step time for tasks of ``compute_ms``.
* :func:`split_backward_cost` -- ``I`` + ``W`` against ``B`` on a middle stage of the example
  model through ``TorchStageExecutor`` tasks: real CPU compute, no emulated time.

Timing design: every figure is a median over batches (a batch times many back-to-back
operations, so timer and scheduling noise is amortised); a raw baseline runs in batches
interleaved with the variant it is compared to, so a noisy neighbour moves both. Each
multi-process part is one ``spawn`` job (gloo on 127.0.0.1, one torch thread per process)
with its own timeout.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "DECISION_TARGET_US",
    "MESSAGE_TARGET_RATIO",
    "SPLIT_TARGET_RATIO",
    "TP_SHARE_TARGET",
    "TP_TARGET_RATIO",
    "decision_latency",
    "decision_schedule",
    "message_cost",
    "split_backward_cost",
    "split_backward_cost_isolated",
    "tp_coordination",
]

Row = dict[str, Any]

DECISION_TARGET_US = 20.0
"""Target: median decision latency (µs) for ready sets up to 64."""
MESSAGE_TARGET_RATIO = 1.3
"""Target: per-message cost at most this times a raw blocking gloo send of the same bytes."""
TP_TARGET_RATIO = 1.25
"""Target: TP coordination per decision at most this times a raw blocking broadcast."""
TP_SHARE_TARGET = 0.01
"""Target: TP coordination under this share of step time (tasks of 5 ms or more)."""
SPLIT_TARGET_RATIO = 1.1
"""Target: I + W compute at most this times B compute."""


_CONTENDED = 3.0
"""Batches whose median is this many times their lower decile ran on a contended machine
(most of them measured scheduling delays, not transport)."""
_QUANTILE = 0.1
"""Transport figures are the lower decile of short batches: on a shared machine the batches
that no other process disturbed (see :func:`message_cost`)."""


def _med(xs: Iterable[float]) -> float:
    return float(statistics.median(list(xs)))


def _low(xs: Sequence[float], q: float = _QUANTILE) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank, rounded down)."""
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


def _transport(raw: Sequence[float], variant: Sequence[float], per: float) -> dict[str, Any]:
    """Figures of a variant against its raw baseline from interleaved batch times (seconds
    per batch; ``per`` operations per batch): lower deciles (the headline), medians, the
    median of the paired ratios, and whether the machine was contended."""
    return {
        "raw_us": 1e6 * _low(raw) / per,
        "channel_us": 1e6 * _low(variant) / per,
        "ratio": _low(variant) / _low(raw),
        "raw_median_us": 1e6 * _med(raw) / per,
        "channel_median_us": 1e6 * _med(variant) / per,
        "ratio_paired": _med(c / r for c, r in zip(variant, raw, strict=True)),
        "contended": _med(raw) > _CONTENDED * _low(raw)
        or _med(variant) > _CONTENDED * _low(variant),
    }


# ------------------------------------------------------------------ decision latency


class _NoopExecutor:
    """Returns at once; with ``yield_once`` it yields to the loop once per task."""

    def __init__(self, yield_once: bool = False) -> None:
        self.yield_once = yield_once
        self.calls = 0

    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        self.calls += 1
        if self.yield_once:
            await asyncio.sleep(0)
        return None


class _ReadyCounter:
    """A stage observer that records the size of the admitted ready set at each decision."""

    active = True

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def step_start(self, stage: Any) -> None:
        pass

    def message(self, stage: Any, task: Any, src: int) -> None:
        pass

    def ready(self, stage: Any, task: Any) -> None:
        pass

    def decision(self, stage: Any, task: Any, ready: Sequence[Any], idle: float) -> None:
        self.sizes.append(len(ready))

    def task_start(self, stage: Any, task: Any) -> None:
        pass

    def task_end(self, stage: Any, task: Any, start: float, end: float) -> None:
        pass

    def stall(self, stage: Any, reason: str) -> None:
        pass

    def tp_decision(self, stage: Any, task: Any, seq: int, sent: bool) -> None:
        pass

    def step_end(self, stage: Any, stats: Any) -> None:
        pass


def decision_schedule(ready: int, microbatches: int | None = None) -> Any:
    """A one-rank schedule whose admitted ready set holds ``ready`` tasks at every decision.

    The hint is ``F0 .. F(k-1)`` then ``B0 F(k) B1 F(k+1) ...`` with the admission bound ``k``
    (first-stage forwards: their inputs are present from the start). While forwards remain,
    each decision sees exactly ``k`` admitted ready tasks under every policy (forwards the
    bound admits, plus the backwards of the forwards in flight); only the last ``k - 1``
    decisions (the final backwards) see fewer. Default ``microbatches``: ``max(32, 8k)``, so
    that tail is at most 1/16 of the decisions.
    """
    from .._tasks import StepPlan, Task, Topology
    from ..policies._schedule import StepSchedule

    k = ready
    if k < 1:
        raise ValueError(f"ready must be >= 1, got {k}")
    m = microbatches if microbatches is not None else max(32, 8 * k)
    if m < k:
        raise ValueError(f"need microbatches >= ready ({m} < {k})")
    order = [Task(0, "F", i) for i in range(k)]
    for i in range(m):
        order.append(Task(0, "B", i))
        if i + k < m:
            order.append(Task(0, "F", i + k))
    plan = StepPlan(topology=Topology(stages=1), microbatches=m)
    return StepSchedule.build(plan, {0: order}, max_inflight=k)


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _decision_cases(
    ready_sizes: Sequence[int], policies: Sequence[str], microbatches: int | None
) -> list[dict[str, Any]]:
    """Build (and warm up) one stage per case on the running loop."""
    from ..channels._local import LocalChannel
    from ..loop._stage import StageLoop

    loop_name = _loop_name(asyncio.get_running_loop())
    cases: list[dict[str, Any]] = []
    for k in ready_sizes:
        sched = decision_schedule(k, microbatches)
        mbs = list(range(sched.plan.microbatches))
        for pol in policies:
            counter = _ReadyCounter()
            probe = StageLoop(
                0,
                schedule=sched,
                executor=_NoopExecutor(),
                endpoint=LocalChannel(1).endpoint(0),
                policy=pol,
                observer=counter,
            )
            await probe.run_step(mbs)  # untimed: the ready-set sizes the policy saw
            ex = _NoopExecutor()
            stage = StageLoop(
                0, schedule=sched, executor=ex, endpoint=LocalChannel(1).endpoint(0), policy=pol
            )
            ystage = StageLoop(
                0,
                schedule=sched,
                executor=_NoopExecutor(yield_once=True),
                endpoint=LocalChannel(1).endpoint(0),
                policy=pol,
            )
            await stage.run_step(mbs)  # warm up (program build, caches)
            await ystage.run_step(mbs)
            cases.append(
                {
                    "loop": loop_name,
                    "k": k,
                    "policy": pol,
                    "stage": stage,
                    "ystage": ystage,
                    "ex": ex,
                    "tasks": len(sched.hint[0]),
                    "mbs": mbs,
                    "sizes": counter.sizes,
                    "steps": 1,
                    "us": [],
                    "cpu": [],
                    "yus": [],
                    "decisions": [],
                }
            )
    return cases


async def _decision_round(cases: list[dict[str, Any]]) -> None:
    """One timed step of every case (no-op executor, then the yielding one)."""
    for c in cases:
        t = time.perf_counter()
        c0 = time.thread_time()
        stats = await c["stage"].run_step(c["mbs"])
        cpu = time.thread_time() - c0
        dt = time.perf_counter() - t
        c["steps"] += 1
        c["decisions"].append(stats.decisions)
        c["us"].append(1e6 * dt / stats.decisions)
        c["cpu"].append(1e6 * cpu / stats.decisions)
        t = time.perf_counter()
        ystats = await c["ystage"].run_step(c["mbs"])
        c["yus"].append(1e6 * (time.perf_counter() - t) / ystats.decisions)


def decision_latency(
    ready_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    policies: Sequence[str] = ("strict", "greedy", "readiness_first"),
    loops: Sequence[str] = ("uvloop", "asyncio"),
    repeats: int = 9,
    microbatches: int | None = None,
) -> list[Row]:
    """Decision latency against the ready-set size: µs per dispatch with no compute.

    Runs a real ``StageLoop`` on :func:`decision_schedule` (``k`` admitted ready tasks at each
    decision) with an executor whose ``execute`` returns without awaiting; per decision =
    step wall time / decisions, which covers the policy call, the ready-set and admission
    bookkeeping, task start/end accounting and the executor call. The stage then never
    suspends, so the whole step runs on this thread and ``cpu_us`` (thread CPU time per
    decision) is the same cost without the time other processes took the core away. The
    loop kind matters for ``us_yield_median``: the same with an executor that yields to the
    loop once per task (``await asyncio.sleep(0)``). Rounds run every case once, on every
    loop in turn, so a noisy phase of a shared machine hits all cases alike.

    Args:
        ready_sizes: Ready-set sizes ``k``.
        policies: Policy names.
        loops: ``"uvloop"`` and/or ``"asyncio"``.
        repeats: Timed steps per case (median).
        microbatches: Microbatches per step (default ``max(32, 8k)``; 2 tasks each).

    Returns:
        Rows ``{loop, policy, ready, ready_mean, ready_at_k, tasks, decisions, executed,
        us_median, us_min, cpu_us, us_yield_median, target_us, met}``; ``ready_mean`` and
        ``ready_at_k`` (fraction of decisions that saw exactly ``k``) come from an untimed
        observed step; ``executed`` counts executor calls per step.
    """
    import contextlib

    from ..loop._runner import loop_factory

    for name in loops:
        if name not in ("uvloop", "asyncio"):
            raise ValueError(f"unknown loop {name!r} (uvloop or asyncio)")
    with contextlib.ExitStack() as stack:
        runs = []
        for name in loops:
            runner = stack.enter_context(
                asyncio.Runner(loop_factory=loop_factory(name == "uvloop"))
            )
            runs.append((runner, runner.run(_decision_cases(ready_sizes, policies, microbatches))))
        for _ in range(max(1, repeats)):
            for runner, cases in runs:
                runner.run(_decision_round(cases))
    rows: list[Row] = []
    for _, cases in runs:
        for c in cases:
            sizes = c["sizes"]
            rows.append(
                {
                    "loop": c["loop"],
                    "policy": c["policy"],
                    "ready": c["k"],
                    "ready_mean": sum(sizes) / len(sizes),
                    "ready_at_k": sum(1 for s in sizes if s == c["k"]) / len(sizes),
                    "tasks": c["tasks"],
                    "decisions": min(c["decisions"]),
                    "executed": c["ex"].calls // c["steps"],
                    "us_median": _med(c["us"]),
                    "us_min": min(c["us"]),
                    "cpu_us": _med(c["cpu"]),
                    "us_yield_median": _med(c["yus"]),
                    "target_us": DECISION_TARGET_US,
                    "met": _med(c["us"]) < DECISION_TARGET_US,
                }
            )
    return rows


# ------------------------------------------------------------------ per message


class _EchoSink:
    """Rank 1: sends every message straight back. Rank 0: resolves the waiting future."""

    def __init__(self, channel: Any, echo: bool) -> None:
        self.channel = channel
        self.echo = echo
        self.count = 0
        self.target = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def deliver(self, step: int, task: Any, payload: Any, src: int) -> None:
        self.count += 1
        if self.echo:
            self.channel.send(src, step, task, payload)
        w = self.waiter
        if w is not None and not w.done() and self.count >= self.target:
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc)

    def peer_closed(self, src: int) -> None:
        pass

    async def wait_for(self, target: int) -> None:
        if self.error is not None:
            raise self.error
        if self.count >= target:
            return
        self.target = target
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self.waiter, 60)
        finally:
            self.waiter = None


def _message_rank(
    rank: int, world: int, sizes: Sequence[int], n: int, batches: int, loops: Sequence[str]
) -> list[Row]:
    import torch
    import torch.distributed as dist

    from .._tasks import Task
    from ..channels._p2p import P2PChannel
    from ..loop._runner import loop_factory

    peer = 1 - rank
    # The channel gets its own group: its listener thread keeps a receive posted, which on
    # the default group would catch the raw baseline's messages.
    ch_group = dist.new_group([0, 1], backend="gloo")
    rows: list[Row] = []

    def raw_batch(buf: torch.Tensor) -> float:
        """Blocking ping-pong of ``buf``, ``n`` round trips."""
        t = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        return time.perf_counter() - t

    async def main() -> list[Row]:
        out: list[Row] = []
        ch = P2PChannel(
            rank, global_ranks={0: 0, 1: 1}, inbound=[peer], outbound=[peer], group=ch_group
        )
        sink = _EchoSink(ch, echo=rank == 1)
        ch.bind(sink)
        loop_name = _loop_name(asyncio.get_running_loop())
        async with ch:
            seq = 0

            async def channel_batch(buf: torch.Tensor) -> float:
                nonlocal seq
                t = time.perf_counter()
                for _ in range(n):
                    if rank == 0:
                        ch.send(1, 0, Task(0, "F", seq % 1_000_000), buf)
                    seq += 1
                    await sink.wait_for(seq)
                return time.perf_counter() - t

            for size in sizes:
                buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
                raw_batch(buf)  # warm up both paths (connections, allocator, capacities)
                await channel_batch(buf)
                raw, chan = [], []
                for _ in range(batches):
                    dist.barrier()
                    raw.append(raw_batch(buf))
                    dist.barrier()
                    chan.append(await channel_batch(buf))
                fig = _transport(raw, chan, 2 * n)
                out.append(
                    {
                        "loop": loop_name,
                        "bytes": buf.numel() * buf.element_size(),
                        "messages": n * batches,
                        **fig,
                        "target_ratio": MESSAGE_TARGET_RATIO,
                        "met": fig["ratio"] <= MESSAGE_TARGET_RATIO,
                        "delivered": sink.count,
                    }
                )
            dist.barrier()
        return out

    for name in loops:
        with asyncio.Runner(loop_factory=loop_factory(name == "uvloop")) as runner:
            rows += runner.run(main())
    return rows


def message_cost(
    sizes: Sequence[int] = (64, 16 * 1024, 1 << 20),
    *,
    messages: int = 300,
    batches: int = 30,
    loops: Sequence[str] = ("uvloop", "asyncio"),
    timeout: float = 180.0,
) -> list[Row]:
    """One-way cost of a message through ``P2PChannel`` vs a raw blocking gloo send.

    2 processes (gloo on 127.0.0.1, one torch thread each) ping-pong ``messages`` round
    trips per size in ``batches`` short batches, alternating a raw batch (``dist.send`` /
    ``dist.recv`` of the same float32 tensor, blocking) and a channel batch (rank 0
    ``send``s, rank 1's sink sends the delivered tensor back from the loop, rank 0 awaits
    its delivery); one-way = round trip / 2. The channel runs on a group of its own (its
    listeners keep receives posted).

    On a shared machine, a process that must wake up for each message waits for a time
    slice whenever another process holds the cores: a 64 B one-way then takes ~1.5 ms
    instead of ~0.1 ms, on both sides, which compresses every ratio towards 1. So the
    headline figures are the lower decile of the batches of each kind (the batches nobody
    disturbed); the medians and the median of the paired ratios (each channel batch
    against the raw batch just before it) are reported too.

    Returns:
        Rank 0's rows ``{loop, bytes, messages, raw_us, channel_us, ratio, raw_median_us,
        channel_median_us, ratio_paired, contended, target_ratio, met, delivered}``:
        ``ratio`` = ``channel_us / raw_us`` (lower deciles; the target); ``contended``:
        the median raw or channel batch took over 3x its lower-decile one (most batches
        measured scheduling delays, and the channel, which wakes more threads per message,
        is disturbed more often than the raw path: rerun on a quiet machine);
        ``delivered``: messages rank 0's sink received, warm-up included.
    """
    from ..distributed._spawn import spawn

    n = max(1, messages // batches)
    res = spawn(_message_rank, 2, list(sizes), n, batches, list(loops), timeout=timeout)
    return res[0]


# ------------------------------------------------------------------ TP coordination


class _SleepExecutor:
    """Each task waits ``seconds`` on the loop (0: returns at once)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        if self.seconds > 0:
            await asyncio.sleep(self.seconds)
        return None


def _tp_rank(
    rank: int,
    world: int,
    n: int,
    batches: int,
    compute_s: float,
    microbatches: int,
    steps: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .._tasks import StepPlan, Task, Topology
    from ..channels._decisions import DecisionChannel
    from ..distributed._layout import ProcessLayout, build_groups
    from ..distributed._stage import DistributedStage
    from ..loop._runner import loop_factory
    from ..policies._schedule import StepSchedule

    layout = ProcessLayout.from_world(pp=1, tp=world)
    groups = build_groups(layout)
    group = groups.decisions
    leader = layout.tp_ranks()[0]
    buf = torch.zeros(6, dtype=torch.int64)  # the size of a decision

    def raw_batch() -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        for _ in range(n):
            dist.broadcast(buf, src=leader, group=group)
        return time.perf_counter() - t

    plan = StepPlan(topology=Topology(stages=1), microbatches=microbatches)
    sched = StepSchedule.build(plan, "1f1b")
    mbs = list(range(microbatches))

    async def main() -> dict[str, Any]:
        ch = DecisionChannel(
            group, leader=leader, rank=layout.rank, tp_rank=layout.tp_rank, stage=0
        )
        step = 0

        async def channel_batch() -> float:
            nonlocal step
            dist.barrier(group=group)
            t = time.perf_counter()
            ch.begin_step(step, n)
            if ch.is_leader:
                for seq in range(n):
                    ch.publish(step, seq, Task(0, "F", seq))
                await ch.end_step()
            else:
                for seq in range(n):
                    got = await ch.receive(step, seq)
                    if got.mb != seq:
                        raise RuntimeError(f"decision {seq} carried {got}")
            step += 1
            return time.perf_counter() - t

        raw_batch()
        await channel_batch()
        raw, chan = [], []
        for _ in range(batches):
            raw.append(raw_batch())
            chan.append(await channel_batch())

        async def stage_times(seconds: float) -> tuple[list[float], list[float], int]:
            """Step times of a coordinated and an uncoordinated stage, steps alternating."""
            times: dict[bool, list[float]] = {True: [], False: []}
            decisions = 0

            def make(coordinate: bool) -> DistributedStage:
                return DistributedStage(
                    layout,
                    sched,
                    _SleepExecutor(seconds),
                    groups=groups,
                    policy="readiness_first",
                    coordinate_tp=coordinate,
                    step_timeout=60.0,
                )

            async with make(True) as on, make(False) as off:
                for s in range(steps + 1):
                    for coordinate, stage in ((True, on), (False, off)):
                        dist.barrier()
                        t = time.perf_counter()
                        st = await stage.run_step(mbs, step=s)
                        if s:  # the first step of each warms up
                            times[coordinate].append(time.perf_counter() - t)
                        decisions = st.decisions
            return times[True], times[False], decisions

        noop_on, noop_off, d = await stage_times(0.0)
        busy_on, busy_off, _ = await stage_times(compute_s)
        return {
            "raw": raw,
            "channel": chan,
            "noop_on": noop_on,
            "noop_off": noop_off,
            "busy_on": busy_on,
            "busy_off": busy_off,
            "decisions": d,
            "published": ch.published,
        }

    with asyncio.Runner(loop_factory=loop_factory(True)) as runner:
        return runner.run(main())


def _slowest(per_rank: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Per batch / step, the slowest rank's time (what the stage as a whole pays)."""
    return [max(vals) for vals in zip(*(r[key] for r in per_rank), strict=True)]


def tp_coordination(
    tps: Sequence[int] = (2, 4),
    *,
    decisions: int = 200,
    compute_ms: float = 5.0,
    microbatches: int = 8,
    steps: int = 6,
    batches: int = 20,
    timeout: float = 180.0,
) -> list[Row]:
    """TP coordination per decision against a raw blocking broadcast on the same group.

    Per TP size, one ``spawn`` job of ``tp`` processes (one pipeline stage, its TP ranks,
    the dedicated decision group from ``build_groups``):

    * ``raw_us``: blocking ``dist.broadcast`` of an ``int64[6]`` (a decision's size) from
      the leader, back to back; ``channel_us``: ``DecisionChannel`` -- the leader
      ``publish``es the batch's decisions (asynchronous broadcasts) and awaits
      ``end_step``, followers ``receive`` each (``depth`` posted ahead) and check it.
      Both: the slowest rank's time from a group barrier / decisions, ``batches``
      interleaved batches; lower deciles as in :func:`message_cost` (medians and paired
      ratios too); ``ratio`` = channel / raw.
    * ``stage_us``: inside a real ``DistributedStage`` (1-stage 1F1B plan, ``microbatches``
      microbatches, no-op tasks): (coordinated - uncoordinated step time) / decisions,
      slowest rank, medians of ``steps`` steps, coordinated and uncoordinated steps
      alternating.
    * ``share``: ``channel_us / (channel_us + compute_ms * 1000)`` -- the coordination of
      one decision as a fraction of a task of ``compute_ms`` plus that coordination, i.e. as
      if it were never overlapped with compute. ``share_measured``: (coordinated -
      uncoordinated) / coordinated step time, same alternating steps, with tasks that wait
      ``compute_ms`` on the loop (a stand-in for a GPU kernel: the CPU is free meanwhile).

    Returns:
        Rows ``{tp, decisions, raw_us, channel_us, ratio, raw_median_us,
        channel_median_us, ratio_paired, contended, stage_us, stage_coord_us,
        stage_uncoord_us, compute_ms, share, step_coord_ms, step_uncoord_ms,
        share_measured, step_decisions, published, target_ratio, met_ratio, met_share}``.
    """
    from ..distributed._spawn import spawn

    n = max(1, decisions // batches)
    rows: list[Row] = []
    for tp in tps:
        if tp < 2:
            raise ValueError(f"TP coordination needs tp >= 2, got {tp}")
        res = spawn(
            _tp_rank, tp, n, batches, compute_ms / 1e3, microbatches, steps, timeout=timeout
        )
        fig = _transport(_slowest(res, "raw"), _slowest(res, "channel"), n)
        ch_us = fig["channel_us"]
        d = res[0]["decisions"]
        on = _med(_slowest(res, "noop_on"))
        off = _med(_slowest(res, "noop_off"))
        busy_on = _med(_slowest(res, "busy_on"))
        busy_off = _med(_slowest(res, "busy_off"))
        share = ch_us / (ch_us + compute_ms * 1e3)
        rows.append(
            {
                "tp": tp,
                "decisions": n * batches,
                **fig,
                "stage_us": 1e6 * (on - off) / d,
                "stage_coord_us": 1e6 * on / d,
                "stage_uncoord_us": 1e6 * off / d,
                "compute_ms": compute_ms,
                "share": share,
                "step_coord_ms": 1e3 * busy_on,
                "step_uncoord_ms": 1e3 * busy_off,
                "share_measured": (busy_on - busy_off) / busy_on,
                "step_decisions": d,
                "published": res[0]["published"],
                "target_ratio": TP_TARGET_RATIO,
                "met_ratio": fig["ratio"] <= TP_TARGET_RATIO,
                "met_share": share < TP_SHARE_TARGET,
            }
        )
    return rows


# ------------------------------------------------------------------ I + W vs B


def split_backward_cost(
    *,
    microbatches: int = 8,
    repeats: int = 5,
    stages: int = 4,
    stage: int | None = None,
    seed: int = 0,
) -> list[Row]:
    """``I`` + ``W`` compute against ``B`` compute on one stage of the example model.

    Runs in this process (call :func:`split_backward_cost_isolated` for a fresh process with
    one torch thread). Builds the model split into ``stages`` virtual stages, takes stage
    ``stage`` (default ``stages // 2``, a middle one), and for each of ``microbatches``
    real image-text microbatches runs, through ``TorchStageExecutor.execute``: ``F`` then
    ``B`` on an executor of a plain plan, and ``F`` then ``I`` then ``W`` on an executor of a
    ``split_backward=True`` plan (same modules, same inputs: the previous stages' real
    activations, a fixed random output gradient). Real CPU compute, no emulated time.

    Compute per task is the CPU time of the executor's compute thread across the task
    (``time.thread_time`` read on that thread before and after: immune to other processes
    taking the core); ``*_clock`` is the executor's own ``compute_seconds`` (wall clock on
    the compute thread), ``*_wall`` the await of ``execute`` (hand-off to the thread
    included).

    When ``_torch_executor.measure_split_backward`` exists (the executor's own measurement:
    the task handlers called directly, CPU clock), it runs too with the same arguments and
    its ratio is the headline (``source``); the figures above stay as ``ratio_tasks``.

    Returns:
        One row ``{stage, stages, microbatches, tokens, f_ms, b_ms, i_ms, w_ms, iw_ms,
        ratio, source, ratio_tasks, [helper_ratio, helper_ratio_wall, split_mode],
        b_clock_ms, iw_clock_ms, ratio_clock, b_wall_ms, iw_wall_ms, ratio_wall,
        target_ratio, met}``: ms per step (sum over the microbatches), median of
        ``repeats``; ``ratio_tasks``: median over rounds of the round's I + W / B (CPU time
        of the executor tasks).
    """

    from .._tasks import StepPlan, Task, Topology
    from ..distributed._torch_executor import TorchStageExecutor, stage_inputs
    from ..loop._executors import TaskContext
    from ..models.image_text import ImageTextConfig, build_stage_modules, loss_fn, make_microbatches

    v = stages // 2 if stage is None else stage
    if not 0 <= v < stages:
        raise ValueError(f"stage {v} is outside 0..{stages - 1}")
    cfg = ImageTextConfig()
    modules = build_stage_modules(cfg, stages, list(range(stages)), None)
    mbs = make_microbatches(microbatches, cfg, seed=seed)
    inputs, grads = stage_inputs(modules, mbs, v, seed=seed)
    top = Topology(stages=stages)
    plain = StepPlan(topology=top, microbatches=microbatches)
    split = StepPlan(topology=top, microbatches=microbatches, split_backward=True)
    mod = {v: modules[v]}
    ex_b = TorchStageExecutor(mod, loss_fn, rank=0)
    ex_s = TorchStageExecutor(mod, loss_fn, rank=0)
    params = list(modules[v].parameters())

    async def timed(
        ex: TorchStageExecutor, task: Task, data: Any, ctx: Any
    ) -> tuple[float, float, float]:
        """(CPU s of the compute thread, executor's compute_seconds, wall s of the await)."""
        c0 = ex.compute_seconds
        cpu0 = await ex.worker.run(time.thread_time)  # the worker is one thread
        t0 = time.perf_counter()
        await ex.execute(task, data, ctx)
        wall = time.perf_counter() - t0
        cpu1 = await ex.worker.run(time.thread_time)
        return cpu1 - cpu0, ex.compute_seconds - c0, wall

    keys = ("f", "b", "i", "w", "iw", "b_clock", "iw_clock", "b_wall", "iw_wall")

    async def main() -> dict[str, list[float]]:
        acc: dict[str, list[float]] = {k: [] for k in keys}
        for rep in range(repeats + 1):  # the first round warms up
            ctx_b = TaskContext(0, rep, plain, mbs)
            ctx_s = TaskContext(0, rep, split, mbs)
            tot = dict.fromkeys(keys, 0.0)
            for m in range(microbatches):
                f, _, _ = await timed(ex_b, Task(v, "F", m), inputs[m], ctx_b)
                b, bc, bw = await timed(ex_b, Task(v, "B", m), grads[m], ctx_b)
                await timed(ex_s, Task(v, "F", m), inputs[m], ctx_s)
                i, ic, iw1 = await timed(ex_s, Task(v, "I", m), grads[m], ctx_s)
                w, wc, iw2 = await timed(ex_s, Task(v, "W", m), None, ctx_s)
                for key, val in (
                    ("f", f),
                    ("b", b),
                    ("i", i),
                    ("w", w),
                    ("iw", i + w),
                    ("b_clock", bc),
                    ("iw_clock", ic + wc),
                    ("b_wall", bw),
                    ("iw_wall", iw1 + iw2),
                ):
                    tot[key] += val
            for p in params:
                p.grad = None
            if rep:
                for key in acc:
                    acc[key].append(tot[key])
        return acc

    from ..loop._runner import run

    try:
        acc = run(main())
    finally:
        ex_b.close()
        ex_s.close()
    med = {k: 1e3 * _med(vals) for k, vals in acc.items()}

    # Paired within each round (B and I + W interleaved microbatch by microbatch), then the
    # median over rounds: a noisy round moves both sides of its own ratio.
    def paired(num: str, den: str) -> float:
        return _med(x / y for x, y in zip(acc[num], acc[den], strict=True))

    ratio_tasks = paired("iw", "b")
    ratio, source, helper = (
        ratio_tasks,
        "executor tasks",
        _split_helper(
            stages=stages, stage=v, microbatches=microbatches, repeats=repeats, seed=seed
        ),
    )
    if "helper_ratio" in helper:
        ratio, source = helper["helper_ratio"], "measure_split_backward"
    return [
        {
            "stage": v,
            "stages": stages,
            "microbatches": microbatches,
            "tokens": sum(mb.tokens for mb in mbs),
            "f_ms": med["f"],
            "b_ms": med["b"],
            "i_ms": med["i"],
            "w_ms": med["w"],
            "iw_ms": med["iw"],
            "ratio": ratio,
            "source": source,
            "ratio_tasks": ratio_tasks,
            **helper,
            "b_clock_ms": med["b_clock"],
            "iw_clock_ms": med["iw_clock"],
            "ratio_clock": paired("iw_clock", "b_clock"),
            "b_wall_ms": med["b_wall"],
            "iw_wall_ms": med["iw_wall"],
            "ratio_wall": paired("iw_wall", "b_wall"),
            "target_ratio": SPLIT_TARGET_RATIO,
            "met": ratio <= SPLIT_TARGET_RATIO,
        }
    ]


def _split_helper(**kwargs: Any) -> dict[str, Any]:
    """The executor's own ``measure_split_backward`` when it has one (CPU-time ratio, and
    whether the graph split or the recompute fallback ran), else nothing."""
    from ..distributed import _torch_executor

    helper = getattr(_torch_executor, "measure_split_backward", None)
    if not callable(helper):
        return {}
    try:
        h = helper(**kwargs, threads=None)
        return {
            "helper_ratio": float(h.get("ratio_cpu", h["ratio"])),
            "helper_ratio_wall": float(h["ratio"]),
            "split_mode": "recompute fallback" if h.get("split", 1.0) == 0.0 else "graph split",
        }
    except (TypeError, KeyError, ValueError) as e:  # its interface moved: say so, go on
        return {"helper_error": repr(e)}


def _split_rank(rank: int, world: int, kwargs: dict[str, Any]) -> list[Row]:
    return split_backward_cost(**kwargs)


def split_backward_cost_isolated(timeout: float = 180.0, **kwargs: Any) -> list[Row]:
    """:func:`split_backward_cost` in a fresh process with one torch thread (like the
    pipeline ranks), so the CLI process's thread pool and heap do not bias it."""
    from ..distributed._spawn import spawn

    return spawn(_split_rank, 1, kwargs, timeout=timeout)[0]
