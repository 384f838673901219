"""Non-finite values reported: a NaN or an infinity in a loss, an activation or a gradient
of a task, named with its rank, step, task and microbatch.

``TorchStageExecutor(nonfinite=..., check_tensors=...)`` holds one ``FiniteCheck``:

* **losses** are checked by default (``nonfinite="warn"``): on a CPU the executor reads each
  microbatch's loss anyway, so the check is free; on CUDA the losses are read once per step
  (``TorchStageExecutor.losses``) and checked there, with no host sync per task.
* **activations and gradients** (every floating tensor a task sends on: F's output, B's
  and I's input gradients) with ``check_tensors=True``: one ``isfinite`` reduction per
  tensor. Opt-in, because on a GPU its result must reach the host (a sync per task), and
  on a CPU it is a pass over each tensor (its cost: docs/reliability.md).

``"warn"`` logs a warning (logger ``rrfp_async``) and keeps the record in
``TorchStageExecutor.nonfinite_events`` (this step's); ``"raise"`` raises
``NonFiniteError`` from the task, so the step fails on every rank like any task error
(each peer's ``PeerStepError`` names it); ``"off"`` checks nothing.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._errors import NonFiniteError, PlanError
from .._pytree import tensor_leaves
from .._tasks import Task

__all__ = ["FiniteCheck", "NonFinite", "NonFiniteMode"]

_log = logging.getLogger("rrfp_async")

NonFiniteMode = Literal["off", "warn", "raise"]
"""What a non-finite loss, activation or gradient gets: nothing, a warning, an error."""

_WHAT = {"F": "activation", "B": "input gradient", "I": "input gradient"}


@dataclass(frozen=True)
class NonFinite:
    """One non-finite value found in a step.

    Attributes:
        rank: Global rank of the executor.
        step: The step number.
        task: The task (``"1F3"``: virtual stage 1's forward of microbatch 3).
        microbatch: Its microbatch.
        what: ``"loss"``, ``"activation"`` or ``"input gradient"``.
        detail: The value (a loss) or which leaves of the output and how many bad values.
    """

    rank: int
    step: int
    task: str
    microbatch: int
    what: str
    detail: str

    def __str__(self) -> str:
        return (
            f"rank {self.rank} step {self.step} {self.task}: non-finite {self.what} in"
            f" microbatch {self.microbatch} ({self.detail})"
        )


class FiniteCheck:
    """The checks of one executor (see the module docstring)."""

    def __init__(self, mode: NonFiniteMode, tensors: bool, rank: int) -> None:
        if mode not in ("off", "warn", "raise"):
            raise PlanError(f"nonfinite must be 'off', 'warn' or 'raise', got {mode!r}")
        if not isinstance(tensors, bool):
            raise PlanError(f"check_tensors must be a bool, got {tensors!r}")
        self.mode = mode
        self.tensors = tensors and mode != "off"
        self.rank = rank
        self.events: list[NonFinite] = []
        self.seconds = 0.0  # spent in the tensor checks (what check_tensors costs)

    def begin_step(self) -> None:
        self.events = []

    def loss(self, step: int, task: Task, value: float, *, late: bool = False) -> None:
        """A microbatch's loss, read on the host. ``late``: read after its step (CUDA
        losses, read once per step): too late to fail the step, so it is warned even under
        ``"raise"``."""
        if self.mode != "off" and not math.isfinite(value):
            event = NonFinite(self.rank, step, str(task), task.mb, "loss", f"{value}")
            self._found(event, warn_only=late)

    def output(self, step: int, task: Task, out: Any) -> None:
        """What ``task`` sends on (``check_tensors``)."""
        if not self.tensors or out is None or task.kind not in _WHAT:
            return
        bad = []
        t0 = time.perf_counter()
        for i, t in enumerate(tensor_leaves(out)):
            if t.is_floating_point() or t.is_complex():
                ok = torch.isfinite(t)
                if not bool(ok.all()):
                    bad.append(f"leaf {i} of shape {tuple(t.shape)}: {int((~ok).sum())} values")
        self.seconds += time.perf_counter() - t0
        if bad:
            what = _WHAT[task.kind]
            self._found(NonFinite(self.rank, step, str(task), task.mb, what, "; ".join(bad)))

    def _found(self, event: NonFinite, *, warn_only: bool = False) -> None:
        self.events.append(event)
        if self.mode == "raise" and not warn_only:
            raise NonFiniteError(
                f"{event}; TorchStageExecutor(nonfinite='raise') fails the step on every rank"
            )
        _log.warning("%s", event)
