"""The boundary checks of a stage's and a pipeline's ``run_step`` and constructor."""

from __future__ import annotations

from typing import Any

from .._check import check_int, check_real, describe
from .._errors import PlanError
from .._tasks import StepPlan
from ..policies._schedule import StepSchedule

__all__ = ["check_step_args", "check_step_timeout"]


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
) -> None:
    """The boundary checks of ``run_step`` (``who`` prefixes each message).

    Raises:
        PlanError: ``microbatches`` is not a sized, indexable collection of the plan's
            number of microbatches; ``step`` is not None or an integer >= 0; ``schedule``
            is not None or a ``StepSchedule`` of the same plan.
    """
    if schedule is not None:
        if not isinstance(schedule, StepSchedule):
            raise PlanError(
                f"{who}: schedule must be a StepSchedule (or None), got {describe(schedule)}"
            )
        if schedule.plan != plan:
            raise PlanError(
                f"{who}: a per-step schedule must have the stage's plan {plan}, got one for"
                f" {schedule.plan}"
            )
    if step is not None:
        check_int(f"{who}: step", step, minimum=0)
    if not (hasattr(microbatches, "__len__") and hasattr(microbatches, "__getitem__")):
        raise PlanError(
            f"{who}: microbatches must be a sequence of {plan.microbatches} microbatches, got"
            f" {describe(microbatches)}"
        )
    n = len(microbatches)
    if n != plan.microbatches:
        raise PlanError(
            f"{who}: microbatches: the plan has {plan.microbatches} microbatches, got {n}"
        )
