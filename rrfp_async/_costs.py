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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ._errors import PlanError
from ._tasks import Kind, StepPlan, Task

__all__ = [
    "WORKLOADS",
    "CostModel",
    "Durations",
    "Microbatch",
    "StageProfile",
    "Workload",
    "make_workload",
]

WorkloadName: TypeAlias = Literal["uniform", "text", "multimodal", "multimodal_paper"]


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
        if self.index < 0 or self.tokens < 0 or self.patches < 0 or self.images < 0:
            raise PlanError(f"microbatch fields must be >= 0, got {self!r}")


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
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise PlanError(f"StageProfile.{name} must be a finite number >= 0, got {v!r}")

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


class Durations:
    """Duration in seconds of every task of a step, plus message latencies.

    ``of(task)`` is the duration; ``latency(task)`` is the delay of the message that
    carries ``task``'s input from another rank. Values are stored per kind as
    ``[virtual_stage][microbatch]`` tables.
    """

    __slots__ = ("_lat", "_t")

    def __init__(
        self,
        tables: dict[Kind, list[list[float]]],
        latencies: dict[Kind, list[list[float]]] | None = None,
    ) -> None:
        self._t = tables
        self._lat = latencies

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
        fw = _check_table("forward", forward, plan)
        bw = (
            [[2.0 * x for x in row] for row in fw]
            if backward is None
            else _check_table("backward", backward, plan)
        )
        return cls(_split_tables(fw, bw, input_grad_share))

    def of(self, task: Task) -> float:
        """Duration of ``task`` in seconds."""
        return self._t[task.kind][task.stage][task.mb]

    def latency(self, task: Task) -> float:
        """Delay of the message carrying ``task``'s input across ranks (0 without a model)."""
        if self._lat is None:
            return 0.0
        return self._lat[task.kind][task.stage][task.mb]

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
        """A copy with seeded compute jitter, stragglers and message latencies."""
        rng = random.Random(seed)
        tables: dict[Kind, list[list[float]]] = {}
        for k in ("F", "B", "I", "W"):
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
        return Durations(tables, lat)


def _check_table(name: str, t: Sequence[Sequence[float]], plan: StepPlan) -> list[list[float]]:
    if len(t) != plan.num_virtual:
        raise PlanError(
            f"{name} durations need one row per virtual stage ({plan.num_virtual}), got {len(t)}"
        )
    out = []
    for v, row in enumerate(t):
        if len(row) != plan.microbatches:
            raise PlanError(
                f"{name}[{v}] needs one duration per microbatch ({plan.microbatches}),"
                f" got {len(row)}"
            )
        r = [float(x) for x in row]
        for m, x in enumerate(r):
            if not math.isfinite(x) or x < 0:
                raise PlanError(f"{name}[{v}][{m}] must be finite and >= 0, got {x!r}")
        out.append(r)
    return out


def _split_tables(
    fw: list[list[float]], bw: list[list[float]], share: float
) -> dict[Kind, list[list[float]]]:
    if not 0.0 <= share <= 1.0:
        raise PlanError(f"input_grad_share must be in [0, 1], got {share!r}")
    return {
        "F": fw,
        "B": bw,
        "I": [[share * x for x in row] for row in bw],
        "W": [[(1.0 - share) * x for x in row] for row in bw],
    }


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
        for name in ("backward_factor", "jitter", "latency", "latency_jitter"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise PlanError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if not 0.0 <= self.input_grad_share <= 1.0:
            raise PlanError(f"input_grad_share must be in [0, 1], got {self.input_grad_share!r}")
        if not 0.0 <= self.straggler_prob <= 1.0:
            raise PlanError(f"straggler_prob must be in [0, 1], got {self.straggler_prob!r}")
        if self.straggler_factor < 1.0:
            raise PlanError(f"straggler_factor must be >= 1, got {self.straggler_factor!r}")

    def profile(self, stage: int) -> StageProfile:
        """The profile of virtual stage ``stage``."""
        return self.profiles[stage] if stage < len(self.profiles) else self.default

    def forward(self, stage: int, mb: Microbatch) -> float:
        """Declared forward seconds of ``mb`` on virtual stage ``stage``."""
        return self.profile(stage).forward(mb)

    def declared(self, plan: StepPlan, microbatches: Sequence[Microbatch]) -> Durations:
        """The declared (noise-free) durations of every task; no latency jitter."""
        _check_mbs(plan, microbatches)
        fw = [[self.forward(v, mb) for mb in microbatches] for v in range(plan.num_virtual)]
        bw = [[self.backward_factor * x for x in row] for row in fw]
        d = Durations(_split_tables(fw, bw, self.input_grad_share))
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
    if len(microbatches) != plan.microbatches:
        raise PlanError(
            f"the plan has {plan.microbatches} microbatches but {len(microbatches)} were given"
        )


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A step's microbatches and the cost model that prices them."""

    name: str
    microbatches: tuple[Microbatch, ...]
    cost: CostModel


def _uniform(n: int, rng: random.Random) -> list[Microbatch]:
    return [Microbatch(index=i, tokens=1024) for i in range(n)]


def _text(n: int, rng: random.Random) -> list[Microbatch]:
    # Lognormal text lengths (median ~900 tokens), as in packed-free SFT data.
    out = []
    for i in range(n):
        t = int(min(4096, max(64, rng.lognormvariate(math.log(900), 0.6))))
        out.append(Microbatch(index=i, tokens=t))
    return out


PATCHES_PER_IMAGE = 576
"""Image patches per image (a 336 px image at 14 px patches, as in CLIP ViT-L/14-336)."""


def _multimodal(n: int, rng: random.Random) -> list[Microbatch]:
    # 0-4 images per sample, each 576 patches that become 576 LLM tokens after projection,
    # plus lognormal text (median ~250 tokens).
    out = []
    for i in range(n):
        images = rng.randint(0, 4)
        text = int(min(2048, max(16, rng.lognormvariate(math.log(250), 0.7))))
        patches = images * PATCHES_PER_IMAGE
        out.append(Microbatch(index=i, tokens=text + patches, patches=patches, images=images))
    return out


PAPER_IMAGE_TOKENS = (4, 1280)
"""Smallest and largest image of ``multimodal_paper``, in tokens (= patches), log-uniform."""


def multimodal_paper_sizes(
    n: int,
    rng: random.Random,
    *,
    image_tokens: tuple[int, int] = PAPER_IMAGE_TOKENS,
    text_sigma: float = 0.7,
) -> list[Microbatch]:
    """The ``multimodal_paper`` microbatches: 0-4 images per sample, each of
    ``image_tokens`` tokens (= patches), log-uniform, plus lognormal text (median 250 tokens,
    sigma ``text_sigma``, clipped to 16-2048). The defaults are the RRFP preprint's range
    (median ~72, mean ~221 tokens per image: many thumbnails, a few full-resolution images).
    """
    lo, hi = image_tokens
    out = []
    for i in range(n):
        images = rng.randint(0, 4)
        sizes = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(images)]
        text = int(min(2048, max(16, rng.lognormvariate(math.log(250), text_sigma))))
        patches = sum(sizes)
        out.append(Microbatch(index=i, tokens=text + patches, patches=patches, images=images))
    return out


WORKLOADS = {
    "uniform": _uniform,
    "text": _text,
    "multimodal": _multimodal,
    "multimodal_paper": multimodal_paper_sizes,
}
"""The built-in workload generators by name."""


def make_workload(
    name: str,
    microbatches: int,
    *,
    virtual_stages: int,
    seed: int = 0,
    jitter: float = 0.0,
    latency: float = 0.0,
    latency_jitter: float = 0.0,
) -> Workload:
    """Build a named workload: microbatch sizes plus a matching cost model.

    ``uniform``: every microbatch 1024 tokens. ``text``: lognormal text lengths.
    ``multimodal``: 0-4 images (576 patches each) plus lognormal text; virtual stage 0 is a
    vision encoder that costs by image patches, the other stages are LLM stages that cost
    by total tokens. ``multimodal_paper``: as ``multimodal``, but each image has its own
    size, log-uniform in 4-1280 tokens (patches), the range of the RRFP preprint.

    Raises:
        PlanError: Unknown name or invalid sizes.
    """
    gen = WORKLOADS.get(name)
    if gen is None:
        raise PlanError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if microbatches < 1 or virtual_stages < 1:
        raise PlanError("microbatches and virtual_stages must be >= 1")
    rng = random.Random(seed)
    mbs = gen(microbatches, rng)
    profiles: tuple[StageProfile, ...] = ()
    if name in ("multimodal", "multimodal_paper") and virtual_stages > 1:
        profiles = (VISION_STAGE,)
    cost = CostModel(
        profiles=profiles, jitter=jitter, latency=latency, latency_jitter=latency_jitter
    )
    return Workload(name=name, microbatches=tuple(mbs), cost=cost)
