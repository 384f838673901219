"""The boundary checks of a stage's and a pipeline's ``run_step`` and constructor, and the
one resolution of a step's number and schedule from ``run_step``'s arguments."""

from __future__ import annotations

from typing import Any, NamedTuple

from .._check import check_bool, check_int, check_real, describe
from .._errors import PlanError
from .._tasks import StepPlan
from ..policies import StepSchedule

__all__ = ["MAX_STEP", "ResolvedStep", "check_step_args", "check_step_timeout", "resolve_step"]

MAX_STEP = (1 << 63) - 2
"""The largest step number: every step number travels as an int64 (in message headers), and
so must the next one."""


def check_step_timeout(value: object) -> float | None:
    """``step_timeout`` as seconds (None: no watchdog; so is an infinite one).

    Raises:
        PlanError: Not None and not a number > 0.
    """
    if value is None:
        return None
    t = check_real("step_timeout", value, minimum=0.0, strict_minimum=True, allow_inf=True)
    return None if t == float("inf") else t


def check_step_args(
    who: str,
    plan: StepPlan,
    microbatches: Any,
    step: object,
    schedule: object,
    max_microbatches: int | None = None,
) -> None:
    """The boundary checks of ``run_step`` (``who`` prefixes each message).

    A step may have any number of microbatches >= 1 (up to ``max_microbatches`` when given):
    the stage derives the schedule for that size (``StepSchedule.for_microbatches``). A
    per-step ``schedule`` must have the stage's topology and exactly as many microbatches as
    the step.

    Raises:
        PlanError: ``microbatches`` is not a sized, indexable collection of at least one
            microbatch (at most ``max_microbatches``), or of another count than a given
            ``schedule``'s; ``step`` is not None or an integer >= 0; ``schedule`` is not
            None or a ``StepSchedule`` of the stage's topology.
    """
    if schedule is not None:
        if not isinstance(schedule, StepSchedule):
            raise PlanError(
                f"{who}: schedule must be a StepSchedule (or None), got {describe(schedule)}"
            )
        if schedule.plan.topology != plan.topology:
            raise PlanError(
                f"{who}: a per-step schedule must have the stage's topology {plan.topology},"
                f" got one for {schedule.plan.topology}"
            )
    if step is not None:
        check_int(f"{who}: step", step, minimum=0, maximum=MAX_STEP)
    # Any sequence (a list, a tuple, a tensor or a dataset slice), not a one-shot iterator.
    if not (hasattr(microbatches, "__len__") and hasattr(microbatches, "__getitem__")):
        raise PlanError(
            f"{who}: microbatches must be a sequence of microbatches (the plan has"
            f" {plan.microbatches}), got {describe(microbatches)}"
        )
    n = len(microbatches)
    if schedule is not None and n != schedule.plan.microbatches:
        raise PlanError(
            f"{who}: microbatches: the per-step schedule has {schedule.plan.microbatches}"
            f" microbatches, got {n}"
        )
    if n < 1:
        raise PlanError(f"{who}: microbatches: a step needs at least 1 microbatch, got 0")
    if max_microbatches is not None and n > max_microbatches:
        raise PlanError(
            f"{who}: microbatches: at most max_microbatches={max_microbatches} per step, got {n}"
        )


class ResolvedStep(NamedTuple):
    """What ``run_step``'s arguments resolve to (:func:`resolve_step`)."""

    step: int
    """The step's number."""
    schedule: StepSchedule
    """The schedule the step runs (derived for its size; forward-only for an eval step)."""
    base: StepSchedule
    """What later steps derive their schedules from: a per-step training schedule when one
    was given, else the base it was resolved against."""


def resolve_step(
    who: str,
    base: StepSchedule,
    microbatches: Any,
    *,
    step: int | None,
    schedule: StepSchedule | None,
    train: bool,
    next_step: int,
    max_microbatches: int | None = None,
) -> ResolvedStep:
    """Check ``run_step``'s arguments and resolve the step's number and schedule.

    The one resolution that every entry point uses (a stage loop, a local pipeline, a
    distributed stage): a step of another size than ``base``'s runs the schedule derived for
    it (``StepSchedule.for_microbatches``), a per-step ``schedule`` runs as given (and later
    steps derive from it, unless it is forward-only), ``train=False`` runs the forward-only
    schedule (``StepSchedule.forward_only``). Whether a step number may run again is the
    stage's own question (``StageLoop.check_step_number``).

    Args:
        who: Prefixes each error message (``"rank 3"``, ``"run_step"``).
        base: The schedule this step derives from when none is given.
        microbatches: The step's microbatches.
        step: The step number, or None for ``next_step``.
        schedule: A schedule for this step, or None.
        train: False for a forward-only (evaluation) step.
        next_step: The number of the step when ``step`` is None.
        max_microbatches: The most microbatches a step may have (None: no limit).

    Returns:
        The step's number, the schedule it runs, and what later steps derive from.

    Raises:
        PlanError: The arguments do not fit (see :func:`check_step_args`), ``train`` is not
            a bool, or no schedule can be derived for the step's size.
    """
    check_step_args(who, base.plan, microbatches, step, schedule, max_microbatches)
    check_bool(f"{who}: train", train)
    new_base = base if schedule is None or schedule.plan.forward_only else schedule
    try:
        sched = schedule if schedule is not None else new_base.for_microbatches(len(microbatches))
        if not train:
            sched = sched.forward_only()
    except PlanError as e:
        raise PlanError(f"{who}: {e}") from None
    return ResolvedStep(next_step if step is None else int(step), sched, new_base)
