"""What a stage reports about a step: the tasks as they ran and the step's statistics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._memory import held_peak
from .._tasks import Task

__all__ = ["ExecutedTask", "StepStats"]


class ExecutedTask(NamedTuple):
    """A task as it ran: ``task`` from ``start`` to ``end`` (seconds on the stage clock)."""

    task: Task
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one stage did in one step.

    Attributes:
        rank: The pipeline rank.
        step: The step number.
        policy: The policy's name.
        hint: The hint's name.
        started: Clock when the step started on this stage.
        finished: Clock when the stage's last task finished.
        executed: Tasks in execution order with start/end times.
        peak_inflight: Most activations held at once.
        max_inflight: The admission bound (a count; with a byte budget, the count the hint
            itself reaches).
        decisions: Number of dispatch decisions (= tasks).
        deviations: Decisions that ran a task other than the next hinted one.
        tp_deduced: On a TP follower, decisions it deduced instead of waiting for the
            leader's (``StageLoop(deduce_tp=)``); 0 elsewhere.
        losses: On the rank of the last virtual stage, each microbatch's loss (what the
            loss function returned, unscaled) in microbatch order, when the executor
            reports them (``TorchStageExecutor``); else None.
        outputs: On that rank, the last stage's outputs in microbatch order (detached),
            for forward-only steps and when the executor keeps them; else None.
        peak_bytes: With a byte budget (``StepSchedule.build(activation_bytes=...)``), the
            most activation bytes held at once, as the schedule's bytes count them; else
            None.
        budget_bytes: That budget; else None.
        reference_bytes: What the fixed order the default budget is taken from (1F1B,
            or the hint itself when it is a fixed order) holds on this rank run strictly on
            the same bytes; else None. ``peak_bytes / reference_bytes`` is the memory ratio.
    """

    rank: int
    step: int
    policy: str
    hint: str
    started: float
    finished: float
    executed: tuple[ExecutedTask, ...]
    peak_inflight: int
    max_inflight: int
    decisions: int
    deviations: int
    tp_deduced: int = 0
    losses: tuple[float, ...] | None = None
    outputs: tuple[Any, ...] | None = None
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    reference_bytes: int | None = None

    def held_peak(self, nbytes: Mapping[tuple[int, int], int]) -> int:
        """The most of ``nbytes`` (``{(virtual stage, microbatch): bytes}``, e.g. the measured
        ``TorchStageExecutor.activation_bytes()``) this stage held at once in this step, in
        the order it ran: a forward's bytes from its start to the end of the backward that
        frees them."""
        return held_peak(self.executed, nbytes)

    @property
    def busy(self) -> float:
        """Seconds spent running tasks."""
        return sum(e.end - e.start for e in self.executed)

    @property
    def elapsed(self) -> float:
        """Seconds from step start to the stage's last task end."""
        return self.finished - self.started

    @property
    def idle(self) -> float:
        """Seconds of the step the stage was not running a task."""
        return self.elapsed - self.busy
