"""Argument checks for the public boundary: each raises :class:`PlanError` (or the error
class given) with a message that names the argument, what was expected and what came.

Used by ``simulate``, ``StepPlan``/``Topology``, ``StepSchedule.build``, ``LocalPipeline``,
``StageLoop``/``DistributedStage`` and the CLI so that bad input never reaches the inside as
a bare built-in exception.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from ._errors import PlanError, RRFPError

__all__ = ["check_int", "check_real", "describe"]


def describe(value: Any) -> str:
    """``value`` for an error message: its repr (shortened) and type."""
    r = repr(value)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{r} ({type(value).__name__})"


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[RRFPError] = PlanError,
) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise error(f"{name} must be an integer, got {describe(value)}")
    v = int(value)
    if minimum is not None and v < minimum:
        raise error(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}")
    return v


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
    allow_inf: bool = False,
    error: type[RRFPError] = PlanError,
) -> float:
    """``value`` as a ``float`` if it is a real number (not a bool, not NaN; infinite only
    with ``allow_inf``) within the bounds (``strict_minimum``: strictly above ``minimum``)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise error(f"{name} must be a number, got {describe(value)}")
    v = float(value)
    if math.isnan(v):
        raise error(f"{name} must be a number, got NaN")
    if math.isinf(v) and not allow_inf:
        raise error(f"{name} must be finite, got {v}")
    if minimum is not None and (v <= minimum if strict_minimum else v < minimum):
        raise error(f"{name} must be {'>' if strict_minimum else '>='} {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}")
    return v
