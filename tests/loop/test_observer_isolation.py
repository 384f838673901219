"""Observers are contained (ARCHITECTURE invariant 8): an observer that raises fails the step
with an ObserverError (never a hang, never a wrong diagnosis) and never hides or replaces
the step's own error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import Durations, LocalPipeline, StepPlan, StepSchedule, Task, TaskContext, Topology
from rrfp_async.errors import ObserverError
from rrfp_async.sim import CostModelExecutor


def sched(p: int = 2, m: int = 4) -> StepSchedule:
    return StepSchedule.build(StepPlan(topology=Topology(stages=p), microbatches=m), "1f1b")


def unit(s: StepSchedule, d: float = 0.0) -> Durations:
    pl = s.plan
    return Durations.from_arrays(pl, [[d] * pl.microbatches for _ in range(pl.num_virtual)])


class Raises:
    """An observer whose ``method`` raises (every other transition is a no-op)."""

    def __init__(self, method: str, exc: Exception | None = None) -> None:
        self.method = method
        self.exc = exc or RuntimeError(f"observer broke in {method}")
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("active",):
            raise AttributeError(name)

        def call(*args: Any) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == self.method:
                raise self.exc

        return call


METHODS = ["step_start", "message", "ready", "decision", "task_start", "task_end", "stall",
           "step_end"]  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
async def test_local_pipeline_without_timeout_fails_with_observer_error(method: str) -> None:
    """Before: ``message``/``ready`` raised inside a loop callback, the message was lost and
    the step (no step_timeout) hung forever."""
    s = sched()
    obs = Raises(method)
    pipe = LocalPipeline(s, CostModelExecutor(unit(s, 0.001)), observer=obs)
    with pytest.raises(ObserverError) as ei:
        async with asyncio.timeout(10):  # a hang is a TimeoutError, not the ObserverError
            await pipe.run_step([None] * 4)
    assert ei.value.method == method
    assert ei.value.__cause__ is obs.exc
    assert f"raised in {method}()" in str(ei.value)
    # The stage stopped calling the broken observer; the pipeline runs the next step.
    assert obs.calls[method] <= 2  # once per rank at most
    obs.method = "none"
    stats = await pipe.run_step([None] * 4)
    assert len(stats) == 2


@pytest.mark.parametrize("method", ["message", "ready", "task_end"])
def test_simulate_names_the_observer_not_a_deadlock(method: str) -> None:
    """Before: a message lost to an observer made the simulator report a DeadlockError."""
    with pytest.raises(ObserverError) as ei:
        rr.simulate(stages=3, microbatches=4, observer=Raises(method), wall_limit=30)
    assert not isinstance(ei.value, rr.DeadlockError)
    assert ei.value.method == method


class FailsAt:
    """An executor whose task ``bad`` raises the step's real error."""

    def __init__(self, bad: Task) -> None:
        self.bad = bad
        self.error = RuntimeError("the real root cause")

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        await asyncio.sleep(0)
        if task == self.bad and ctx.step == 0:
            raise self.error
        return None


async def test_failed_hook_that_raises_never_replaces_the_root_cause() -> None:
    s = sched()
    ex = FailsAt(Task(1, "F", 0))
    obs = Raises("failed", OSError(28, "No space left on device"))
    pipe = LocalPipeline(s, ex, observer=obs)
    with pytest.raises(RuntimeError) as ei:
        async with asyncio.timeout(10):
            await pipe.run_step([None] * 4)
    assert ei.value is ex.error
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "also raised in failed()" in notes and "No space left" in notes
    assert obs.calls["failed"] >= 1
    await pipe.run_step([None] * 4)  # and the pipeline goes on


async def test_observer_error_during_a_failing_task_is_a_note_on_it() -> None:
    """The observer raises as 0F0 starts, then 0F0 itself fails: the task's error is the
    step's error, the observer's a note on it."""
    s = sched()
    ex = FailsAt(Task(0, "F", 0))
    obs = Raises("task_start")
    pipe = LocalPipeline(s, ex, observer=obs)
    with pytest.raises(RuntimeError) as ei:
        async with asyncio.timeout(10):
            await pipe.run_step([None] * 4)
    assert ei.value is ex.error
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "the observer also raised" in notes and "task_start" in notes


async def test_active_property_that_raises_is_an_observer_error() -> None:
    class BadActive:
        @property
        def active(self) -> bool:
            raise ValueError("no")

    s = sched()
    pipe = LocalPipeline(s, CostModelExecutor(unit(s)), observer=BadActive())  # type: ignore[arg-type]
    with pytest.raises(ObserverError, match="raised in active"):
        async with asyncio.timeout(10):
            await pipe.run_step([None] * 4)


async def test_any_error_inside_a_local_delivery_reaches_the_stage() -> None:
    """Not only RRFPErrors: whatever a delivery raises inside the loop callback goes to the
    stage's ``fail`` (in the loop's exception handler it would be lost and the step hang)."""
    from rrfp_async.channels import LocalChannel

    failed: list[BaseException] = []

    class Sink:
        def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
            raise KeyError("a bug in a sink")

        def fail(self, exc: BaseException) -> None:
            failed.append(exc)

    ch = LocalChannel(2)
    ch.endpoint(1).bind(Sink())  # type: ignore[arg-type]
    ch.endpoint(0).send(1, 0, Task(1, "F", 0), None)
    await asyncio.sleep(0)
    assert len(failed) == 1 and isinstance(failed[0], KeyError)
