"""Workloads: a step's microbatch sizes drawn from a named distribution, with the cost model
that prices them (``make_workload``, ``WORKLOADS``)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ._check import check_int, check_type, describe, is_sequence
from ._costs import VISION_STAGE, CostModel, Microbatch, StageProfile
from ._errors import PlanError

__all__ = [
    "PAPER_IMAGE_TOKENS",
    "PATCHES_PER_IMAGE",
    "WORKLOADS",
    "Workload",
    "WorkloadName",
    "make_workload",
    "multimodal_paper_sizes",
]

WorkloadName: TypeAlias = Literal["uniform", "text", "multimodal", "multimodal_paper"]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A step's microbatches and the cost model that prices them."""

    name: str
    microbatches: tuple[Microbatch, ...]
    cost: CostModel

    def __post_init__(self) -> None:
        check_type("Workload.name", self.name, str, "a string")
        mbs = self.microbatches
        if not is_sequence(mbs):
            raise PlanError(f"Workload.microbatches must be a sequence, got {describe(mbs)}")
        for i, mb in enumerate(mbs):
            check_type(f"Workload.microbatches[{i}]", mb, Microbatch, "a Microbatch")
        object.__setattr__(self, "microbatches", tuple(mbs))
        check_type("Workload.cost", self.cost, CostModel, "a CostModel")


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
    gen = WORKLOADS.get(name) if isinstance(name, str) else None
    if gen is None:
        raise PlanError(f"unknown workload {describe(name)}; choose one of {sorted(WORKLOADS)}")
    microbatches = check_int("microbatches", microbatches, minimum=1)
    virtual_stages = check_int("virtual_stages", virtual_stages, minimum=1)
    seed = check_int("seed", seed)
    rng = random.Random(seed)
    mbs = gen(microbatches, rng)
    profiles: tuple[StageProfile, ...] = ()
    if name in ("multimodal", "multimodal_paper") and virtual_stages > 1:
        profiles = (VISION_STAGE,)
    cost = CostModel(
        profiles=profiles, jitter=jitter, latency=latency, latency_jitter=latency_jitter
    )
    return Workload(name=name, microbatches=tuple(mbs), cost=cost)
