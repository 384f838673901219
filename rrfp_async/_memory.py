"""Memory in bytes: each forward's activation bytes, and each rank's byte budget.

Design note: the byte budget
----------------------------
A count of in-flight microbatches is not memory once microbatches differ in size: a
readiness-first rank that stashes its largest microbatches together holds more bytes than
the fixed order it replaces although it holds the same count. The admission ledger
(``_admission``) therefore weighs each forward by the bytes it stashes on its rank
(``ActivationBytes``: one number per virtual stage and microbatch, freed by the backward
that consumes them), and bounds the rank's in-flight *bytes* by a budget.

The default budget of a rank is what the order a user would otherwise run holds, in bytes,
on this step's own microbatches: the peak of the *reference* order run strictly — the hint
itself when it is a fixed order (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ...), and 1F1B
(interleaved 1F1B with several chunks) when the hint is cost-aware and built here — so
that "the same memory" is measured where it matters, in bytes per rank. A cost-aware hint
is then built *under* that budget (``policies._listsched``), and readiness-first only uses
the room the hint itself leaves.

``memory_budget`` overrides it: a ``float`` scales the default (``1.5``: half as many bytes
again), an ``int`` or a string with a unit (``"24GiB"``) is bytes on every rank, a sequence
gives one value per rank. A budget below the hint's own strict peak could not run the hint
in order; it is refused (``PlanError``) with the numbers and the fix.

Why the banker's invariant still holds with weights: see ``_admission``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Protocol

from ._check import check_type, describe, is_sequence
from ._errors import PlanError
from ._tasks import StepPlan, Task


class RanTask(Protocol):
    """A task as it ran (``loop.ExecutedTask``): the task, its start and its end."""

    @property
    def task(self) -> Task: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


__all__ = [
    "ActivationBytes",
    "MemoryBudget",
    "RanTask",
    "check_budgets",
    "format_bytes",
    "held_peak",
    "parse_memory_budget",
    "parse_memory_budgets",
    "position_weights",
    "resolve_budgets",
    "weighted_peak",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

MemoryBudget = float | int | str | Sequence[float | int | str]
"""What ``memory_budget=`` takes: a factor of the default budget (a ``float``), bytes (an
``int``, or a string such as ``"24GiB"``), or one of those per rank."""


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: ``"1.50 GiB"``, ``"312.0 KiB"``, ``"17 B"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class ActivationBytes:
    """Bytes each forward stashes on its rank until its backward frees them, per task.

    Values are stored as a ``[virtual_stage][microbatch]`` table, like ``Durations``; a
    forward ``Task(v, "F", i)`` adds ``of(v, i)`` bytes to its rank's in-flight bytes and
    the backward that consumes it (``B``, or ``I`` when the backward is split) frees them.

    Args:
        table: ``plan.num_virtual`` rows of ``plan.microbatches`` finite numbers >= 0,
            rounded to whole bytes (the ledger's sums are then exact).

    Raises:
        PlanError: A table of another shape, or a value that is not a finite number >= 0
            (the message names the stage and the microbatch).
    """

    __slots__ = ("_t",)

    def __init__(self, table: Sequence[Sequence[float]]) -> None:
        if not is_sequence(table) or not table or not all(is_sequence(r) for r in table):
            raise PlanError(
                "activation bytes must be a [virtual_stage][microbatch] table of numbers,"
                f" got {describe(table)}"
            )
        rows: list[list[int]] = []
        width = len(table[0])
        for v, row in enumerate(table):
            if len(row) != width:
                raise PlanError(
                    f"activation bytes: virtual stage {v} has {len(row)} microbatches,"
                    f" virtual stage 0 has {width}: every row needs one value per microbatch"
                )
            out: list[int] = []
            for i, value in enumerate(row):
                x: object = value
                if isinstance(x, bool) or not isinstance(x, Real) or not math.isfinite(float(x)):
                    raise PlanError(
                        f"activation bytes of virtual stage {v}, microbatch {i}: got"
                        f" {describe(x)}, expected a finite number of bytes >= 0"
                    )
                if float(x) < 0:
                    raise PlanError(
                        f"activation bytes of virtual stage {v}, microbatch {i}: got {x!r},"
                        " expected a finite number of bytes >= 0"
                    )
                out.append(round(float(x)))
            rows.append(out)
        self._t = rows

    @classmethod
    def uniform(cls, plan: StepPlan, nbytes: float = 1.0) -> ActivationBytes:
        """Every forward stashes ``nbytes``: the byte budget is then the count bound."""
        check_type("plan", plan, StepPlan, "a StepPlan")
        return cls([[nbytes] * plan.microbatches for _ in range(plan.num_virtual)])

    @classmethod
    def from_sizes(
        cls,
        plan: StepPlan,
        sizes: Sequence[float],
        per_stage: Sequence[float] | float = 1.0,
    ) -> ActivationBytes:
        """Bytes proportional to each microbatch's size: ``sizes[i] * per_stage[v]``
        (a microbatch's tokens, image patches included, and the bytes one token stashes on
        virtual stage ``v``).

        Raises:
            PlanError: ``sizes`` is not one number per microbatch, or ``per_stage`` not one
                number per virtual stage.
        """
        check_type("plan", plan, StepPlan, "a StepPlan")
        m, nv = plan.microbatches, plan.num_virtual
        if not is_sequence(sizes) or len(sizes) != m:
            raise PlanError(
                f"sizes must give one number per microbatch ({m}), got {describe(sizes)}"
            )
        scale: list[float] = (
            [float(per_stage)] * nv
            if isinstance(per_stage, (int, float))
            else [float(x) for x in per_stage]
        )
        if len(scale) != nv:
            raise PlanError(
                f"per_stage must give one number per virtual stage ({nv}), got {len(scale)}"
            )
        return cls([[s * x for x in sizes] for s in scale])

    @property
    def shape(self) -> tuple[int, int]:
        """``(virtual stages, microbatches)`` of the table."""
        return (len(self._t), len(self._t[0]))

    def of(self, stage: int, mb: int) -> int:
        """Bytes the forward of microbatch ``mb`` on virtual stage ``stage`` stashes."""
        return self._t[stage][mb]

    def rows(self) -> list[list[int]]:
        """The table (a copy), ``[virtual_stage][microbatch]``."""
        return [list(r) for r in self._t]

    def check_plan(self, plan: StepPlan) -> None:
        """Refuse a table of another shape than ``plan``'s.

        Raises:
            PlanError: The shape differs (the message gives both).
        """
        want = (plan.num_virtual, plan.microbatches)
        if self.shape != want:
            raise PlanError(
                f"activation bytes are for {self.shape[0]} virtual stages x {self.shape[1]}"
                f" microbatches, the step has {want[0]} x {want[1]}"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActivationBytes) and self._t == other._t

    def __hash__(self) -> int:
        return hash(tuple(map(tuple, self._t)))

    def __repr__(self) -> str:
        v, m = self.shape
        total = sum(map(sum, self._t))
        return f"ActivationBytes({v} x {m}, total {format_bytes(total)})"


def position_weights(order: Sequence[Task], nbytes: ActivationBytes) -> list[int]:
    """For each position of ``order``, how it changes the rank's in-flight bytes: the
    forward's bytes (+), the freeing backward's (-), 0 for the others (``W``; ``B`` after
    an ``I``)."""
    out = []
    t = nbytes._t
    for task in order:
        k = task.kind
        if k == "F":
            out.append(t[task.stage][task.mb])
        elif k in ("B", "I"):
            out.append(-t[task.stage][task.mb])
        else:
            out.append(0)
    return out


def weighted_peak(order: Sequence[Task], nbytes: ActivationBytes) -> int:
    """The most bytes in flight when ``order`` (one rank's tasks) runs strictly."""
    c = peak = 0
    for w in position_weights(order, nbytes):
        c += w
        if c > peak:
            peak = c
    return peak


def parse_memory_budget(value: object, what: str = "memory_budget") -> float | int:
    """One rank's ``memory_budget`` value: a ``float`` factor, or ``int`` bytes (a string
    with a unit, ``"24GiB"``, ``"512 MB"``, becomes bytes).

    Raises:
        PlanError: No number, a string that is no size, NaN, infinite, zero or negative.
    """
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise PlanError(
                f"{what}={value!r} is no size: give bytes as an int or a string with a unit"
                " (B, KB, MB, GB, KiB, MiB, GiB, TiB: '24GiB'), or a float factor of the"
                " default budget (1.0: what the fixed order holds)"
            )
        return int(float(m.group(1)) * _UNITS[unit])
    if isinstance(value, bool) or not isinstance(value, Real):
        raise PlanError(
            f"{what} must be a float factor of the default budget, bytes (an int or a string"
            f" such as '24GiB'), or one of those per rank; got {describe(value)}"
        )
    x = float(value)
    if not math.isfinite(x) or x <= 0:
        raise PlanError(
            f"{what}={value!r}: a budget must be a finite number > 0 (a float factor of the"
            " default budget, or bytes)"
        )
    return int(value) if isinstance(value, Integral) else x


def parse_memory_budgets(
    memory_budget: object, ranks: int | None = None
) -> list[float | int | None] | None:
    """A whole ``memory_budget`` parsed (``parse_memory_budget`` on each value): None for
    none; else one value per rank (None: that rank's default), a single value repeated
    ``ranks`` times (once when ``ranks`` is None, where the number of ranks is not known yet).
    Every entry point's one check of the option's values, before any step: what needs a
    step's bytes (a budget below the hint's peak) is ``check_budgets``'s.

    Args:
        memory_budget: A ``MemoryBudget`` (or None).
        ranks: The pipeline's ranks, when known: a per-rank sequence must have as many.

    Raises:
        PlanError: A value that is no size or factor (NaN, infinite, <= 0, a bool, a string
            without a unit), an empty per-rank sequence, or one of another length than
            ``ranks``; the message names ``memory_budget`` (and the rank).
    """
    if memory_budget is None:
        return None
    if not is_sequence(memory_budget) or isinstance(memory_budget, str):
        return [parse_memory_budget(memory_budget)] * (1 if ranks is None else ranks)
    assert isinstance(memory_budget, Sequence)
    if not memory_budget or (ranks is not None and len(memory_budget) != ranks):
        raise PlanError(
            f"memory_budget needs one value per rank ({ranks if ranks is not None else '>= 1'}),"
            f" got {len(memory_budget)}"
        )
    return [
        None if v is None else parse_memory_budget(v, f"memory_budget[{r}]")
        for r, v in enumerate(memory_budget)
    ]


def resolve_budgets(
    plan: StepPlan,
    reference: Sequence[int],
    memory_budget: MemoryBudget | None = None,
) -> list[int]:
    """Every rank's byte budget, in whole bytes.

    Default: ``reference[r]``, the strict peak of the order the user would run otherwise
    on this step's bytes. ``memory_budget`` scales it (a float) or replaces it (bytes; see
    the module's design note).

    Raises:
        PlanError: A bad ``memory_budget`` (``parse_memory_budgets``).
    """
    p = plan.stages
    values = parse_memory_budgets(memory_budget, p) or [None] * p
    out = []
    for r, x in enumerate(values):
        if x is None:
            out.append(reference[r])
        elif isinstance(x, float):
            scaled = x * reference[r] + 1e-9
            if not math.isfinite(scaled):
                raise PlanError(
                    f"memory_budget={x!r} x rank {r}'s default budget"
                    f" ({format_bytes(reference[r])}) overflows a float: give a smaller factor,"
                    " or bytes"
                )
            out.append(math.floor(scaled))
        else:
            out.append(x)
    return out


def check_budgets(
    plan: StepPlan,
    hint: Mapping[int, Sequence[Task]],
    nbytes: ActivationBytes,
    budgets: Sequence[int],
    reference: Sequence[int],
    memory_budget: MemoryBudget | None = None,
    step: int | None = None,
) -> None:
    """Refuse a budget the hint cannot run in strictly.

    Raises:
        PlanError: On some rank the hint, run in order, holds more bytes than the budget:
            the message names the rank, the step, the microbatch whose forward crosses
            the budget, and the numbers (and, for a small int, the factor it may have meant).
    """
    nbytes.check_plan(plan)
    for r in range(plan.stages):
        given = memory_budget
        if is_sequence(memory_budget) and not isinstance(memory_budget, str):
            given = memory_budget[r]  # type: ignore[index]
        _check_fits(r, hint[r], nbytes, budgets[r], reference[r], given, step)


def _check_fits(
    rank: int,
    order: Sequence[Task],
    nbytes: ActivationBytes,
    budget: int,
    reference: int,
    given: object,
    step: int | None,
) -> None:
    c = 0
    for task, w in zip(order, position_weights(order, nbytes), strict=True):
        c += w
        if c > budget:
            where = f"rank {rank}" + ("" if step is None else f" step {step}")
            hint_peak = weighted_peak(order, nbytes)
            fix = (
                f"; {given!r} looks like a factor: pass memory_budget={float(given)!r}"
                if isinstance(given, int) and not isinstance(given, bool) and given < 1024
                else ""
            )
            raise PlanError(
                f"{where}: the hint holds {format_bytes(hint_peak)} of activations when run in"
                f" order (crossing the budget at {task}, microbatch {task.mb}:"
                f" {format_bytes(c)}) but the byte budget is {format_bytes(budget)}"
                f" (the fixed order holds {format_bytes(reference)}); raise memory_budget"
                f" or choose a hint that holds fewer bytes{fix}"
            )


def held_peak(executed: Sequence[RanTask], nbytes: Mapping[tuple[int, int], int]) -> int:
    """The most bytes a rank held in a run: each forward's ``nbytes[(stage, mb)]`` from its
    start until the end of the backward that frees them (``B``, or ``I`` when split); a
    forward missing from ``nbytes`` counts 0. With measured bytes
    (``TorchStageExecutor.activation_bytes()``) this is the rank's measured peak of
    activation memory in the order it ran."""
    events: list[tuple[float, int, int]] = []
    for e in executed:
        t = e.task
        b = nbytes.get((t.stage, t.mb), 0)
        if t.kind == "F":
            events.append((e.start, 1, b))
        elif t.kind in ("B", "I"):
            events.append((e.end, 0, -b))
    held = peak = 0
    for _, _, d in sorted(events):  # frees first at equal times
        held += d
        peak = max(peak, held)
    return peak
