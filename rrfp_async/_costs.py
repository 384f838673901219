"""Microbatch metadata, declared cost models, seeded runtime variability and workloads.

A *cost model* turns microbatch sizes into task durations on a GPU-like device: a
vision-encoder stage costs by image patches, an LLM stage by total tokens, backward costs
``backward_factor`` times forward. The *declared* durations are what a scheduler may plan
with (hints); the *realized* ones add seeded compute jitter, stragglers and communication
latency, which is what a run meets. Realized values are drawn per task in a canonical order,
so every policy compared in one run meets exactly the same durations.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from ._check import check_int, check_real, check_type, describe, is_sequence
from ._errors import PlanError
from ._tasks import Kind, StepPlan, Task

__all__ = [
    "MAX_JITTER",
    "MAX_SIZE",
    "CostModel",
    "Durations",
    "Microbatch",
    "StageProfile",
]


MAX_SIZE = 2**53
"""Largest microbatch field (index, tokens, patches, images): every integer up to it is a
float exactly, and a cost model's ``tokens**2`` term stays a finite float."""

MAX_JITTER = 3.0
"""Largest sigma of the mean-one lognormal noise (``jitter``, ``latency_jitter``).

The factor is ``exp(sigma * z - sigma**2 / 2)`` with ``z`` standard normal: its mean is one
but its median ``exp(-sigma**2 / 2)``. At sigma 3 half of all tasks already take under 1.1 %
of their declared time and a step's realized work only averages out to the declared work
over thousands of tasks; far beyond it the factor underflows to 0 for every task (sigma 50
made a whole step take 0 s). Above 3 the model no longer describes noise, so it is refused.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Microbatch:
    """Size metadata of one microbatch (what a cost model and a cost-aware hint read).

    Attributes:
        index: Position of the microbatch in the step (0 .. M-1).
        tokens: Total tokens the LLM stages see (text tokens + image tokens).
        patches: Image patches the vision encoder sees (0 for text-only).
        images: Number of images (informational).
        data: Optional payload (e.g. tensors); not part of equality.
    """

    index: int
    tokens: int = 1
    patches: int = 0
    images: int = 0
    data: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("index", "tokens", "patches", "images"):
            check_int(f"Microbatch.{name}", getattr(self, name), minimum=0, maximum=MAX_SIZE)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProfile:
    """Forward cost of one virtual stage: ``fixed + per_token*tokens + per_patch*patches
    + per_token_sq*tokens**2`` seconds (the square term models attention)."""

    per_token: float = 0.0
    per_patch: float = 0.0
    per_token_sq: float = 0.0
    fixed: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_patch", "per_token_sq", "fixed"):
            check_real(f"StageProfile.{name}", getattr(self, name), minimum=0.0)

    def forward(self, mb: Microbatch) -> float:
        """Forward seconds of this stage for ``mb``."""
        t = mb.tokens
        return (
            self.fixed
            + self.per_token * t
            + self.per_patch * mb.patches
            + self.per_token_sq * t * t
        )


LLM_STAGE = StageProfile(per_token=1e-5, fixed=2e-4)
"""Default LLM stage: 10 µs per token (about 10 ms for 1k tokens), 0.2 ms fixed."""

VISION_STAGE = StageProfile(per_patch=1.2e-5, per_token=1e-6, fixed=2e-4)
"""Default vision-encoder stage: 12 µs per image patch plus the text embedding."""


def _lognormal_factor(rng: random.Random, sigma: float) -> float:
    if sigma <= 0:
        return 1.0
    return math.exp(rng.gauss(0.0, sigma) - 0.5 * sigma * sigma)


_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")


class Durations:
    """Duration in seconds of every task of a step, plus message latencies.

    ``of(task)`` is the duration; ``latency(task)`` is the delay of the message that
    carries ``task``'s input from another rank. Values are stored per kind as
    ``[virtual_stage][microbatch]`` tables.

    Args:
        tables: For each kind ``"F"``, ``"B"``, ``"I"``, ``"W"``, a table of finite,
            non-negative seconds; every table has the same shape.
        latencies: Optional tables of the same shape for message latencies.

    Raises:
        PlanError: A kind missing, a table of another shape, or a value that is not a
            finite number >= 0 (the message names the kind, row and column).
    """

    __slots__ = ("_lat", "_t")

    def __init__(
        self,
        tables: Mapping[Kind, Sequence[Sequence[float]]],
        latencies: Mapping[Kind, Sequence[Sequence[float]]] | None = None,
    ) -> None:
        self._t = _check_tables("tables", tables, None)
        shape = (len(self._t["F"]), len(self._t["F"][0]) if self._t["F"] else 0)
        self._lat = None if latencies is None else _check_tables("latencies", latencies, shape)

    @classmethod
    def _trusted(
        cls,
        tables: dict[Kind, list[list[float]]],
        latencies: dict[Kind, list[list[float]]] | None = None,
    ) -> Durations:
        """Tables built here from validated values (no second check)."""
        d = cls.__new__(cls)
        d._t = tables
        d._lat = latencies
        return d

    @property
    def shape(self) -> tuple[int, int]:
        """``(virtual stages, microbatches)`` of the tables."""
        f = self._t["F"]
        return (len(f), len(f[0]) if f else 0)

    @classmethod
    def from_arrays(
        cls,
        plan: StepPlan,
        forward: Sequence[Sequence[float]],
        backward: Sequence[Sequence[float]] | None = None,
        *,
        input_grad_share: float = 0.5,
    ) -> Durations:
        """Explicit durations indexed ``[virtual_stage][microbatch]`` (backward defaults to 2x).

        Raises:
            PlanError: The arrays do not have ``plan.num_virtual`` rows of
                ``plan.microbatches`` finite, non-negative numbers.
        """
        check_type("plan", plan, StepPlan, "a StepPlan")
        shape = (plan.num_virtual, plan.microbatches)
        fw = _check_table("forward", forward, shape)
        bw = (
            [[2.0 * x for x in row] for row in fw]
            if backward is None
            else _check_table("backward", backward, shape)
        )
        return cls._trusted(_split_tables(fw, bw, input_grad_share))

    def of(self, task: Task) -> float:
        """Duration of ``task`` in seconds."""
        return self._t[task.kind][task.stage][task.mb]

    def latency(self, task: Task) -> float:
        """Delay of the message carrying ``task``'s input across ranks (0 without a model)."""
        if self._lat is None:
            return 0.0
        return self._lat[task.kind][task.stage][task.mb]

    def by_number(self, plan: StepPlan) -> tuple[list[float], list[float] | None]:
        """Every task's duration and message latency indexed by its number in
        ``plan.graph`` (latencies None without a model): the planning code's view.

        The durations must be of ``plan``'s shape (``check_durations``)."""
        kinds = plan.kinds
        t = self._t
        dur = [x for k in kinds for row in t[k] for x in row]
        lat = self._lat
        return dur, None if lat is None else [x for k in kinds for row in lat[k] for x in row]

    def perturbed(
        self,
        *,
        seed: int,
        jitter: float = 0.0,
        straggler_prob: float = 0.0,
        straggler_factor: float = 3.0,
        latency: float = 0.0,
        latency_jitter: float = 0.0,
    ) -> Durations:
        """A copy with seeded compute jitter, stragglers and message latencies.

        Raises:
            PlanError: An argument outside its range (``jitter`` and ``latency_jitter`` in
                ``[0, MAX_JITTER]``, ``straggler_prob`` in ``[0, 1]``, ``straggler_factor``
                finite and >= 1, ``latency`` finite and >= 0, ``seed`` an integer).
        """
        seed = check_int("seed", seed)
        jitter = check_jitter("jitter", jitter)
        straggler_prob = check_real("straggler_prob", straggler_prob, minimum=0.0, maximum=1.0)
        straggler_factor = check_real("straggler_factor", straggler_factor, minimum=1.0)
        latency = check_real("latency", latency, minimum=0.0)
        latency_jitter = check_jitter("latency_jitter", latency_jitter)
        rng = random.Random(seed)
        tables: dict[Kind, list[list[float]]] = {}
        for k in _KINDS:
            rows = []
            for row in self._t[k]:
                out = []
                for x in row:
                    f = _lognormal_factor(rng, jitter)
                    if straggler_prob > 0 and rng.random() < straggler_prob:
                        f *= straggler_factor
                    out.append(x * f)
                rows.append(out)
            tables[k] = rows
        lat = None
        if latency > 0:
            lrng = random.Random(seed ^ 0x5EED)
            lat = {
                k: [[latency * _lognormal_factor(lrng, latency_jitter) for _ in row] for row in t]
                for k, t in tables.items()
            }
        d = Durations._trusted(tables, lat)
        _check_finite(d)
        return d


def check_jitter(name: str, value: Any) -> float:
    """A lognormal sigma: a finite number in ``[0, MAX_JITTER]``."""
    v = _real_or_none(value)
    if v is None or not 0 <= v <= MAX_JITTER:
        raise PlanError(
            f"{name} must be a finite number in [0, {MAX_JITTER}] (MAX_JITTER: it is the sigma of"
            " a mean-one lognormal noise factor, which beyond that shrinks most tasks to almost"
            f" nothing), got {describe(value)}"
        )
    return v


def _real_or_none(value: object) -> float | None:
    """``value`` as a float if it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return float(value)


def _check_finite(d: Durations) -> None:
    """Every duration and latency finite, and so is their sum (the step's serial time): a
    huge cost model, latency or straggler factor overflows a float."""
    sums: list[float] = []
    for what, tables in (("duration", d._t), ("latency", d._lat or {})):
        for k, t in tables.items():
            for v, row in enumerate(t):
                try:
                    total = math.fsum(row)
                except OverflowError:  # finite values whose sum is not
                    total = math.inf
                if not math.isfinite(total):
                    m = next((i for i, x in enumerate(row) if not math.isfinite(x)), None)
                    if m is None:
                        break  # each finite, the sum not: said below
                    raise PlanError(
                        f"the {what} of task {v}{k}{m} is {row[m]}: the cost model's numbers"
                        " overflow a float (smaller sizes, per-token costs, latency or"
                        " straggler_factor)"
                    )
                sums.append(total)
            else:
                continue
            sums.append(math.inf)
    try:
        total = math.fsum(sums)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise PlanError(
            "the step's durations and latencies add up to more than a float holds (the serial"
            " time of the step overflows): smaller sizes, per-token costs, latency or"
            " straggler_factor"
        )


def _as_number(name: str, x: Any) -> float:
    """``x`` as a finite float >= 0; a 0-d array or tensor counts as its number."""
    v = _real_or_none(x)
    # numpy scalars and 0-d arrays/tensors convert through __float__.
    if v is None and not isinstance(x, str | bytes | bool) and hasattr(x, "__float__"):
        try:
            v = float(x)
        except (TypeError, ValueError):
            v = None
    if v is None or not math.isfinite(v) or v < 0:
        raise PlanError(f"{name} must be a number, finite and >= 0, got {describe(x)}")
    return v


def _check_table(name: str, t: Any, shape: tuple[int, int] | None) -> list[list[float]]:
    """``t`` as a list of rows of finite floats >= 0, of ``shape`` (rows, columns) if given,
    else of rows all as long as the first."""
    # Any sized iterable of rows (lists, tuples, numpy arrays, tensors), not a str or a mapping.
    if (
        isinstance(t, str | bytes | Mapping)
        or not hasattr(t, "__len__")
        or not hasattr(t, "__iter__")
    ):
        raise PlanError(
            f"{name} durations must be a sequence of rows [virtual_stage][microbatch], got"
            f" {describe(t)}"
        )
    if shape is not None and len(t) != shape[0]:
        raise PlanError(
            f"{name} durations need one row per virtual stage ({shape[0]}), got {len(t)}"
        )
    out: list[list[float]] = []
    for v, row in enumerate(t):
        if isinstance(row, str | bytes | Mapping) or not hasattr(row, "__len__"):
            raise PlanError(
                f"{name}[{v}] must be a sequence of durations, one per microbatch, got"
                f" {describe(row)}"
            )
        cols = shape[1] if shape is not None else len(out[0]) if out else len(row)
        if len(row) != cols:
            raise PlanError(
                f"{name}[{v}] needs one duration per microbatch ({cols}), got {len(row)}"
            )
        out.append([_as_number(f"{name}[{v}][{m}]", x) for m, x in enumerate(row)])
    return out


def _split_tables(
    fw: list[list[float]], bw: list[list[float]], share: float
) -> dict[Kind, list[list[float]]]:
    share = check_real("input_grad_share", share, minimum=0.0, maximum=1.0)
    return {
        "F": fw,
        "B": bw,
        "I": [[share * x for x in row] for row in bw],
        "W": [[(1.0 - share) * x for x in row] for row in bw],
    }


def _check_tables(
    name: str, tables: Any, shape: tuple[int, int] | None
) -> dict[Kind, list[list[float]]]:
    if not isinstance(tables, Mapping):
        raise PlanError(
            f"Durations {name} must be a mapping kind -> [virtual_stage][microbatch] table,"
            f" got {describe(tables)}"
        )
    missing = [k for k in _KINDS if k not in tables]
    extra = [k for k in tables if k not in _KINDS]
    if missing or extra:
        raise PlanError(
            f"Durations {name} need exactly the kinds {list(_KINDS)}; missing {missing},"
            f" unknown {extra}"
        )
    out: dict[Kind, list[list[float]]] = {}
    for k in _KINDS:
        out[k] = _check_table(f"{name}[{k!r}]", tables[k], shape)
        if shape is None:
            shape = (len(out[k]), len(out[k][0]) if out[k] else 0)
    return out


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Declared task costs plus seeded runtime variability.

    Attributes:
        profiles: Forward cost per virtual stage; stages past the end use ``default``.
        default: Profile of stages not listed in ``profiles`` (an LLM stage).
        backward_factor: Backward seconds = factor x forward seconds (2 by default).
        input_grad_share: With a split backward, ``I`` takes this share of ``B``, ``W`` the rest.
        jitter: Sigma of a mean-one lognormal factor applied to every realized compute time.
        straggler_prob: Probability that a task is a straggler ...
        straggler_factor: ... and then takes this many times longer.
        latency: Mean one-way latency of a cross-rank message, seconds.
        latency_jitter: Sigma of a mean-one lognormal factor on each message's latency.
    """

    profiles: tuple[StageProfile, ...] = ()
    default: StageProfile = LLM_STAGE
    backward_factor: float = 2.0
    input_grad_share: float = 0.5
    jitter: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 3.0
    latency: float = 0.0
    latency_jitter: float = 0.0

    def __post_init__(self) -> None:
        profiles: Any = self.profiles
        if isinstance(profiles, str | bytes) or not isinstance(profiles, Sequence):
            raise PlanError(
                f"CostModel.profiles must be a sequence of StageProfile, got {describe(profiles)}"
            )
        for i, p in enumerate(profiles):
            check_type(f"CostModel.profiles[{i}]", p, StageProfile, "a StageProfile")
        object.__setattr__(self, "profiles", tuple(profiles))
        check_type("CostModel.default", self.default, StageProfile, "a StageProfile")
        for name in ("backward_factor", "latency"):
            v = _real_or_none(getattr(self, name))
            if v is None or not (math.isfinite(v) and v >= 0):
                raise PlanError(
                    f"CostModel.{name} must be a finite number >= 0, got"
                    f" {describe(getattr(self, name))}"
                )
        check_jitter("CostModel.jitter", self.jitter)
        check_jitter("CostModel.latency_jitter", self.latency_jitter)
        for name in ("input_grad_share", "straggler_prob"):
            v = _real_or_none(getattr(self, name))
            if v is None or not 0 <= v <= 1:
                raise PlanError(f"{name} must be in [0, 1], got {describe(getattr(self, name))}")
        v = _real_or_none(self.straggler_factor)
        if v is None or not (math.isfinite(v) and v >= 1):
            raise PlanError(
                "straggler_factor must be a finite number >= 1, got"
                f" {describe(self.straggler_factor)}"
            )

    def profile(self, stage: int) -> StageProfile:
        """The profile of virtual stage ``stage``."""
        return self.profiles[stage] if stage < len(self.profiles) else self.default

    def forward(self, stage: int, mb: Microbatch) -> float:
        """Declared forward seconds of ``mb`` on virtual stage ``stage``."""
        return self.profile(stage).forward(mb)

    def declared(self, plan: StepPlan, microbatches: Sequence[Microbatch]) -> Durations:
        """The declared (noise-free) durations of every task; no latency jitter.

        Raises:
            PlanError: Not one ``Microbatch`` per microbatch of the plan, or sizes so large
                that a duration overflows a float.
        """
        _check_mbs(plan, microbatches)
        fw = [[self.forward(v, mb) for mb in microbatches] for v in range(plan.num_virtual)]
        bw = [[self.backward_factor * x for x in row] for row in fw]
        d = Durations._trusted(_split_tables(fw, bw, self.input_grad_share))
        _check_finite(d)
        return d.perturbed(seed=0, latency=self.latency) if self.latency > 0 else d

    def realize(
        self, plan: StepPlan, microbatches: Sequence[Microbatch], *, seed: int = 0
    ) -> Durations:
        """Durations a run meets: declared x jitter x stragglers, seeded per task.

        The draws follow a canonical (kind, stage, microbatch) order, so they do not depend
        on the order in which a policy runs the tasks.
        """
        return self.declared(plan, microbatches).perturbed(
            seed=seed,
            jitter=self.jitter,
            straggler_prob=self.straggler_prob,
            straggler_factor=self.straggler_factor,
            latency=self.latency,
            latency_jitter=self.latency_jitter,
        )


def _check_mbs(plan: StepPlan, microbatches: Sequence[Microbatch]) -> None:
    check_type("plan", plan, StepPlan, "a StepPlan")
    if not is_sequence(microbatches):
        raise PlanError(
            f"microbatches must be a sequence of Microbatch, got {describe(microbatches)}"
        )
    for i, mb in enumerate(microbatches):
        check_type(f"microbatches[{i}]", mb, Microbatch, "a Microbatch")
    if len(microbatches) != plan.microbatches:
        raise PlanError(
            f"the plan has {plan.microbatches} microbatches but {len(microbatches)} were given"
        )
