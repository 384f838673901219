"""What a simulated step gives back (``SimResult``), and the bytes it held."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import PlanError
from .._memory import ActivationBytes, weighted_peak
from .._memory import held_peak as memory_held_peak
from .._tasks import StepPlan
from ..loop import ExecutedTask, StepStats
from ..observability import TraceData, chrome_trace
from ..policies import StepSchedule, reference_orders
from ._sim_tp import TPDecision

__all__ = ["SimResult", "held_peak", "reference_peaks"]


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """The outcome of one simulated step.

    Attributes:
        makespan: Seconds from the step's start to its last task's end.
        lower_bound: A bound no schedule can beat: the largest of the critical path and,
            over ranks, the rank's busy time plus its unavoidable fill and drain.
        efficiency: ``lower_bound / makespan`` (1.0 is optimal).
        peak_inflight: Per rank, most activations held at once.
        max_inflight: Per rank, the admission bound.
        executed: Per rank, tasks in execution order with start/end times.
        deviations: Per rank, decisions that ran a task other than the next hinted one.
        hint: The hint's name.
        policy: The policy's name.
        stats: Per rank, the stage's full ``StepStats``.
        wall_time: Real seconds the simulation took.
        schedule: The schedule that ran.
        trace: The trace recording, with ``simulate(record=True)``.
        seed: The seed of the sizes and the noise (drawn afresh for ``seed=None``): pass it
            back to ``simulate`` to repeat this step exactly.
        tp: The TP degree simulated (1: no TP coordination).
        tp_latency: Seconds each TP decision took to reach the followers (0: free).
        tp_check: Seconds the end-of-step TP check added (included in ``makespan``).
        peak_bytes: Per rank, the most activation bytes held at once in the run (the
            simulator's bytes: each microbatch's tokens on every virtual stage, or the
            ``activation_bytes`` given).
        reference_bytes: Per rank, what strict 1F1B (interleaved 1F1B with chunks) would
            hold on the same microbatches: ``peak_bytes`` over it is the memory ratio.
        budget_bytes: Per rank, the byte budget the run was admitted under (None when a
            count bound, ``max_inflight`` / ``memory_factor``, was used).
        tp_decisions: Per rank, with ``tp_latency > 0``: each task's decision time and the
            time its TP group started it (``TPDecision``), in execution order.
    """

    makespan: float
    lower_bound: float
    efficiency: float
    peak_inflight: tuple[int, ...]
    max_inflight: tuple[int, ...]
    executed: tuple[tuple[ExecutedTask, ...], ...]
    deviations: tuple[int, ...]
    hint: str
    policy: str
    stats: tuple[StepStats, ...] = field(repr=False)
    wall_time: float = 0.0
    schedule: StepSchedule | None = field(default=None, repr=False)
    trace: TraceData | None = field(default=None, repr=False)
    seed: int = 0
    tp: int = 1
    tp_latency: float = 0.0
    tp_check: float = 0.0
    tp_decisions: tuple[tuple[TPDecision, ...], ...] | None = field(default=None, repr=False)
    peak_bytes: tuple[int, ...] = ()
    reference_bytes: tuple[int, ...] = ()
    budget_bytes: tuple[int, ...] | None = None

    @property
    def memory_ratio(self) -> float:
        """The largest, over ranks, of ``peak_bytes / reference_bytes``: 1.0 or below is
        "the same memory" as strict 1F1B on these microbatches."""
        return max(
            (p / r for p, r in zip(self.peak_bytes, self.reference_bytes, strict=True) if r),
            default=1.0,
        )

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome-trace / Perfetto JSON of this step (needs ``simulate(record=True)``).

        Raises:
            PlanError: The step was simulated without ``record=True`` (a ``ValueError``).
        """
        if self.trace is None:
            raise PlanError("simulate(..., record=True) keeps the trace this needs")
        return chrome_trace(
            self.trace,
            clock="virtual",
            policy=self.policy,
            hint=self.hint,
            title="simulated step (virtual time, declared cost model)",
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (without the per-task spans)."""
        return {
            "hint": self.hint,
            "policy": self.policy,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "efficiency": self.efficiency,
            "peak_inflight": list(self.peak_inflight),
            "max_inflight": list(self.max_inflight),
            "deviations": list(self.deviations),
            "wall_time": self.wall_time,
            "seed": self.seed,
            "tp": self.tp,
            "tp_latency": self.tp_latency,
            "tp_check": self.tp_check,
            "peak_bytes": list(self.peak_bytes),
            "reference_bytes": list(self.reference_bytes),
            "budget_bytes": None if self.budget_bytes is None else list(self.budget_bytes),
            "memory_ratio": self.memory_ratio,
        }


def held_peak(executed: Sequence[ExecutedTask], nbytes: ActivationBytes) -> int:
    """The most bytes a rank held in a run (``_memory.held_peak`` on ``nbytes``)."""
    rows = nbytes.rows()
    sizes = {(v, i): x for v, row in enumerate(rows) for i, x in enumerate(row)}
    return memory_held_peak(executed, sizes)


def reference_peaks(plan: StepPlan, nbytes: ActivationBytes) -> list[int]:
    """What strict 1F1B (interleaved 1F1B with chunks) holds on each rank on ``nbytes``."""
    ref = reference_orders(plan)
    return [weighted_peak(ref[r], nbytes) for r in range(plan.stages)]
