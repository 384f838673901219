"""``simulate``: one pipeline step as a discrete-event simulation of the real runtime.

The simulation runs the very same ``StageLoop``, policy and admission code as a real run,
with a ``CostModelExecutor`` and an in-process channel, on a ``VirtualEventLoop``: the
clock jumps from event to event, so a 16-stage, 128-microbatch step takes milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._costs import CostModel, Durations, Microbatch, make_workload
from .._errors import PlanError
from .._tasks import Placement, StepPlan, Task, Topology
from ..loop import ExecutedTask, StageObserver, StepStats
from ..loop._executors import CostModelExecutor
from ..loop._pipeline import LocalPipeline
from ..loop._virtual import VirtualEventLoop
from ..observability import MultiObserver, TraceData, TraceRecorder, chrome_trace
from ..policies._hints import canonical_hint_name
from ..policies._policy import Policy
from ..policies._schedule import StepSchedule

__all__ = ["SimResult", "compare", "lower_bound", "simulate"]


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """The outcome of one simulated step.

    Attributes:
        makespan: Seconds from the step's start to its last task's end.
        lower_bound: A bound no schedule can beat: the largest of the critical path and,
            over ranks, the rank's busy time plus its unavoidable fill and drain.
        efficiency: ``lower_bound / makespan`` (1.0 is optimal).
        peak_inflight: Per rank, most activations held at once.
        max_inflight: Per rank, the admission bound.
        executed: Per rank, tasks in execution order with start/end times.
        deviations: Per rank, decisions that ran a task other than the next hinted one.
        hint: The hint's name.
        policy: The policy's name.
        stats: Per rank, the stage's full ``StepStats``.
        wall_time: Real seconds the simulation took.
        schedule: The schedule that ran.
        trace: The trace recording, with ``simulate(record=True)``.
    """

    makespan: float
    lower_bound: float
    efficiency: float
    peak_inflight: tuple[int, ...]
    max_inflight: tuple[int, ...]
    executed: tuple[tuple[ExecutedTask, ...], ...]
    deviations: tuple[int, ...]
    hint: str
    policy: str
    stats: tuple[StepStats, ...] = field(repr=False)
    wall_time: float = 0.0
    schedule: StepSchedule | None = field(default=None, repr=False)
    trace: TraceData | None = field(default=None, repr=False)

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome-trace / Perfetto JSON of this step (needs ``simulate(record=True)``).

        Raises:
            ValueError: The step was simulated without ``record=True``.
        """
        if self.trace is None:
            raise ValueError("simulate(..., record=True) keeps the trace this needs")
        return chrome_trace(
            self.trace,
            clock="virtual",
            policy=self.policy,
            hint=self.hint,
            title="simulated step (virtual time, declared cost model)",
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (without the per-task spans)."""
        return {
            "hint": self.hint,
            "policy": self.policy,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "efficiency": self.efficiency,
            "peak_inflight": list(self.peak_inflight),
            "max_inflight": list(self.max_inflight),
            "deviations": list(self.deviations),
            "wall_time": self.wall_time,
        }


def _topo_order(plan: StepPlan) -> list[Task]:
    """All tasks in an order where every producer comes before its consumers."""
    nv, m = plan.num_virtual, plan.microbatches
    bk = plan.backward_kind
    out = [Task(v, "F", i) for v in range(nv) for i in range(m)]
    out += [Task(v, bk, i) for v in reversed(range(nv)) for i in range(m)]
    if plan.split_backward:
        out += [Task(v, "W", i) for v in range(nv) for i in range(m)]
    return out


def lower_bound(plan: StepPlan, durations: Durations) -> float:
    """A lower bound on the step's makespan under ``durations`` (any schedule, any memory).

    The larger of (a) the critical path through the dependency graph, messages' latencies
    included, and (b) for every rank, the earliest any of its tasks can start, plus all of
    its work, plus the least work that must still follow its last task.
    """
    order = _topo_order(plan)
    head: dict[Task, float] = {}
    for t in order:
        h = 0.0
        for pr in plan.producers(t):
            lat = durations.latency(t) if plan.rank_of(pr) != plan.rank_of(t) else 0.0
            h = max(h, head[pr] + durations.of(pr) + lat)
        head[t] = h
    tail: dict[Task, float] = {}
    for t in reversed(order):
        tl = 0.0
        for c in plan.consumers(t):
            lat = durations.latency(c) if plan.rank_of(c) != plan.rank_of(t) else 0.0
            tl = max(tl, lat + durations.of(c) + tail[c])
        tail[t] = tl
    critical = max(head[t] + durations.of(t) + tail[t] for t in order)
    best = critical
    for r in range(plan.stages):
        tasks = plan.tasks_of(r)
        busy = sum(durations.of(t) for t in tasks)
        best = max(best, min(head[t] for t in tasks) + busy + min(tail[t] for t in tasks))
    return best


def _run_virtual(coro_fn: Any) -> Any:
    def go() -> Any:
        loop = VirtualEventLoop()
        try:
            return loop.run_until_complete(coro_fn())
        finally:
            loop.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return go()
    # Called from inside a running loop (embedded use): simulate on a helper thread, since
    # one thread cannot run two loops at once.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(go).result()


def simulate(
    *,
    stages: int,
    microbatches: int | Sequence[Microbatch],
    chunks: int = 1,
    hint: str = "breadth_first_weighted",
    policy: str | Policy = "readiness_first",
    max_inflight: int | Sequence[int] | None = None,
    memory_factor: float | None = None,
    forward: Sequence[Sequence[float]] | None = None,
    backward: Sequence[Sequence[float]] | None = None,
    workload: str | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    split_backward: bool | None = None,
    ordered_weights: bool = False,
    placement: Placement = "interleaved",
    cost_model: CostModel | None = None,
    latency: float = 0.0,
    latency_jitter: float = 0.0,
    straggler_prob: float = 0.0,
    observer: StageObserver | None = None,
    record: bool = False,
) -> SimResult:
    """Simulate one pipeline step on a virtual clock with the real stage-loop code.

    Args:
        stages: Pipeline ranks P.
        microbatches: Number of microbatches M, or the microbatches themselves (with sizes).
        chunks: Model chunks per rank V.
        hint: Hint name (see ``rrfp_async.policies.HINTS``).
        policy: Policy name or coroutine.
        max_inflight: Admission bound (one for all ranks, or per rank).
        memory_factor: Scale of the default admission bound.
        forward: Explicit forward seconds ``[virtual_stage][microbatch]`` (replay).
        backward: Explicit backward seconds (default 2x forward).
        workload: ``"uniform"``, ``"text"`` or ``"multimodal"`` (default uniform).
        jitter: Sigma of the mean-one lognormal compute noise of the realized durations.
        seed: Seed of the workload sizes and of the noise.
        split_backward: Split backwards into I/W (default: only for ``zb_h1``).
        ordered_weights: Run each stage's W tasks in microbatch order (needs a split).
        placement: ``"interleaved"`` or ``"vshape"``.
        cost_model: Override the workload's cost model (sizes still come from ``workload``).
        latency: Mean one-way message latency, seconds.
        latency_jitter: Sigma of the lognormal noise of each message's latency.
        straggler_prob: Probability that a task runs 3x longer.
        observer: Optional observer of every stage transition (logging, tracing).
        record: Keep a trace recording in ``SimResult.trace`` (spans, messages, decisions).

    Returns:
        The ``SimResult``. Hints are computed from the *declared* durations, the run meets
        the *realized* ones (declared x noise), identical for every policy given a seed.

    Raises:
        PlanError: Invalid sizes or durations.
        HintError: Invalid hint or bound.
    """
    t_wall = time.perf_counter()
    if split_backward is None:
        split_backward = canonical_hint_name(hint) == "zb_h1"
    m = microbatches if isinstance(microbatches, int) else len(microbatches)
    topo = Topology(stages=stages, chunks=chunks, placement=placement)
    plan = StepPlan(
        topology=topo,
        microbatches=m,
        split_backward=split_backward or ordered_weights,
        ordered_weights=ordered_weights,
    )
    mbs: Sequence[Microbatch]
    if forward is not None:
        if workload is not None or cost_model is not None:
            raise PlanError("give explicit forward durations or a workload / cost model, not both")
        base = Durations.from_arrays(plan, forward, backward)
        mbs = [Microbatch(index=i) for i in range(m)]
        noise = CostModel(
            jitter=jitter,
            straggler_prob=straggler_prob,
            latency=latency,
            latency_jitter=latency_jitter,
        )
    else:
        if backward is not None:
            raise PlanError("backward durations need forward durations too")
        wl = make_workload(workload or "uniform", m, virtual_stages=topo.num_virtual, seed=seed)
        mbs = wl.microbatches if isinstance(microbatches, int) else list(microbatches)
        cost = cost_model or wl.cost
        base = cost.declared(plan, mbs)
        noise = CostModel(
            jitter=jitter or cost.jitter,
            straggler_prob=straggler_prob or cost.straggler_prob,
            straggler_factor=cost.straggler_factor,
            latency=latency or cost.latency,
            latency_jitter=latency_jitter or cost.latency_jitter,
        )
    # Hints plan with the declared durations (mean latency, no noise); the run meets the
    # realized ones, drawn per task from the seed, the same for every policy.
    declared = base.perturbed(seed=seed, latency=noise.latency)
    realized = base.perturbed(
        seed=seed,
        jitter=noise.jitter,
        straggler_prob=noise.straggler_prob,
        straggler_factor=noise.straggler_factor,
        latency=noise.latency,
        latency_jitter=noise.latency_jitter,
    )
    recorder = TraceRecorder() if record else None
    if recorder is not None:
        observer = MultiObserver(observer, recorder) if observer is not None else recorder
    schedule = StepSchedule.build(
        plan, hint, durations=declared, max_inflight=max_inflight, memory_factor=memory_factor
    )
    pipe = LocalPipeline(
        schedule,
        CostModelExecutor(realized),
        policy=policy,
        latency=lambda step, task: realized.latency(task),
        observer=observer,
    )

    async def main() -> list[StepStats]:
        return await pipe.run_step(mbs, step=0)

    stats: list[StepStats] = _run_virtual(main)
    start = min(s.started for s in stats)
    makespan = max(s.finished for s in stats) - start
    lb = lower_bound(plan, realized)
    return SimResult(
        makespan=makespan,
        lower_bound=lb,
        efficiency=lb / makespan if makespan > 0 else 1.0,
        peak_inflight=tuple(s.peak_inflight for s in stats),
        max_inflight=tuple(s.max_inflight for s in stats),
        executed=tuple(
            tuple(ExecutedTask(e.task, e.start - start, e.end - start) for e in s.executed)
            for s in stats
        ),
        deviations=tuple(s.deviations for s in stats),
        hint=schedule.hint_name,
        policy=stats[0].policy,
        stats=tuple(stats),
        wall_time=time.perf_counter() - t_wall,
        schedule=schedule,
        trace=None if recorder is None else recorder.data,
    )


def compare(
    policies: Sequence[str | Policy] = ("strict", "readiness_first"), **kwargs: Any
) -> dict[str, SimResult]:
    """Simulate the same step (same sizes, same realized noise) under several policies."""
    out: dict[str, SimResult] = {}
    for p in policies:
        r = simulate(policy=p, **kwargs)
        out[r.policy] = r
    return out
