"""A stage's gradients across ranks: the tied parameters' reduction at the end of each
training step (the ties themselves: ``_ties``), the device order after a step
(``order_after_step``), and the data-parallel all-reduce (``allreduce_dp``).

``TiedGradients`` owns the declared ties (from the executor's ``shared_spec``), their
groups (built before the first training step), whether the check for undeclared ties ran,
and what it sets aside while a step runs; it reads the executor through the optional hooks
of ``_executor_hooks`` and ``loop.TiedExecutor`` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..loop import GradStash, TiedExecutor, stash_grads
from ..policies import StepSchedule
from ._executor_hooks import ModulesExecutor, StreamOrderingExecutor, TieSpecExecutor
from ._layout import ProcessLayout
from ._ties import find_undeclared_ties, reduce_ties, tie_groups, ties_digest

__all__ = ["TiedGradients", "allreduce_dp", "order_after_step"]


class TiedGradients:
    """The parameters tied across ranks: one gradient for each, reduced over the ranks that
    hold it before any optimizer sees it (invariant 7).

    Args:
        executor: The stage's executor (its ``shared_spec``, ``shared_parameters()`` and
            ``modules``, each where it has them).
        layout: Where this process sits.
        control_group: The group of every rank of the job, for the undeclared-ties check.
        check_undeclared: Look for undeclared ties before the first training step.
        timeout: How long a collective may take (None: no limit).
        who: This rank, for messages.
    """

    def __init__(
        self,
        executor: object,
        *,
        layout: ProcessLayout,
        control_group: Any,
        check_undeclared: bool,
        timeout: float | None,
        who: str,
    ) -> None:
        self._executor = executor
        self._layout = layout
        self._control_group = control_group
        self.check_undeclared = check_undeclared
        self._timeout = timeout
        self._who = who
        self._spec: dict[str, tuple[tuple[int, str], ...]] = dict(
            (executor.shared_spec if isinstance(executor, TieSpecExecutor) else None) or {}
        )
        self._groups: dict[str, tuple[Any, list[int]]] | None = None
        self._prepared = False

    def digest(self) -> str:
        """What the plan check compares of the ties: the declared ties, and whether the
        undeclared ones are looked for."""
        return ties_digest(self._spec) + ("" if self.check_undeclared else "|unchecked")

    async def prepare(self, schedule: StepSchedule, step: int) -> None:
        """Before the first training step (once; later calls return at once): look for
        undeclared ties (collective over the control group), then build the declared ties'
        groups (collective; see ``_ties``).

        Raises:
            PlanError: Parameters on different ranks look tied and no tie declares them.
        """
        if self._prepared:
            return
        ex = self._executor
        modules = ex.modules if isinstance(ex, ModulesExecutor) else None
        if self.check_undeclared and isinstance(modules, Mapping):
            await find_undeclared_ties(
                modules,
                self._spec,
                self._layout,
                self._control_group,
                timeout=self._timeout,
                who=f"{self._who} step {step}",
            )
        if self._spec:
            self._groups = tie_groups(self._spec, self._layout, schedule.plan.topology)
        self._prepared = True

    @property
    def active(self) -> bool:
        """Whether the declared ties are reduced at the end of each training step (the
        executor declares ties, and ``prepare`` ran)."""
        return self._groups is not None

    def shared_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """The executor's tied parameters on this rank (``shared_parameters()``)."""
        ex = self._executor
        if not isinstance(ex, TiedExecutor):
            return {}
        return {name: list(params) for name, params in ex.shared_parameters().items()}

    def set_aside(self) -> GradStash:
        """Take the tied parameters' accumulated gradients out while the step runs, so that
        its reduction sums this step's contribution only (``loop.restore_grads`` adds them
        back, also when the step fails); nothing without an active tie."""
        if self._groups is None:
            return []
        return stash_grads(p for ps in self.shared_parameters().values() for p in ps)

    async def reduce(self, step: int) -> None:
        """Sum each tie's gradient over the ranks that hold it (nothing without an active
        tie)."""
        if self._groups is None:
            return
        await reduce_ties(
            self.shared_parameters(),
            self._groups,
            timeout=self._timeout,
            who=self._who,
            step=step,
        )


def order_after_step(executor: object) -> None:
    """On CUDA the executor's tasks end when their kernels are enqueued: order the device's
    default stream after them (no host wait) before anything else touches the gradients
    (the tied and DP reductions, the caller's optimizer). Nothing for an executor without
    ``order_after_step``."""
    if isinstance(executor, StreamOrderingExecutor):
        executor.order_after_step()


def allreduce_dp(params: Iterable[torch.nn.Parameter], group: Any, size: int) -> None:
    """Average gradients over the data-parallel ``group`` of ``size`` ranks (nothing when
    ``group`` is None). Blocking."""
    if group is None:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= size
