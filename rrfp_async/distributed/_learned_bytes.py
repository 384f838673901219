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

``LearnedDurations`` does the same for the tasks' seconds (what each forward and backward
took on its rank, ``StepStats.executed``), so that a cost-aware hint needs no declared cost
model: one all-gather of ``[2][V][M]`` microseconds after a step, two fits per stage
(forward; backward, ``I`` + ``W`` when split). Measured times are noisy (host load, the
device's own jitter): the fit is a least-squares average, and its ``error`` says how far
the last predictions were off.

Both rely on every rank computing the same fit from the same table: the same numpy on the
same input gives the same floats, and the predictions are rounded (whole bytes, whole
microseconds) before they plan anything. Ranks on different numeric libraries could still
disagree on a value at a rounding boundary; the plan digest compares only the base plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._activation_model import ActivationModel, FeatureFn, features_of
from .._check import check_type
from .._costs import Durations
from .._memory import ActivationBytes, RanTask
from .._tasks import StepPlan

__all__ = ["LearnedBytes", "LearnedDurations"]


def _gathered(group: Any, table: torch.Tensor) -> list[Any]:
    """Every rank's ``table`` (-1 where it measured nothing) merged: the largest value of
    each cell (one all-gather on ``group``), as nested lists."""
    parts = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, table, group=group)
    merged: list[Any] = torch.stack(parts).amax(dim=0).tolist()
    return merged


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
        merged = _gathered(self.group, table)
        feats = [dict(self._features(mb)) for mb in microbatches]
        for v in range(nv):
            self.model.observe_many(
                v, [(feats[i], merged[v][i]) for i in range(m) if merged[v][i] >= 0]
            )
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
        return ActivationBytes([self.model.predict_many(v, feats) for v in range(plan.num_virtual)])

    def error(self, plan: StepPlan) -> float:
        """The largest relative error of the recent predictions over the stages (NaN
        before any)."""
        errs = [self.model.error(v) for v in range(plan.num_virtual)]
        known = [e for e in errs if e == e]
        return max(known) if known else float("nan")


class LearnedDurations:
    """Per-stage forward and backward seconds fitted to the task times every rank measured.

    Args:
        group: The process group of one pipeline replica's ranks; None: the default group.
        features: A microbatch's size features (default ``features_of``).
        extra_features: Extra columns of both fits (``ActivationModel``'s).
    """

    def __init__(
        self,
        group: Any = None,
        features: Callable[[object], Mapping[str, float]] = features_of,
        extra_features: Mapping[str, FeatureFn] | None = None,
    ) -> None:
        self.group = group
        self.forward = ActivationModel(extra_features=extra_features)
        self.backward = ActivationModel(extra_features=extra_features)
        self._features = features
        self.steps = 0

    def observe(
        self, plan: StepPlan, microbatches: Sequence[object], executed: Sequence[RanTask]
    ) -> None:
        """Exchange the times of this rank's tasks of a step (``StepStats.executed``) with
        the group's ranks and fit every stage on all of them (a collective, as
        ``LearnedBytes.observe``)."""
        nv, m = plan.num_virtual, plan.microbatches
        table = torch.full((2, nv, m), -1, dtype=torch.int64)
        for e in executed:
            t = e.task
            us = max(0, round((e.end - e.start) * 1e6))
            if t.kind == "F":
                table[0, t.stage, t.mb] = us
            else:  # B, or I + W when the backward is split
                cur = int(table[1, t.stage, t.mb])
                table[1, t.stage, t.mb] = us if cur < 0 else cur + us
        merged = _gathered(self.group, table)
        feats = [dict(self._features(mb)) for mb in microbatches]
        for kind, model in ((0, self.forward), (1, self.backward)):
            for v in range(nv):
                row = merged[kind][v]
                model.observe_many(v, [(feats[i], row[i]) for i in range(m) if row[i] >= 0])
        self.steps += 1

    def ready(self, plan: StepPlan) -> bool:
        """Whether every virtual stage of ``plan`` has both fits."""
        return all(
            self.forward.ready(v) and self.backward.ready(v) for v in range(plan.num_virtual)
        )

    def predict(self, plan: StepPlan, microbatches: Sequence[object]) -> Durations | None:
        """The predicted durations of a step of ``microbatches`` (None until ``ready``):
        whole microseconds, so that every rank plans with the same numbers."""
        if not self.ready(plan):
            return None
        feats = [dict(self._features(mb)) for mb in microbatches]
        nv = plan.num_virtual
        fw = [[round(x) * 1e-6 for x in self.forward.predict_many(v, feats)] for v in range(nv)]
        bw = [[round(x) * 1e-6 for x in self.backward.predict_many(v, feats)] for v in range(nv)]
        return Durations.from_arrays(plan, fw, bw)

    def error(self, plan: StepPlan) -> float:
        """The largest relative error of the recent predictions (forward and backward, every
        stage; NaN before any)."""
        errs = [
            model.error(v)
            for model in (self.forward, self.backward)
            for v in range(plan.num_virtual)
        ]
        known = [e for e in errs if e == e]
        return max(known) if known else float("nan")
