"""Argument checks for the public boundary: each raises :class:`PlanError` (or the error
class given) with a message that names the argument, what was expected and what came.

Used by ``simulate``, ``StepPlan``/``Topology``, ``StepSchedule.build``, ``LocalPipeline``,
``StageLoop``/``DistributedStage`` and the CLI so that bad input never reaches the inside as
a bare built-in exception.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

from ._errors import PlanError, RRFPError

__all__ = [
    "check_bool",
    "check_count",
    "check_int",
    "check_real",
    "check_type",
    "describe",
    "is_int",
    "is_sequence",
]


def describe(value: Any) -> str:
    """``value`` for an error message: its repr (shortened) and type."""
    r = repr(value)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{r} ({type(value).__name__})"


def check_count(name: str, value: Any, *, error: type[RRFPError] = PlanError) -> int:
    """``value`` as an ``int`` if it is an int >= 1 (not a bool, not a float such as 2.0):
    a count of stages, chunks or microbatches."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise error(f"{name} must be an int >= 1, got {describe(value)}")
    if value < 1:
        raise error(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


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


def check_bool(name: str, value: Any, *, error: type[RRFPError] = PlanError) -> bool:
    """``value`` if it is a ``bool`` (a flag given as ``"no"`` or ``0`` would be read as
    the opposite of what was meant, or by accident)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {describe(value)}")
    return value


def check_type(
    name: str,
    value: Any,
    types: type | tuple[type, ...],
    expected: str,
    *,
    error: type[RRFPError] = PlanError,
) -> Any:
    """``value`` if it is an instance of ``types``; else ``error`` saying ``name`` must be
    ``expected`` (in words, e.g. ``"a CostModel or None"``)."""
    if not isinstance(value, types):
        raise error(f"{name} must be {expected}, got {describe(value)}")
    return value


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer (``int``, a numpy integer, ...) and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_sequence(value: object) -> bool:
    """Whether ``value`` is a sequence of items (a list, a tuple, ...), not a string."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)
