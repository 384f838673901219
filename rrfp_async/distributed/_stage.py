"""One process's stage of a multi-process pipeline: layout + channels + stage loop, wired.

Usage, in every process of a PP x TP (x DP) job (torchrun, or ``rrfp_async.spawn``)::

    layout = rr.ProcessLayout.from_world(pp=4, tp=2)
    groups = rr.build_groups(layout)                  # collective: every rank, same order
    executor = rr.TorchStageExecutor(modules, loss_fn, rank=layout.rank)
    async with rr.DistributedStage(layout, schedule, executor, groups=groups) as stage:
        for microbatches in loader:
            stats = await stage.run_step(microbatches)
            stage.allreduce_gradients(params)          # DP, if any
            optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..channels._decisions import DecisionChannel
from ..channels._p2p import P2PChannel
from ..loop import StageLoop, StageObserver, StepStats
from ..loop._executors import Executor
from ..policies._policy import Policy
from ..policies._schedule import StepSchedule
from ._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors

__all__ = ["DistributedStage"]


class DistributedStage:
    """This process's stage: a ``StageLoop`` on a ``P2PChannel``, with TP coordination.

    Args:
        layout: Where this process sits (PP x TP x DP).
        schedule: The step schedule; every process must build an equal one.
        executor: Runs this rank's tasks (e.g. ``TorchStageExecutor``).
        groups: The process groups from ``build_groups`` (built here when None; that is a
            collective call).
        policy: Policy name or coroutine (used by the TP leader; followers follow).
        coordinate_tp: Followers run the TP leader's decisions (switch off only to measure
            or to demonstrate divergence).
        verify_tp: After each step, check that the TP ranks executed the same sequence.
        step_timeout: Watchdog per step, seconds (a multi-process step must never hang;
            None disables it).
        observer: Observer of the stage's transitions.
        device: Where received tensors are allocated.
        decision_depth: TP decisions a follower keeps posted ahead.
    """

    def __init__(
        self,
        layout: ProcessLayout,
        schedule: StepSchedule,
        executor: Executor,
        *,
        groups: StageGroups | None = None,
        policy: str | Policy = "readiness_first",
        coordinate_tp: bool = True,
        verify_tp: bool = True,
        step_timeout: float | None = 600.0,
        observer: StageObserver | None = None,
        device: torch.device | str = "cpu",
        decision_depth: int = 4,
    ) -> None:
        if schedule.plan.stages != layout.pp:
            raise ValueError(
                f"the schedule has {schedule.plan.stages} pipeline ranks, the layout {layout.pp}"
            )
        self.layout = layout
        self.groups = groups if groups is not None else build_groups(layout)
        inbound, outbound = pipeline_neighbors(schedule.plan, layout.pp_rank)
        self.channel = P2PChannel(
            layout.pp_rank,
            global_ranks=layout.pipeline_peers(),
            inbound=inbound,
            outbound=outbound,
            device=device,
        )
        self.decisions: DecisionChannel | None = None
        if layout.tp > 1:
            self.decisions = DecisionChannel(
                self.groups.decisions,
                leader=layout.tp_ranks()[0],
                rank=layout.rank,
                tp_rank=layout.tp_rank,
                stage=layout.pp_rank,
                depth=decision_depth,
            )
        self.stage = StageLoop(
            layout.pp_rank,
            schedule=schedule,
            executor=executor,
            endpoint=self.channel,
            policy=policy,
            observer=observer,
            step_timeout=step_timeout,
            coordinator=self.decisions,
            coordinate=coordinate_tp,
            verify_sequences=verify_tp,
        )

    async def __aenter__(self) -> DistributedStage:
        self.channel.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        await self.channel.__aexit__(exc_type, *exc)

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
    ) -> StepStats:
        """Run this rank's tasks of one step (see ``StageLoop.run_step``)."""
        return await self.stage.run_step(microbatches, step=step, schedule=schedule)

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average gradients over the data-parallel group (no-op without DP). Blocking."""
        if self.groups.dp is None:
            return
        n = self.layout.dp
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.groups.dp)
                p.grad /= n
