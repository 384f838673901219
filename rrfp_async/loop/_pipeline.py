"""A whole pipeline in one process: every stage loop, an in-process channel, a deadlock monitor."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from .._check import check_type
from .._errors import PlanError, exception_notes
from ..channels import LatencyFn, LocalChannel
from ..policies import Policy, StepSchedule
from ._accumulate import GradStash, restore_grads, stash_grads
from ._checks import check_step_timeout, resolve_step
from ._coordinator import Coordinator
from ._diagnostics import make_deadlock
from ._executors import Executor, TiedExecutor
from ._portal import SyncPortal
from ._records import StepStats
from ._stage_loop import StageLoop, StageObserver
from ._tp_options import UNSET, TPOptions, resolve_tp_options

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
    """The root cause of a task group's failure: its first error, never a group.

    A task group lists its children's errors in the order they happened; the first one is
    the root cause (the others are stages it cancelled or that failed alongside, e.g. every
    rank's watchdog firing at once). The other distinct errors are attached to it as notes,
    so ``except rr.StepTimeoutError`` (or any class of the tree) catches a pipeline's step.
    Cancellations count only when there is nothing else.
    """
    leaves: list[BaseException] = []
    cancelled: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        elif isinstance(e, asyncio.CancelledError):
            cancelled.append(e)
        elif all(e is not u for u in leaves):
            leaves.append(e)

    walk(eg)
    if not leaves:
        return cancelled[0] if cancelled else eg
    root = leaves[0]
    for other in leaves[1:]:
        if type(other) is type(root) and str(other) == str(root):
            continue
        root.add_note(f"also raised: {type(other).__name__}: {other}")
    return root


class LocalPipeline:
    """Every stage of a pipeline as a coroutine in this process, connected in-process.

    A failed step leaves the pipeline usable: the messages its stages had in flight are
    discarded (see ``LocalChannel.discard``), so the next ``run_step`` starts clean.

    From synchronous code, ``run_step_sync`` runs the same step on an event loop thread of
    the pipeline's own (started on first use; stopped by ``close()`` or at the end of a
    ``with pipe:`` block)::

        with rr.LocalPipeline(schedule, executors) as pipe:
            for mbs in loader:
                stats = pipe.run_step_sync(mbs)

    Args:
        schedule: The step schedule.
        executors: One executor per rank, one shared executor, or a factory ``rank ->
            executor``.
        policy: Policy name or coroutine for every stage.
        latency: Optional message latency model ``(step, task) -> seconds``.
        observer: Optional observer of every stage's transitions.
        step_timeout: Watchdog per step, seconds on the loop clock (None: no watchdog).
        max_microbatches: The most microbatches a step may have (None: no limit).
        coordinators: One TP coordinator per rank (``StageLoop(coordinator=)``): each stage
            runs as the TP leader of its coordinator, without the sequence check (the
            simulator's TP model: ``rrfp_async.sim``); None: no TP.
        deduce_tp: With ``coordinators``, the followers deduce what they can
            (``StageLoop(deduce_tp=)``; ``TPOptions.deduce``).
        tp: The TP options as one value (``TPOptions``; give it or ``deduce_tp``, not
            both). With ``coordinators`` the stages use its ``deduce`` only: as simulated
            TP leaders they always coordinate, compare no sequences and have no channel to
            fold a check into.

    Raises:
        PlanError: ``schedule`` is not a ``StepSchedule``; a list of executors of the wrong
            length; an executor without a usable ``execute(task, data, ctx)`` (the message
            names its rank); ``latency`` not callable; ``step_timeout`` not None or > 0;
            ``tp`` given with ``deduce_tp``.
        PolicyError: ``policy`` is neither a registered name nor a coroutine function.
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
        max_microbatches: int | None = None,
        coordinators: Sequence[Coordinator] | None = None,
        deduce_tp: bool = UNSET,
        tp: TPOptions | None = None,
    ) -> None:
        check_type("schedule", schedule, StepSchedule, "a StepSchedule")
        step_timeout = check_step_timeout(step_timeout)
        p = schedule.plan.stages
        self.schedule = schedule
        self.channel = LocalChannel(p, latency)
        self._monitor = _Monitor(self)
        self._portal: SyncPortal | None = None  # the synchronous face's loop thread
        self._portal_lock = threading.Lock()
        self._running: int | None = None  # the step being run
        if isinstance(executors, Sequence):
            if len(executors) != p:
                raise PlanError(
                    f"executors: need one executor per rank ({p}), got a sequence of"
                    f" {len(executors)}"
                )
            execs = list(executors)
        elif callable(executors) and not isinstance(executors, (Executor, type)):
            execs = [executors(r) for r in range(p)]
        else:
            execs = [executors] * p  # type: ignore[list-item]
        self._executors = execs
        self.max_microbatches = max_microbatches
        deduce = resolve_tp_options(
            tp, "LocalPipeline", {"deduce_tp": "deduce"}, {"deduce_tp": deduce_tp}
        ).deduce
        if coordinators is not None and len(coordinators) != p:
            raise PlanError(f"coordinators: need one per rank ({p}), got {len(coordinators)}")
        # Simulated TP leaders: they coordinate, compare no sequences (see ``tp`` above).
        options = TPOptions(coordinate=True, verify=False, deduce=deduce)
        tp_args: list[dict[str, Any]] = [
            {} if coordinators is None else {"coordinator": coordinators[r], "tp": options}
            for r in range(p)
        ]
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
                max_microbatches=max_microbatches,
                **tp_args[r],
            )
            for r in range(p)
        ]

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> list[StepStats]:
        """Run one step on every stage; return each rank's stats.

        ``microbatches``, ``schedule`` and ``train`` as in ``StageLoop.run_step`` (a step may
        have any number of microbatches; ``train=False`` is a forward-only step). After a
        training step, the gradients of tied parameters that executors declare as distinct
        copies (``TorchStageExecutor(shared=...)``) are summed into every copy; one parameter
        object used by two stages accumulates its gradient by itself. Steps that accumulate
        (no ``zero_grad`` between them) add each step's contribution once (see
        ``rrfp_async.loop._accumulate``).

        A failing step raises one error, the first that happened (the others, e.g. every
        rank's watchdog, are attached as notes), never an ``ExceptionGroup``; the pipeline
        then drops the failed step's messages and can run the next step.

        Raises:
            PlanError: ``microbatches``, ``step`` or ``schedule`` do not fit the plan, or a
                step of this pipeline is already running.
            DeadlockError: No stage can progress (with the rank x task grid).
            PolicyError, ProtocolError, StepTimeoutError: see ``StageLoop.run_step``.
        """
        if self._running is not None:
            raise PlanError(
                f"run_step: step {self._running} of this pipeline is still running; a pipeline"
                " runs one step at a time (await it before starting the next)"
            )
        resolved = resolve_step(
            "run_step",
            self.schedule,
            microbatches,
            step=step,
            schedule=schedule,
            train=train,
            next_step=self.stages[0].next_step,
            max_microbatches=self.max_microbatches,
        )
        mon = self._monitor
        # Resolved once for every stage: each runs this schedule (a forward-only one when
        # train is False), and later steps derive from the resolved base.
        self.schedule = resolved.base
        run = resolved.schedule

        async def one(stage: StageLoop) -> StepStats:
            try:
                stats = await stage.run_step(microbatches, step=step, schedule=run, train=train)
            except BaseException as e:
                # The task group cancels the other stages; a deadlock check now would
                # only report the stages this failure left waiting.
                mon.failed = True
                notes.extend(map(str, exception_notes(e)))  # a task still running, say
                raise
            mon.active.discard(stage.rank)
            mon.check()
            return stats

        notes: list[str] = []
        mon.active = set(range(len(self.stages)))
        mon.failed = False
        self._running = resolved.step
        root: BaseException | None = None
        training = not run.plan.forward_only
        ties = self._tied_copies() if training else []
        # Each tie's accumulated gradient waits aside while the step runs (restored also
        # when it fails): see _accumulate's design note.
        stash: GradStash = stash_grads(p for copies in ties for p in copies)
        try:
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(one(s)) for s in self.stages]
            except BaseExceptionGroup as eg:
                root = unwrap_group(eg)
            except BaseException as e:  # cancelled from outside: its stages were cancelled too
                self._drop_in_flight()
                for note in notes:  # the stages' own CancelledErrors stay in the task group
                    e.add_note(note)
                raise
            finally:
                self._running = None
            if root is not None:
                self._drop_in_flight()
                # Raised outside the handler so the root keeps its own cause and context.
                raise root
            _reduce_shared(ties)
        finally:
            restore_grads(stash)
        return [t.result() for t in tasks]

    @property
    def unfinished_ranks(self) -> frozenset[int]:
        """The ranks whose part of the running step (or of the last step, when it did not
        end well) has not returned: what the simulator asks of a step it had to stop."""
        return frozenset(self._monitor.active)

    def _tied_copies(self) -> list[list[Any]]:
        """The distinct parameter copies of each declared tie that has two or more (one
        object shared by two stages needs nothing: autograd accumulates into it)."""
        ties: dict[str, list[Any]] = {}
        seen: set[int] = set()
        for ex in self._executors:
            if id(ex) in seen:
                continue
            seen.add(id(ex))
            if not isinstance(ex, TiedExecutor):
                continue
            for name, params in ex.shared_parameters().items():
                got = ties.setdefault(name, [])
                got.extend(p for p in params if all(p is not q for q in got))
        return [ties[name] for name in sorted(ties) if len(ties[name]) >= 2]

    def run_step_sync(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> list[StepStats]:
        """``run_step`` for synchronous code: the step runs on the pipeline's own event
        loop thread (anyio's blocking portal, uvloop when installed; started on first use,
        stopped by ``close()``), and this call blocks until it ends. Real time: a simulated
        step runs on a ``VirtualEventLoop`` through the async ``run_step``.

        Args:
            microbatches: The step's microbatches.
            step: The step number (default: one more than the last).
            schedule: A schedule for this step.
            train: False for a forward-only step.

        Returns:
            Each rank's stats.

        Raises:
            PlanError, DeadlockError, PolicyError, ProtocolError, StepTimeoutError: As
                ``run_step`` raises them (the same objects, not wrapped).
        """
        with self._portal_lock:
            portal = self._portal
            if portal is None:
                portal = self._portal = SyncPortal()
        return portal.call(self.run_step, microbatches, step=step, schedule=schedule, train=train)

    def close(self) -> None:
        """Stop the event loop thread of ``run_step_sync`` (after its running step, if any).
        Idempotent; a later ``run_step_sync`` starts a new one. The async ``run_step`` needs
        no closing."""
        with self._portal_lock:
            portal, self._portal = self._portal, None
        if portal is not None:
            portal.close()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _drop_in_flight(self) -> None:
        """After a failed step, every stage has left it (the task group waited for them):
        what is still in flight belongs to the dead step and must never be delivered."""
        self.channel.discard()
        for s in self.stages:
            s.forget_failed_steps()


def _reduce_shared(ties: Sequence[Sequence[Any]]) -> None:
    """Sum each tie's gradients (this step's contributions: see ``_accumulate``) over its
    distinct copies and write the sum into every copy that requires grad."""
    for params in ties:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            continue
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        for p in params:
            if p.requires_grad:  # a frozen copy keeps .grad None, as autograd leaves it
                p.grad = total.clone()
