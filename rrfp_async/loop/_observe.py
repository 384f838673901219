"""Observers are contained: what one raises never hangs, hides or replaces a step's error.

Design note
-----------
A stage calls its observer at every transition, and two of those calls happen where an
exception has nowhere useful to go: ``message`` and ``ready`` run inside a message
delivery, which in a one-process pipeline is an event-loop callback, so an exception there
ended in the loop's exception handler, the message was lost and the step waited for it
forever (or the simulator reported a deadlock that was none). And ``failed`` runs while the
step's real error is being raised, so an exception there replaced it.

So the stage never calls its observer directly: it calls a :class:`GuardedObserver`, which
forwards every call inside ``try`` (adding the stage as the first argument, so the parts
that call it need not know the stage). When the observer raises, the guard stops calling it for
the rest of the step (a broken observer would likely raise again), makes an
:class:`~rrfp_async.ObserverError` whose cause is the observer's exception and hands it to
the running step's ``fail``, exactly as a broken channel is handed over: the step's loop raises it
at its next turn, or at once when it waits. The transition itself goes on (the message is
still delivered, the task still counted), so the stage's state stays consistent. If the
step had already failed, that error stays the root cause and the observer's is a note on
it (``attach_observer_error``). ``failed`` itself is guarded the same way
(``call_failed``). The guard costs one extra call per transition while an observer is
active, and nothing when there is none or it is inactive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .._check import describe
from .._errors import ObserverError
from .._tasks import Task
from ._records import StepStats

# ``StageLoop`` (``_stage_loop`` imports this module; a stage is typed ``Any`` in this
# module to keep the import graph acyclic): the guard reads its ``rank``, ``step`` and
# ``observer``, and hands it to the observer's calls.
StageLoop = Any


class GuardedRun(Protocol):
    """What the guard needs of the running step (a :class:`~rrfp_async.loop._step_run.StepRun`):
    where the step's guard and the observer's error live, and how the step fails."""

    obs: GuardedObserver | None
    obs_error: BaseException | None

    def fail(self, exc: BaseException) -> None: ...


__all__ = [
    "ActiveObserver",
    "FailedObserver",
    "GuardedObserver",
    "GuardedRun",
    "attach_observer_error",
    "call_failed",
    "guard_observer",
]


# An observer's optional hooks (beside the transitions of ``StageObserver``), each a protocol
# of one member checked with ``isinstance``. A hook must be a real attribute of the observer
# or its class: on Python >= 3.12 ``isinstance`` does not see names only ``__getattr__``
# supplies.


@runtime_checkable
class ActiveObserver(Protocol):
    """Optional: an observer that can be off for a whole step.

    ``active`` is read once when a step starts, on the loop thread: when it is false the stage
    calls none of the observer's transitions during that step (an observer that would write
    nothing, logging filtered out, costs the stage this one read). An observer without it is
    always active. An ``active`` that raises counts as an observer error.
    """

    @property
    def active(self) -> bool:
        """Whether the stage calls this observer during the step that starts."""


@runtime_checkable
class FailedObserver(Protocol):
    """Optional: an observer that sees a failed step's state."""

    def failed(self, stage: Any, exc: BaseException, dump: str, /) -> None:
        """Step failed on ``stage`` (a ``StageLoop``) with ``exc``; ``dump`` is the stage's
        state as text (``StageLoop.dump``). Called on the loop thread, active or not, once per
        failed step, before the step's error is raised; an exception it raises becomes a note
        on ``exc``. :class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``."""


class _Silent:
    """What a guard forwards to once its observer raised: nothing, for the rest of the step
    (the stage's loops hold the guard in locals, so the guard itself must go quiet)."""

    def __getattr__(self, name: str) -> Any:
        return _nothing


def _nothing(*args: Any) -> None:
    return None


_SILENT = _Silent()


def _broken(
    stage: StageLoop, run: GuardedRun, observer: object, method: str, e: BaseException
) -> None:
    """``observer.method`` raised ``e``: stop calling it this step and fail the step."""
    run.obs = None
    err = ObserverError(
        f"rank {stage.rank} step {stage.step}: observer {describe(observer)} raised in"
        f" {method}(): {type(e).__name__}: {e}; the step fails (an observer must not raise:"
        " catch what it cannot handle, e.g. LogObserver disables a failing log sink)",
        rank=stage.rank,
        step=stage.step,
        method=method,
    )
    err.__cause__ = e
    if run.obs_error is None:
        run.obs_error = err
    run.fail(err)


class GuardedObserver:
    """Forwards every ``StageObserver`` call to ``inner``; an exception fails the step (see
    the module's design note) instead of escaping where the call was made."""

    __slots__ = ("_inner", "_run", "_stage")

    def __init__(self, inner: Any, stage: StageLoop, run: GuardedRun) -> None:
        self._inner = inner
        self._stage = stage
        self._run = run

    def _broke(self, method: str, e: BaseException) -> None:
        inner, self._inner = self._inner, _SILENT
        _broken(self._stage, self._run, inner, method, e)

    def step_start(self) -> None:
        try:
            self._inner.step_start(self._stage)
        except Exception as e:
            self._broke("step_start", e)

    def message(self, task: Task, src: int) -> None:
        try:
            self._inner.message(self._stage, task, src)
        except Exception as e:
            self._broke("message", e)

    def ready(self, task: Task) -> None:
        try:
            self._inner.ready(self._stage, task)
        except Exception as e:
            self._broke("ready", e)

    def decision(self, task: Task, ready: Sequence[Task], idle: float) -> None:
        try:
            self._inner.decision(self._stage, task, ready, idle)
        except Exception as e:
            self._broke("decision", e)

    def task_start(self, task: Task) -> None:
        try:
            self._inner.task_start(self._stage, task)
        except Exception as e:
            self._broke("task_start", e)

    def task_end(self, task: Task, start: float, end: float) -> None:
        try:
            self._inner.task_end(self._stage, task, start, end)
        except Exception as e:
            self._broke("task_end", e)

    def stall(self, reason: str) -> None:
        try:
            self._inner.stall(self._stage, reason)
        except Exception as e:
            self._broke("stall", e)

    def tp_decision(self, task: Task, seq: int, sent: bool) -> None:
        try:
            self._inner.tp_decision(self._stage, task, seq, sent)
        except Exception as e:
            self._broke("tp_decision", e)

    def step_end(self, stats: StepStats) -> None:
        try:
            self._inner.step_end(self._stage, stats)
        except Exception as e:
            self._broke("step_end", e)


def guard_observer(stage: StageLoop, run: GuardedRun) -> GuardedObserver | None:
    """The guarded observer of ``stage`` for the step ``run`` starts, or None when it has
    none or it is inactive (an observer that would write nothing, e.g. logging filtered out,
    is skipped for the whole step: disabled logging costs this one check). An ``active``
    property that raises counts as an observer error."""
    run.obs_error = None
    obs = stage.observer
    if obs is None:
        return None
    try:
        active = obs.active if isinstance(obs, ActiveObserver) else True
    except Exception as e:
        _broken(stage, run, obs, "active", e)
        return None
    return GuardedObserver(obs, stage, run) if active else None


def call_failed(stage: StageLoop, exc: BaseException, text: str) -> None:
    """Hand a failed step's state to the observer's ``failed`` hook; if the hook raises, its
    error becomes a note on ``exc`` (which stays the error the step raises)."""
    obs = stage.observer
    if not isinstance(obs, FailedObserver):
        return
    try:
        obs.failed(stage, exc, text)
    except Exception as e:
        exc.add_note(
            f"rank {stage.rank}: observer {describe(stage.observer)} also raised in failed():"
            f" {type(e).__name__}: {e} (ignored: the step's error is the one above)"
        )


def attach_observer_error(run: GuardedRun, exc: BaseException) -> None:
    """If the observer raised during a step that failed for another reason, say so on the
    step's error (the root cause stays ``exc``)."""
    err = run.obs_error
    if err is not None and err is not exc:
        exc.add_note(f"the observer also raised: {err}")
