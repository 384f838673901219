"""``DistributedStage``'s gradients across ranks: the tied parameters' reduction at the end
of each training step (the ties themselves: ``_ties``), the device order after a step, and
the data-parallel all-reduce (``allreduce_gradients``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from ..loop import TiedExecutor
from ..policies import StepSchedule
from ._executor_hooks import ModulesExecutor, StreamOrderingExecutor
from ._stage_fields import StageFields
from ._ties import find_undeclared_ties, reduce_ties, tie_groups

__all__ = ["GradientSync"]


class GradientSync(StageFields):
    """``DistributedStage``'s tied and data-parallel reductions (a part: see
    ``_stage_fields``)."""

    async def _prepare_ties(self, schedule: StepSchedule, step: int) -> None:
        """Before the first training step: look for undeclared ties (collective over the
        control group), then build the declared ties' groups (see ``_ties``)."""
        ex = self.stage.executor
        modules = ex.modules if isinstance(ex, ModulesExecutor) else None
        if self.check_ties and isinstance(modules, Mapping):
            await find_undeclared_ties(
                modules,
                self._tie_spec,
                self.layout,
                self.groups.control,
                timeout=self.step_timeout,
                who=f"{self._who()} step {step}",
            )
        if self._tie_spec:
            self._tie_groups = tie_groups(self._tie_spec, self.layout, schedule.plan.topology)
        self._ties_checked = True

    def _shared_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """The executor's tied parameters on this rank (``shared_parameters()``)."""
        ex = self.stage.executor
        if not isinstance(ex, TiedExecutor):
            return {}
        return {name: list(params) for name, params in ex.shared_parameters().items()}

    async def _reduce_ties(self, step: int) -> None:
        assert self._tie_groups is not None
        await reduce_ties(
            self._shared_parameters(),
            self._tie_groups,
            timeout=self.step_timeout,
            who=self._who(),
            step=step,
        )

    def _order_after_step(self) -> None:
        """On CUDA the executor's tasks end when their kernels are enqueued: order the
        device's default stream after them (no host wait) before anything else touches the
        gradients (the tied and DP reductions, the caller's optimizer)."""
        ex = self.stage.executor
        if isinstance(ex, StreamOrderingExecutor):
            ex.order_after_step()

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average gradients over the data-parallel group (no-op without DP). Blocking."""
        if self.groups.dp is None:
            return
        n = self.layout.dp
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.groups.dp)
                p.grad /= n
