"""The boundary checks of a stage's and a pipeline's ``run_step`` and constructor."""

from __future__ import annotations

from typing import Any

from .._check import check_int, check_real, describe
from .._errors import PlanError
from .._tasks import StepPlan
from ..policies import StepSchedule

__all__ = ["MAX_STEP", "check_step_args", "check_step_timeout"]

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
