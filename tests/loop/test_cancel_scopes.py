"""A step under anyio's cancel scopes behaves as under ``asyncio.timeout``: it is cancelled at
the deadline with messages in flight, and the next step runs correctly.

anyio cancels level-triggered (it cancels the task again at every ``await`` until the scope
is left), asyncio edge-triggered (once); the step must not tell them apart. Each case runs on
the virtual-time loop (exact deadlines, exact comparison with a fresh pipeline) and on real
asyncio and uvloop loops (a unit of 30 ms, so the deadline falls 15 ms or more away from
any event that decides what it cuts). On the real loops the deadline is moved to "now" the
moment 1F0 starts (the scope's own reschedule: ``Timeout.reschedule``, ``CancelScope.deadline``),
so what it cuts is decided by causality, not by how busy the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import pytest

import rrfp_async as rr
from rrfp_async import Task, TaskContext
from rrfp_async.loop import loop_factory

pytestmark = pytest.mark.timeout(60)

SCOPES = ("asyncio.timeout", "anyio.fail_after", "anyio.move_on_after")
LOOPS = ("virtual", "asyncio", "uvloop")
P, M = 2, 4
LATENCY = 2.0
DEADLINE = 3.5
"""Units into step 0 (forwards take 1 unit, backwards 2, messages 2): rank 1 runs 1F0 from 3
to 4 and 0F1's output (sent at 2) is in flight until 4."""


class _Recording:
    """A cost-model executor (each task takes its declared duration on the loop clock) that
    passes ``"<task>@<step>"`` on and records what every (step, task) received."""

    def __init__(self, durations: rr.Durations) -> None:
        self.inner = rr.sim.CostModelExecutor(durations)
        self.seen: dict[tuple[int, Task], Any] = {}
        self.cancelled: list[tuple[int, Task]] = []
        self.on_start: Callable[[int, Task], None] | None = None

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        self.seen[(ctx.step, task)] = data
        if self.on_start is not None:
            self.on_start(ctx.step, task)
        try:
            await self.inner.execute(task, data, ctx)
        except asyncio.CancelledError:
            self.cancelled.append((ctx.step, task))
            raise
        return f"{task}@{ctx.step}"


def _expected_input(task: Task, step: int, mbs: list[str]) -> Any:
    if task.kind == "F":
        return mbs[task.mb] if task.stage == 0 else f"{Task(task.stage - 1, 'F', task.mb)}@{step}"
    if task.stage == P - 1:
        return None  # the last stage's backward starts from the loss
    return f"{Task(task.stage + 1, 'B', task.mb)}@{step}"


def _pipeline(unit: float) -> tuple[rr.LocalPipeline, list[_Recording]]:
    plan = rr.StepPlan(topology=rr.Topology(stages=P), microbatches=M)
    d = rr.Durations.from_arrays(plan, [[unit] * M for _ in range(plan.num_virtual)])
    execs = [_Recording(d) for _ in range(P)]
    pipe = rr.LocalPipeline(
        rr.StepSchedule.build(plan, "1f1b"), execs, latency=lambda step, task: LATENCY * unit
    )
    return pipe, execs


Expire = Callable[[], None]


async def _under(
    scope: str,
    seconds: float,
    step: Callable[[], Awaitable[object]],
    arm: Callable[[Expire], None] | None = None,
) -> str:
    """Run ``step`` under ``scope`` with a deadline ``seconds`` from now: what happened.
    ``arm`` receives a function that moves the deadline to now (through the scope's API)."""
    if scope == "asyncio.timeout":
        try:
            async with asyncio.timeout(seconds) as cm:
                if arm is not None:
                    arm(lambda: cm.reschedule(asyncio.get_running_loop().time()))
                await step()
        except TimeoutError:
            return "timed out"
    elif scope == "anyio.fail_after":
        try:
            with anyio.fail_after(seconds) as cs:
                if arm is not None:
                    arm(lambda: setattr(cs, "deadline", anyio.current_time()))
                await step()
        except TimeoutError:
            return "timed out"
    else:
        with anyio.move_on_after(seconds) as cs:
            if arm is not None:
                arm(lambda: setattr(cs, "deadline", anyio.current_time()))
            await step()
        return "timed out" if cs.cancelled_caught else "finished"
    return "finished"


def _run(kind: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    factory = {
        "virtual": rr.sim.VirtualEventLoop,
        "asyncio": None,
        "uvloop": loop_factory(True),
    }[kind]
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("scope", SCOPES)
def test_a_step_cancelled_by_a_scope_ends_at_the_deadline_and_the_next_step_runs(
    scope: str, loop_kind: str
) -> None:
    unit = 1.0 if loop_kind == "virtual" else 0.03
    pipe, execs = _pipeline(unit)
    mbs0 = [f"a{i}" for i in range(M)]
    mbs1 = [f"b{i}" for i in range(M)]
    dropped: list[int] = []

    async def main() -> tuple[str, float, list[rr.StepStats], list[rr.StepStats]]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        arm = None
        if loop_kind != "virtual":

            def arm(expire: Expire) -> None:
                def at_start(step: int, task: Task) -> None:
                    if (step, task) == (0, Task(1, "F", 0)):
                        expire()  # while 1F0 runs, 0F1's output in flight (arrives at 4)

                execs[1].on_start = at_start

        seconds = (DEADLINE if arm is None else 100) * unit
        outcome = await _under(scope, seconds, lambda: pipe.run_step(mbs0), arm)
        execs[1].on_start = None
        took = (loop.time() - t0) / unit
        dropped.append(pipe.channel.dropped)
        after = await pipe.run_step(mbs1)  # the NEXT step, on the same pipeline
        fresh, _ = _pipeline(unit)
        ref = await fresh.run_step(mbs1)  # the same step on a pipeline that never failed
        return outcome, took, after, ref

    outcome, took, after, ref = _run(loop_kind, main)
    assert outcome == "timed out"
    assert dropped[0] > 0  # messages were in flight when it was cancelled (not vacuous)
    assert execs[1].cancelled == [(0, Task(1, "F", 0))] and not execs[0].cancelled  # cut short
    if loop_kind == "virtual":
        assert took == DEADLINE  # cancelled exactly at the deadline
    else:
        # Not before 1F0 started (at 3 units; uvloop's clock has millisecond resolution, so
        # a timer may fire up to 1 ms = 0.034 units "early" by loop.time()).
        assert took >= 3 - 0.05
    assert pipe.channel.inflight == 0
    assert [s.step for s in after] == [1] * P
    for s in after:
        assert len(s.executed) == 2 * M
    for e in execs:
        got = {task: data for (step, task), data in e.seen.items() if step == 1}
        assert len(got) == 2 * M
        for task, data in got.items():
            assert data == _expected_input(task, 1, mbs1), (task, data)
    if loop_kind == "virtual":  # deterministic: exactly what a fresh pipeline does
        for s, r in zip(after, ref, strict=True):
            assert [str(x.task) for x in s.executed] == [str(x.task) for x in r.executed]
            assert [x.end - s.started for x in s.executed] == [
                x.end - r.started for x in r.executed
            ]


@pytest.mark.parametrize("scope", SCOPES[1:])
def test_a_scope_that_does_not_expire_leaves_the_step_alone(scope: str) -> None:
    pipe, _ = _pipeline(1.0)

    async def main() -> tuple[str, list[rr.StepStats]]:
        out: list[list[rr.StepStats]] = []

        async def step() -> None:
            out.append(await pipe.run_step([0, 1, 2, 3]))

        return await _under(scope, 1000.0, step), out[0]

    outcome, stats = _run("virtual", main)
    assert outcome == "finished"
    assert [len(s.executed) for s in stats] == [2 * M] * P
