"""Admission bounds: how many activations each pipeline rank may hold in flight.

The bound of a rank caps its stashed activations (a forward adds one, the backward that
consumes it frees it; see ``activation_delta``). Its default is what the fixed order the hint
replaces would hold: what 1F1B holds (``default_bound``), or the hint's own in-order peak if
that is higher (GPipe holds every microbatch). ``resolve_bounds`` turns that default, a
``memory_factor`` or an explicit ``max_inflight`` into one bound per rank and refuses a bound
the hint itself could not run under. The cost-aware hint generators schedule under
``default_bounds``; the stage loop admits forwards against the resolved bounds
(``AdmissionLedger``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from numbers import Real

from .._admission import hint_peak
from .._check import check_int, check_real, describe, is_int, is_sequence
from .._errors import HintError
from .._tasks import StepPlan
from ._validate import Hint

__all__ = ["default_bound", "default_bounds", "microbatches_per_round", "resolve_bounds"]


def microbatches_per_round(plan: StepPlan) -> int | None:
    """Microbatches per round, as torch computes it (flexible interleaving), or None when
    M is not a multiple of the number of rounds max(1, M // P)."""
    m = plan.microbatches
    rounds = max(1, m // plan.stages)
    return m // rounds if m % rounds == 0 else None


def default_bound(plan: StepPlan, rank: int) -> int:
    """What 1F1B holds in flight on pipeline rank ``rank`` (``r``): ``min(P - r, M)`` with one
    chunk, and torch's / Megatron's interleaved warm-up count plus one with several (capped
    at ``M * V``)."""
    p, m, v = plan.stages, plan.microbatches, plan.topology.chunks
    if v == 1:
        return min(p - rank, m)
    # No torch rounds: Megatron's count, M per round = P.
    per_round = microbatches_per_round(plan) or p
    return min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, m * v)


def default_bounds(plan: StepPlan) -> list[int]:
    """``default_bound`` of every pipeline rank, rank 0 first."""
    return [default_bound(plan, r) for r in range(plan.stages)]


def _check_max_inflight(max_inflight: object, p: int) -> list[int]:
    """``max_inflight`` as one int per rank: an integer, or a sequence of ``p`` integers."""
    if is_int(max_inflight):
        return [check_int("max_inflight", max_inflight, error=HintError)] * p
    if not is_sequence(max_inflight):
        raise HintError(
            "max_inflight must be an integer (every rank) or a sequence of one integer per"
            f" rank, got {describe(max_inflight)}"
        )
    assert isinstance(max_inflight, Sequence)
    if len(max_inflight) != p:
        raise HintError(f"max_inflight needs one bound per rank ({p}), got {len(max_inflight)}")
    return [check_int(f"max_inflight[{r}]", x, error=HintError) for r, x in enumerate(max_inflight)]


def _check_memory_factor_type(value: object) -> None:
    """Refuse a ``memory_factor`` that is no number (a string from a config file or the
    command line, a bool), saying what a valid one is and, for a number written as text,
    the call that works."""
    if isinstance(value, bool) or not isinstance(value, Real):
        fix = ""
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                v = float(value)
                fix = f": pass memory_factor={v!r}" if math.isfinite(v) and v > 0 else ""
        raise HintError(
            f"memory_factor must be a number, got {describe(value)}: a finite float > 0 that"
            " scales each rank's default admission bound (1.0 keeps it, 2.0 doubles the"
            f" activations a rank may hold, rounded down, at least 1){fix}"
        )


def resolve_bounds(
    plan: StepPlan,
    hint: Hint,
    *,
    max_inflight: int | Sequence[int] | None = None,
    memory_factor: float | None = None,
) -> list[int]:
    """The admission bound of every rank.

    Default: ``max(default_bound(rank), peak of the hint on that rank)``, i.e. what 1F1B
    holds, or what the fixed order of the hint itself holds if it holds more (GPipe), so
    that readiness-first never stashes more activations than the order it replaces.
    ``memory_factor`` scales that default (rounded down, at least 1); ``max_inflight`` sets
    it outright (one int for every rank, or one per rank).

    Raises:
        HintError: Both options given, a value of the wrong type (``max_inflight``: an
            integer or a sequence of one integer per rank; ``memory_factor``: a finite
            number > 0), a non-positive value, or a bound below the hint's own peak (the
            hint could not run in order).
    """
    if max_inflight is not None and memory_factor is not None:
        raise HintError("give max_inflight or memory_factor, not both")
    p = plan.stages
    peaks = [hint_peak(hint[r]) for r in range(p)]
    if max_inflight is not None:
        bounds = _check_max_inflight(max_inflight, p)
    else:
        base = [max(default_bound(plan, r), peaks[r]) for r in range(p)]
        if memory_factor is not None:
            _check_memory_factor_type(memory_factor)
            mf = check_real(
                "memory_factor", memory_factor, minimum=0.0, strict_minimum=True, error=HintError
            )
            scaled = [mf * b + 1e-9 for b in base]
            if not all(math.isfinite(x) for x in scaled):
                raise HintError(
                    f"memory_factor={mf!r} x the default admission bound overflows a float;"
                    " give a smaller factor (any factor above the step's task count is"
                    " already no bound)"
                )
            bounds = [max(1, int(x)) for x in scaled]
        else:
            bounds = base
    for r, (b, pk) in enumerate(zip(bounds, peaks, strict=True)):
        if b < 1:
            raise HintError(f"rank {r}: the admission bound must be >= 1, got {b}")
        if pk > b:
            raise HintError(
                f"rank {r}: the hint holds {pk} activations in flight when run in order but"
                f" the admission bound is {b}; raise max_inflight / memory_factor or choose a"
                " hint that holds fewer"
            )
    return bounds
