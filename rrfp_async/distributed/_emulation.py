"""Emulated GPU time for CPU runs: ``EmulatedCost``, what a ``TorchStageExecutor`` sleeps.

On a CPU, after a task's real computation, the executor's worker thread sleeps for the
duration a declared cost model gives the task (per token, per image patch, backward = 2x
forward, with seeded jitter), like a host waiting for a GPU kernel. The realized durations
of a step are drawn once, when the step begins (``EmulatedCost.durations``), from a seed of
the step (and of the rank, with ``per_rank_noise``), so every policy of a comparison meets
the same noise. Reports of runs that use it must say so (``DistributedStage`` marks its
trace files ``emulated_gpu_time`` when the executor emulates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._costs import CostModel, Durations, Microbatch
from .._errors import PlanError
from .._tasks import StepPlan

__all__ = ["EmulatedCost"]


@dataclass(frozen=True, kw_only=True)
class EmulatedCost:
    """Emulated GPU time for CPU runs: each task also sleeps for its cost-model duration.

    Attributes:
        cost: The declared cost model (per token / per patch, backward factor, jitter).
        seed: Seed of the realized jitter; combined with the step number.
        per_rank_noise: Draw the jitter per process (TP ranks then see different timings,
            which is how divergence is provoked in tests), else per step only.
        scale: Multiply every emulated duration (e.g. 0.1 for quick tests).
    """

    cost: CostModel
    seed: int = 0
    per_rank_noise: bool = False
    scale: float = 1.0

    def durations(
        self, plan: StepPlan, microbatches: Sequence[Any], step: int, rank: int
    ) -> Durations:
        """The realized emulated durations of ``step`` (Microbatch sizes required)."""
        if not all(isinstance(m, Microbatch) for m in microbatches):
            raise PlanError("EmulatedCost needs rrfp_async.Microbatch objects (with sizes)")
        seed = hash((self.seed, step, rank if self.per_rank_noise else -1)) & 0xFFFFFFFF
        return self.cost.realize(plan, microbatches, seed=seed)
