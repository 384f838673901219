"""What the peer benchmark runs: its configuration, its result rows, and the work of each
step (microbatch sizes and emulated durations), computed alike by every process from the seed.

Torch-free: the simulated variant (``_peer_sim``) and the command's validation import
this module without loading torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rrfp_async import Durations, StepPlan, Topology, make_workload

__all__ = [
    "TORCH_SCHEDULES",
    "PeerConfig",
    "PeerRun",
    "Step",
    "WorkerRun",
    "make_steps",
    "resolve_torch_schedule",
    "step_lower_bound",
    "step_plan",
]

TORCH_SCHEDULES: dict[str, tuple[int, str]] = {
    "Schedule1F1B": (1, "interleaved"),
    "ScheduleGPipe": (1, "interleaved"),
    "ScheduleInterleaved1F1B": (2, "interleaved"),
    "ScheduleLoopedBFS": (2, "interleaved"),
    "ScheduleInterleavedZeroBubble": (2, "interleaved"),
    "ScheduleZBVZeroBubble": (2, "vshape"),
    "ScheduleDualPipeV": (2, "vshape"),
}
"""torch schedule class name -> (model chunks per rank, placement of virtual stages)."""


def resolve_torch_schedule(name: str) -> str:
    """The ``TORCH_SCHEDULES`` class name for ``name``: the class name or torch's short name
    (what ``torch.distributed.pipelining.schedules.get_schedule_class`` accepts: ``1F1B``,
    ``GPipe``, ``Interleaved1F1B``, ``ZBVZeroBubble``...), case-insensitive.

    Args:
        name: ``"1F1B"``, ``"schedule1f1b"``, ``"Schedule1F1B"``...

    Returns:
        The class name, e.g. ``"Schedule1F1B"``.

    Raises:
        ValueError: Not a schedule this benchmark runs; the message lists the valid names.
    """
    key = name.strip().lower()
    for cls in TORCH_SCHEDULES:
        if key in (cls.lower(), cls.lower().removeprefix("schedule")):
            return cls
    short = [c.removeprefix("Schedule") for c in TORCH_SCHEDULES]
    raise ValueError(
        f"unknown torch schedule {name!r}; choose from {', '.join(short)} (torch's short"
        " names, any case, or the class names with 'Schedule' in front)"
    )


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """What ``peer_benchmark`` runs.

    Attributes:
        stages: Pipeline ranks (one process each).
        microbatches: Microbatches per step.
        steps: Timed steps per configuration.
        warmup_steps: Untimed steps first (torch infers shapes, threads start).
        us_per_token: Emulated forward µs per token of a rank's model share (backward 2x).
        hidden: Feature width of the activations (sets the message size).
        jitter: Sigma of the lognormal noise on every emulated duration.
        seed: Seed of the microbatch sizes and of the noise.
        torch_schedules: torch schedule class names (``TORCH_SCHEDULES``).
        padded_cost: torch schedules that get a second row charged at the padded length.
        hints: rrfp_async hints; ``interleaved_1f1b`` runs on 2 chunks per rank; ``name:split``
            runs the hint on a split backward (I/W), as ``zb_h1`` always does.
        policies: rrfp_async policies.
        dropin_hints: Hints of the rows that step torch's own ``PipelineStage`` objects
            through ``rr.pipelining.ScheduleReadinessFirst`` (x policies x memory factors);
            empty: none. ``torch:<schedule>`` (``torch:ZBVZeroBubble``) runs torch's order
            as the hint, on that schedule's chunks, placement and backward split: those rows
            are also compared with that torch schedule, step by step
            (``speedup_vs_same_torch``). ``sizes``: the default hint given only the step's
            sizes (``sizes=``: the activation bytes and the tasks' times learned from the
            run), its memory factors a byte budget over 1F1B's measured bytes; ``default``:
            the same with no argument (the sizes read off the microbatches).
        workload: ``"multimodal"``: each microbatch its own length (0-4 images and 8-48 text
            tokens, variable-length work); ``"uniform"``: every microbatch of a step the
            step's mean length (the same total work, no variation).
        memory_factors: Admission bounds as multiples of 1F1B's.
        timeout: Seconds for the whole run.
        meter: Measure every row's activation bytes on every step (the saved-tensor meter,
            on for all rows alike: its hooks cost every forward a Python call per saved
            tensor); False: no bytes are reported.
    """

    stages: int = 4
    microbatches: int = 16
    steps: int = 7
    warmup_steps: int = 1
    us_per_token: float = 2.0
    hidden: int = 32
    jitter: float = 0.3
    seed: int = 0
    torch_schedules: tuple[str, ...] = (
        "Schedule1F1B",
        "ScheduleGPipe",
        "ScheduleInterleaved1F1B",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
    )
    padded_cost: tuple[str, ...] = ("Schedule1F1B",)
    hints: tuple[str, ...] = (
        "1f1b",
        "breadth_first_weighted",
        "breadth_first_weighted:split",
        "zb_h1",
    )
    policies: tuple[str, ...] = ("strict", "readiness_first", "backfill")
    dropin_hints: tuple[str, ...] = ("breadth_first_weighted",)
    memory_factors: tuple[float, ...] = (1.0, 2.0)
    timeout: float = 1200.0
    workload: str = "multimodal"
    meter: bool = True

    def __post_init__(self) -> None:
        if self.stages < 2 or self.microbatches < 1 or self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("need stages >= 2, microbatches >= 1, steps >= 1, warmup >= 0")
        if not (math.isfinite(self.us_per_token) and self.us_per_token > 0):
            raise ValueError(f"us_per_token must be > 0, got {self.us_per_token!r}")
        for s in self.torch_schedules + self.padded_cost:
            if s not in TORCH_SCHEDULES:
                raise ValueError(
                    f"unknown torch schedule {s!r}; choose from {list(TORCH_SCHEDULES)}"
                )
        if self.workload not in ("multimodal", "uniform"):
            raise ValueError(f"workload must be 'multimodal' or 'uniform', got {self.workload!r}")
        for h in self.dropin_hints:
            if h.startswith("torch:"):
                resolve_torch_schedule(h.removeprefix("torch:"))


@dataclass(frozen=True, kw_only=True)
class PeerRun:
    """One configuration's result (the fields of ``--json``'s runs).

    The bytes (``PeerConfig.meter``; None and NaN without it) are measured activation bytes:
    ``peak_bytes_per_rank`` is each rank's most held in any timed step, ``peak_bytes`` the
    largest of them; ``bytes_vs_torch_1f1b`` is ``peak_bytes`` / torch ``Schedule1F1B``'s
    (per rank: ``bytes_vs_torch_1f1b_per_rank``). torch holds its padded inputs;
    ``real_bytes`` (torch rows) is what the row's own order holds on the real lengths (its
    recorded order replayed on an rrfp_async row's measured bytes of the same step: of the
    same placement, else of one chunk by stage position), and ``bytes_vs_torch_1f1b_real``
    the row's bytes on the real lengths (a torch row's ``real_bytes``, an rrfp_async row's
    ``peak_bytes``) / torch 1F1B's ``real_bytes``. A row of ``c`` model chunks per rank
    counts ``1/c`` of what its modules measured (``measured_peak_bytes_per_rank``): each
    virtual stage is the one-chunk row's module, standing for ``1/c`` of the rank's model
    (its emulated time is ``1/c``).
    """

    system: str
    schedule: str | None
    hint: str | None
    policy: str | None
    memory_factor: float | None
    step_s: float
    speedup_vs_torch_1f1b: float
    efficiency: float
    speedup_vs_same_torch: float = math.nan
    peak_inflight: int
    steps_s: tuple[float, ...] = field(default=())
    note: str = ""
    peak_bytes: int | None = None
    peak_bytes_per_rank: tuple[int, ...] = ()
    bytes_vs_torch_1f1b: float = math.nan
    bytes_vs_torch_1f1b_per_rank: tuple[float, ...] = ()
    measured_peak_bytes_per_rank: tuple[int, ...] = ()
    real_bytes: int | None = None
    real_bytes_per_rank: tuple[int, ...] = ()
    bytes_vs_torch_1f1b_real: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """The JSON row."""
        return {
            "system": self.system,
            "schedule": self.schedule,
            "hint": self.hint,
            "policy": self.policy,
            "memory_factor": self.memory_factor,
            "step_s": self.step_s,
            "speedup_vs_torch_1f1b": self.speedup_vs_torch_1f1b,
            "speedup_vs_same_torch": self.speedup_vs_same_torch,
            "efficiency": self.efficiency,
            "peak_inflight": self.peak_inflight,
            "peak_bytes": self.peak_bytes,
            "peak_bytes_per_rank": list(self.peak_bytes_per_rank),
            "bytes_vs_torch_1f1b": self.bytes_vs_torch_1f1b,
            "bytes_vs_torch_1f1b_per_rank": list(self.bytes_vs_torch_1f1b_per_rank),
            "measured_peak_bytes_per_rank": list(self.measured_peak_bytes_per_rank),
            "real_bytes": self.real_bytes,
            "real_bytes_per_rank": list(self.real_bytes_per_rank),
            "bytes_vs_torch_1f1b_real": self.bytes_vs_torch_1f1b_real,
            "steps_s": list(self.steps_s),
            "note": self.note,
        }


@dataclass(frozen=True)
class Step:
    tokens: tuple[int, ...]
    # [chunks][vstage][mb] forward/backward seconds for V = 1 and V = 2
    forward: dict[int, list[list[float]]]
    backward: dict[int, list[list[float]]]


def make_steps(cfg: PeerConfig) -> list[Step]:
    out = []
    total = cfg.warmup_steps + cfg.steps
    for s in range(total):
        wl = make_workload("multimodal", cfg.microbatches, virtual_stages=1, seed=cfg.seed + s)
        tokens = tuple(mb.tokens for mb in wl.microbatches)
        if cfg.workload == "uniform":
            tokens = (round(sum(tokens) / len(tokens)),) * len(tokens)
        rng = random.Random(hash((cfg.seed, s, "noise")) & 0xFFFFFFFF)
        fw: dict[int, list[list[float]]] = {}
        bw: dict[int, list[list[float]]] = {}
        for v in (1, 2):
            nv = cfg.stages * v
            per = cfg.us_per_token * 1e-6 / v
            fw[v] = [[per * t * _noise(rng, cfg.jitter) for t in tokens] for _ in range(nv)]
            bw[v] = [[2 * per * t * _noise(rng, cfg.jitter) for t in tokens] for _ in range(nv)]
        out.append(Step(tokens, fw, bw))
    return out


def _noise(rng: random.Random, sigma: float) -> float:
    return math.exp(rng.gauss(0.0, sigma) - 0.5 * sigma * sigma) if sigma > 0 else 1.0


def step_plan(cfg: PeerConfig, chunks: int, placement: str, split: bool) -> StepPlan:
    topo = Topology(stages=cfg.stages, chunks=chunks, placement=placement)  # type: ignore[arg-type]
    return StepPlan(topology=topo, microbatches=cfg.microbatches, split_backward=split)


def step_lower_bound(cfg: PeerConfig, st: Step, chunks: int, placement: str, split: bool) -> float:
    from rrfp_async.sim import lower_bound

    plan = step_plan(cfg, chunks, placement, split)
    return lower_bound(plan, Durations.from_arrays(plan, st.forward[chunks], st.backward[chunks]))


@dataclass(eq=False)
class WorkerRun:
    """One configuration in a worker: what it runs and what it measured."""

    key: tuple[Any, ...]
    chunks: int
    placement: str
    fn: Callable[[int], float] | None
    split: bool = False
    error: str = ""
    peak: int = 0
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # This rank's measured peak activation bytes per step (empty without the meter); each
    # step's measured ``(virtual stage, microbatch, bytes)`` (an rrfp_async run: the real
    # lengths) and, for a torch run, each step's order (``LiveBytes.order``).
    peak_bytes: list[int] = field(default_factory=list)
    step_bytes: list[list[tuple[int, int, int]]] = field(default_factory=list)
    orders: list[list[tuple[int, int, int]]] = field(default_factory=list)
