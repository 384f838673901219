"""``bench overhead``, decision latency: the policy call plus the stage's bookkeeping per
dispatch, no compute.

A real ``StageLoop`` (one rank, in-process channel) whose executor returns at once, on a
hint whose admitted ready set holds ``k`` tasks at every decision; per decision = step wall
time / tasks run. uvloop and asyncio, several policies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from ._overhead_common import Row, loop_kind, median_of

__all__ = ["DECISION_TARGET_US", "decision_latency", "decision_schedule"]

DECISION_TARGET_US = 20.0
"""Target: median decision latency (µs) for ready sets up to 64."""


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
    from rrfp_async import StepPlan, Task, Topology
    from rrfp_async.policies import StepSchedule

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


async def _decision_cases(
    ready_sizes: Sequence[int], policies: Sequence[str], microbatches: int | None
) -> list[dict[str, Any]]:
    """Build (and warm up) one stage per case on the running loop."""
    from rrfp_async.channels import LocalChannel
    from rrfp_async.loop import StageLoop

    loop_name = loop_kind(asyncio.get_running_loop())
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

    from rrfp_async.loop import loop_factory

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
                    "us_median": median_of(c["us"]),
                    "us_min": min(c["us"]),
                    "cpu_us": median_of(c["cpu"]),
                    "us_yield_median": median_of(c["yus"]),
                    "target_us": DECISION_TARGET_US,
                    "met": median_of(c["us"]) < DECISION_TARGET_US,
                }
            )
    return rows
