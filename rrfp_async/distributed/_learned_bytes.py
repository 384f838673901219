"""Activation bytes learned from the run: measured on every rank, exchanged, fitted alike.

Design note
-----------
A byte budget plans a step with each forward's bytes *before* it runs; the executor measures
them only after (``TorchStageExecutor(measure_activations=True).activation_bytes()``, on
the stages of its own rank). Every rank must plan the same hint, so every rank must predict
the same bytes for every stage. ``LearnedBytes`` makes that so:

* after a step, every rank of the pipeline contributes its measured ``[virtual stage]
  [microbatch]`` table (-1 where it ran no forward) to one all-gather of a fixed-size int64
  tensor (V x M values: 8 KiB at 16 x 64; off the step's critical path, after it ended); a
  cell measured by several ranks (the TP ranks of a stage) keeps the largest;
* every rank feeds the same table, with the same microbatch features (``features_of``), to
  its own ``ActivationModel`` in the same order: the fits, so the predictions, are equal
  bit for bit (numpy on the same input), and the plan check has nothing to find;
* a step is planned with ``predict`` once every virtual stage's fit is ``ready``; before
  that, the caller plans with its declared bytes (the first steps).

What stays the caller's: the microbatches' features must be known on every rank (the
microbatches' metadata, ``rr.Microbatch`` sizes, as the lab's loader gives each rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._activation_model import ActivationModel, features_of
from .._check import check_type
from .._memory import ActivationBytes
from .._tasks import StepPlan

__all__ = ["LearnedBytes"]


class LearnedBytes:
    """Per-stage activation bytes fitted to the bytes every rank measured.

    Args:
        group: The process group of one pipeline replica's ranks (every rank that measures
            a stage of it); None: the default group.
        model: The fit (default: a new ``ActivationModel``).
        features: A microbatch's size features (default ``features_of``).
    """

    def __init__(
        self,
        group: Any = None,
        model: ActivationModel | None = None,
        features: Callable[[object], Mapping[str, float]] = features_of,
    ) -> None:
        if model is not None:
            check_type("model", model, ActivationModel, "an ActivationModel")
        self.group = group
        self.model = model if model is not None else ActivationModel()
        self._features = features
        self.steps = 0

    def observe(
        self,
        plan: StepPlan,
        microbatches: Sequence[object],
        measured: Mapping[tuple[int, int], int],
    ) -> None:
        """Exchange this rank's ``measured`` bytes (``{(virtual stage, microbatch): bytes}``)
        with the group's ranks and fit every stage on all of them. A collective: every rank
        of the group calls it after the same step, with the same plan and microbatches."""
        nv, m = plan.num_virtual, plan.microbatches
        table = torch.full((nv, m), -1, dtype=torch.int64)
        for (v, i), b in measured.items():
            table[v, i] = int(b)
        size = dist.get_world_size(self.group)
        parts = [torch.empty_like(table) for _ in range(size)]
        dist.all_gather(parts, table, group=self.group)
        merged = torch.stack(parts).amax(dim=0).tolist()
        feats = [dict(self._features(mb)) for mb in microbatches]
        for v in range(nv):
            for i in range(m):
                if merged[v][i] >= 0:
                    self.model.observe(v, feats[i], merged[v][i])
        self.steps += 1

    def ready(self, plan: StepPlan) -> bool:
        """Whether every virtual stage of ``plan`` has a fit."""
        return all(self.model.ready(v) for v in range(plan.num_virtual))

    def predict(self, plan: StepPlan, microbatches: Sequence[object]) -> ActivationBytes | None:
        """Each forward's predicted bytes for a step of ``microbatches`` (None until every
        stage is ``ready``)."""
        if not self.ready(plan):
            return None
        feats = [dict(self._features(mb)) for mb in microbatches]
        return ActivationBytes(
            [[self.model.predict(v, f) for f in feats] for v in range(plan.num_virtual)]
        )

    def error(self, plan: StepPlan) -> float:
        """The largest relative error of the recent predictions over the stages (NaN
        before any)."""
        errs = [self.model.error(v) for v in range(plan.num_virtual)]
        known = [e for e in errs if e == e]
        return max(known) if known else float("nan")
