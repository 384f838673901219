"""``bench paper``'s inputs: the variability levels, the scenarios (pipeline size, workload,
noise) and the configurations (hint, policy, memory, chunks, split, order) it runs.

The main grid (``default_scenarios`` x ``default_configs``) and the condition search
(``condition_scenarios`` x ``condition_configs``); what a run of them means is in
``_paper``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rrfp_async._workloads import PAPER_IMAGE_TOKENS

__all__ = [
    "BASELINE",
    "CLAIRVOYANT",
    "NOISE",
    "PAPER_FIGURES",
    "POLICIES",
    "Config",
    "Noise",
    "Scenario",
    "condition_configs",
    "condition_scenarios",
    "default_configs",
    "default_scenarios",
]

PAPER_FIGURES = {"text": 1.77, "multimodal": 2.77}
"""The preprint's best speedups over fixed-order 1F1B (up to 128 GPUs, BFW hint)."""

CLAIRVOYANT = "clairvoyant"
"""The policy name of the perfect-foresight reference rows."""


@dataclass(frozen=True, kw_only=True)
class Noise:
    """Runtime variability of a scenario (see ``CostModel``)."""

    name: str
    jitter: float
    straggler_prob: float
    straggler_factor: float = 3.0
    latency: float = 0.0
    latency_jitter: float = 0.0


NOISE = {
    "none": Noise(name="none", jitter=0.0, straggler_prob=0.0),
    "mild": Noise(name="mild", jitter=0.2, straggler_prob=0.02, latency=5e-5, latency_jitter=0.3),
    "heavy": Noise(name="heavy", jitter=0.5, straggler_prob=0.05, latency=1e-4, latency_jitter=0.8),
    "stragglers": Noise(
        name="stragglers",
        jitter=0.5,
        straggler_prob=0.10,
        straggler_factor=5.0,
        latency=1e-4,
        latency_jitter=0.8,
    ),
}
"""``none``: declared = realized. ``mild``: compute jitter sigma 0.2, 2 % stragglers at 3x,
50 µs messages (latency sigma 0.3). ``heavy``: sigma 0.5, 5 % stragglers at 3x, 100 µs
messages (sigma 0.8). ``stragglers``: as heavy with 10 % stragglers at 5x."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One point of the grid: pipeline size, workload, variability and cost knobs.

    Attributes:
        pp: Pipeline ranks P.
        tp: Tensor-parallel degree (compute / TP; GPUs = PP x TP).
        microbatches: M (one sample per microbatch).
        workload: ``"text"``, ``"multimodal"`` or ``"multimodal_paper"``.
        noise: The variability.
        vision_scale: Multiplier of the vision encoder's cost (a heavier encoder).
        image_tokens: ``multimodal_paper``'s image-size range (log-uniform).
        text_sigma: Sigma of the lognormal text lengths (None: the workload's own).
        label: A name for the condition the scenario probes.
    """

    pp: int
    tp: int = 8
    microbatches: int
    workload: str
    noise: Noise = field(default_factory=lambda: NOISE["heavy"])
    vision_scale: float = 1.0
    image_tokens: tuple[int, int] = PAPER_IMAGE_TOKENS
    text_sigma: float | None = None
    label: str = ""

    @property
    def gpus(self) -> int:
        """PP x TP."""
        return self.pp * self.tp

    @property
    def multimodal(self) -> bool:
        """Whether virtual stage 0 is a vision encoder."""
        return self.workload.startswith("multimodal")


@dataclass(frozen=True, kw_only=True)
class Config:
    """One schedule: hint, dispatch policy, admission memory (x the default bound; ``inf``
    unbounded), chunks per rank, split backward, and the order in which the loader's
    microbatches enter (``"loader"``; ``"sorted"``: ascending declared cost, the
    sorted-by-cost idea of the first scheduling model)."""

    hint: str
    policy: str
    memory: float = 1.0
    chunks: int = 1
    split: bool = False
    order: str = "loader"

    @property
    def schedule(self) -> str:
        """The hint with its variant marks, e.g. ``bfw+split``, ``1f1b sorted``."""
        s = self.hint + ("+split" if self.split and self.hint != "zb_h1" else "")
        if self.chunks > 1:
            s += f" V={self.chunks}"
        if self.order != "loader":
            s += f" {self.order}"
        return s


BASELINE = Config(hint="1f1b", policy="strict")
"""Strict 1F1B at the 1F1B bound, loader order, full backward: every ratio's reference."""

POLICIES = ("strict", "readiness_first", "lateness_aware", "backfill")


def default_configs(*, policies: Sequence[str] = POLICIES) -> list[Config]:
    """The main table's configurations.

    Every policy at 1x and 2x memory for ``1f1b``, ``zb_h1``, ``bfw``, ``bfw+split`` and
    ``interleaved_1f1b`` (V = 2); ``strict`` only at 1x (a fixed order cannot use
    admission room: it runs identically at 2x). Decomposition rows: ``1f1b+split`` (the
    split backward alone), ``backward_first+split`` (a third reading of "BFW": priority
    B > F > W), ``1f1b sorted`` and ``zb_h1 sorted`` (the loader's microbatches sorted by
    ascending cost), ``bfw+split`` at 4x memory, and the two clairvoyant references.
    """
    out = [BASELINE]
    full: list[tuple[str, int, bool]] = [
        ("1f1b", 1, False),
        ("zb_h1", 1, True),
        ("bfw", 1, False),
        ("bfw", 1, True),
        ("interleaved_1f1b", 2, False),
    ]
    for hint, chunks, split in full:
        for pol in policies:
            for mf in (1.0, 2.0):
                if pol == "strict" and mf != 1.0:
                    continue
                c = Config(hint=hint, policy=pol, memory=mf, chunks=chunks, split=split)
                if c not in out:
                    out.append(c)
    out += [
        Config(hint="bfw", policy="readiness_first", memory=4.0, split=True),
        Config(hint="1f1b", policy="strict", split=True),
        Config(hint="1f1b", policy="readiness_first", memory=2.0, split=True),
        Config(hint="backward_first", policy="strict", split=True),
        Config(hint="backward_first", policy="readiness_first", memory=2.0, split=True),
        Config(hint="1f1b", policy="strict", order="sorted"),
        Config(hint="1f1b", policy="readiness_first", memory=2.0, order="sorted"),
        Config(hint="zb_h1", policy="readiness_first", memory=2.0, split=True, order="sorted"),
        Config(hint="bfw", policy=CLAIRVOYANT, memory=2.0, split=True),
        Config(hint="bfw", policy=CLAIRVOYANT, memory=math.inf, split=True),
    ]
    return out


def condition_configs() -> list[Config]:
    """The few configurations the condition search runs: the baseline, readiness alone
    (2x memory), the cost-aware hint with a split backward run strictly, the strongest
    runtime combinations, and the clairvoyant references."""
    return [
        BASELINE,
        Config(hint="1f1b", policy="readiness_first", memory=2.0),
        Config(hint="bfw", policy="strict", split=True),
        Config(hint="bfw", policy="readiness_first", memory=2.0, split=True),
        Config(hint="bfw", policy="readiness_first", memory=4.0, split=True),
        Config(hint="zb_h1", policy="readiness_first", memory=2.0, split=True, order="sorted"),
        Config(hint="bfw", policy=CLAIRVOYANT, memory=2.0, split=True),
        Config(hint="bfw", policy=CLAIRVOYANT, memory=math.inf, split=True),
    ]


def default_scenarios(*, full: bool = False) -> list[Scenario]:
    """The main grid, TP = 8 throughout (PP = 16 x TP = 8 = 128 GPUs).

    Default (about 2.5 minutes on this 2-core machine; the condition search adds 1.5):
    (PP, M) in (4, 32), (8, 64), (16, 128), text and multimodal_paper, heavy variability.
    ``full`` (about 16 minutes): PP in 4, 8, 16 x M in 32, 64, 128, both workloads, mild
    and heavy variability.
    """
    if full:
        return [
            Scenario(pp=pp, microbatches=m, workload=wl, noise=NOISE[nz])
            for wl in ("text", "multimodal_paper")
            for nz in ("mild", "heavy")
            for pp in (4, 8, 16)
            for m in (32, 64, 128)
        ]
    return [
        Scenario(pp=pp, microbatches=m, workload=wl)
        for wl in ("text", "multimodal_paper")
        for pp, m in ((4, 32), (8, 64), (16, 128))
    ]


def condition_scenarios() -> list[Scenario]:
    """The search for the paper's 2.77x: one knob at a time away from multimodal_paper at
    PP = 16 x TP = 8, M = 128, heavy variability, then the combinations that reach it."""
    mm = "multimodal_paper"
    return [
        Scenario(pp=16, microbatches=128, workload=mm, label="reference"),
        Scenario(pp=16, microbatches=128, workload=mm, noise=NOISE["none"], label="no noise"),
        Scenario(
            pp=16,
            microbatches=128,
            workload=mm,
            noise=NOISE["stragglers"],
            label="10 % stragglers at 5x",
        ),
        Scenario(pp=16, microbatches=32, workload=mm, label="M = 32 (PP large vs M)"),
        Scenario(pp=32, tp=4, microbatches=128, workload=mm, label="PP = 32 x TP = 4"),
        Scenario(pp=16, microbatches=128, workload=mm, vision_scale=4.0, label="4x vision encoder"),
        Scenario(
            pp=16,
            microbatches=128,
            workload=mm,
            image_tokens=(4, 4096),
            label="images 4-4096 tokens",
        ),
        Scenario(pp=16, microbatches=128, workload="text", text_sigma=1.0, label="text sigma 1.0"),
        Scenario(
            pp=16,
            microbatches=256,
            workload=mm,
            image_tokens=(4, 4096),
            label="images 4-4096, M = 256",
        ),
        Scenario(
            pp=16,
            microbatches=256,
            workload="text",
            text_sigma=1.0,
            label="text sigma 1.0, M = 256",
        ),
    ]
