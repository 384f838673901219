"""A whole pipeline in one process: every stage loop, an in-process channel, a deadlock monitor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import DeadlockError
from ..channels._local import LatencyFn, LocalChannel
from ..policies._policy import Policy
from ..policies._schedule import StepSchedule
from ._diagnostics import make_deadlock
from ._executors import Executor
from ._records import StepStats
from ._stage import StageLoop, StageObserver

__all__ = ["LocalPipeline", "unwrap_group"]


class _Monitor:
    """Deadlock detection for stages that share one loop and one in-process channel.

    A step is deadlocked when every stage still in the step is blocked (waiting for its ready
    set to change, running nothing) and no message is in flight: nothing can ever change.
    Stages unblock synchronously when an event resolves their wait, so the check never
    fires between a delivery and the stage's resumption.
    """

    def __init__(self, pipeline: LocalPipeline) -> None:
        self._p = pipeline
        self.active: set[int] = set()
        self.failed = False

    def blocked(self, stage: StageLoop) -> None:
        self.check()

    def unblocked(self, stage: StageLoop) -> None:
        pass

    def check(self) -> None:
        p = self._p
        if p.channel.inflight or self.failed:
            return
        stages = p.stages
        if not self.active or any(not stages[r].blocked for r in self.active):
            return
        st = stages[next(iter(self.active))].step
        err = make_deadlock(stages, st if st is not None else -1)
        for r in sorted(self.active):
            stages[r].fail(err)


def unwrap_group(eg: BaseExceptionGroup[Any]) -> BaseException:
    """The one root cause of a task group's failure when there is one, else the group."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        elif not isinstance(e, asyncio.CancelledError):
            leaves.append(e)

    walk(eg)
    unique: list[BaseException] = []
    for e in leaves:
        if all(e is not u for u in unique):
            unique.append(e)
    if len(unique) == 1:
        return unique[0]
    dead = [e for e in unique if isinstance(e, DeadlockError)]
    if dead and len(dead) == len(unique):
        return dead[0]
    return eg


class LocalPipeline:
    """Every stage of a pipeline as a coroutine in this process, connected in-process.

    Args:
        schedule: The step schedule.
        executors: One executor per rank, one shared executor, or a factory ``rank ->
            executor``.
        policy: Policy name or coroutine for every stage.
        latency: Optional message latency model ``(step, task) -> seconds``.
        observer: Optional observer of every stage's transitions.
        step_timeout: Watchdog per step, seconds on the loop clock.
    """

    def __init__(
        self,
        schedule: StepSchedule,
        executors: Sequence[Executor] | Executor | Callable[[int], Executor],
        *,
        policy: str | Policy = "readiness_first",
        latency: LatencyFn | None = None,
        observer: StageObserver | None = None,
        step_timeout: float | None = None,
    ) -> None:
        p = schedule.plan.stages
        self.schedule = schedule
        self.channel = LocalChannel(p, latency)
        self._monitor = _Monitor(self)
        if isinstance(executors, Sequence):
            if len(executors) != p:
                raise ValueError(f"need one executor per rank ({p}), got {len(executors)}")
            execs = list(executors)
        elif callable(executors) and not isinstance(executors, Executor):
            execs = [executors(r) for r in range(p)]
        else:
            execs = [executors] * p
        self.stages = [
            StageLoop(
                r,
                schedule=schedule,
                executor=execs[r],
                endpoint=self.channel.endpoint(r),
                policy=policy,
                monitor=self._monitor,
                observer=observer,
                step_timeout=step_timeout,
            )
            for r in range(p)
        ]

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
    ) -> list[StepStats]:
        """Run one step on every stage; return each rank's stats.

        Raises:
            DeadlockError: No stage can progress (with the rank x task grid).
            PolicyError, ProtocolError, StepTimeoutError: see ``StageLoop.run_step``.
        """
        mon = self._monitor

        async def one(stage: StageLoop) -> StepStats:
            try:
                stats = await stage.run_step(microbatches, step=step, schedule=schedule)
            except BaseException:
                # The task group cancels the other stages; a deadlock check now would
                # only report the stages this failure left waiting.
                mon.failed = True
                raise
            mon.active.discard(stage.rank)
            mon.check()
            return stats

        mon.active = set(range(len(self.stages)))
        mon.failed = False
        root: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(s)) for s in self.stages]
        except BaseExceptionGroup as eg:
            root = unwrap_group(eg)
            if root is eg:
                raise
        if root is not None:
            # Raised outside the handler so the root keeps its own cause and context.
            raise root
        return [t.result() for t in tasks]
