"""What the torch drop-in reads off the user's ``PipelineStage`` objects.

The adapter takes from torch's stage objects what they describe and nothing else: the
submodule, the stage index, the number of stages, the process group and its ranks. From
those it builds the runtime's ``Topology`` (placement read off the stages a rank holds: stage
``i`` on group rank ``i % P``, interleaved, or V-shape, chunk 0 down the ranks and chunk 1
back up, as ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` place them) and its
``ProcessLayout`` (PP = the stage's group, DP = the other groups like it). What does not fit
(stages of several pipelines, a placement neither interleaved nor V-shape, a ``dw_builder``,
groups that are not PP x DP) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PlanError
from .._tasks import Placement, Topology
from ..distributed import ProcessLayout

__all__ = ["check_stages", "layout_of_group", "placement_of", "stage_topology"]


def check_stages(stages: Sequence[Any]) -> None:
    """PlanError unless ``stages`` are torch pipelining stage objects (at least one)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if not stages or not all(isinstance(s, _PipelineStageBase) for s in stages):
        raise PlanError(
            "ScheduleReadinessFirst takes the torch.distributed.pipelining PipelineStage of"
            " this rank (or a list of them), got"
            f" {[type(s).__name__ for s in stages] or 'nothing'}"
        )


def stage_topology(stages: Sequence[Any]) -> Topology:
    """The ``Topology`` this rank's ``stages`` describe (one pipeline's, placement read off
    the stage indices), or PlanError naming what does not fit."""
    first = stages[0]
    group, size, grank, n_stages = (
        first.group,
        first.group_size,
        first.group_rank,
        first.num_stages,
    )
    for s in stages:
        if s.group is not group or s.num_stages != n_stages:
            raise PlanError(
                "every stage given to one schedule must share one process group and"
                " number of stages (stages of several pipelines in one schedule are not"
                " supported)"
            )
        # torch's stages (_PipelineStageBase) set dw_builder; a stage of another kind may not.
        if getattr(s, "dw_builder", None) is not None:
            raise PlanError(
                f"stage {s.stage_index} has a dw_builder (torch's custom weight-gradient"
                " builder): not supported by ScheduleReadinessFirst; the runtime splits"
                " the backward itself (split_backward=True)"
            )
    if n_stages % size:
        raise PlanError(f"{n_stages} stages do not divide over {size} ranks")
    chunks = n_stages // size
    if len(stages) != chunks:
        raise PlanError(
            f"this rank holds {len(stages)} of the {n_stages} stages, but {n_stages} stages"
            f" on {size} ranks are {chunks} per rank: give this rank's {chunks} stage(s)"
            + (
                " (a single-stage schedule takes one stage per rank: use"
                " ScheduleInterleavedReadinessFirst for several)"
                if len(stages) == 1
                else ""
            )
        )
    placement = placement_of([s.stage_index for s in stages], size, grank, n_stages)
    return Topology(stages=size, chunks=chunks, placement=placement)


def placement_of(indices: Sequence[int], size: int, grank: int, n_stages: int) -> Placement:
    """The placement the stages of this rank follow (interleaved or V-shape), or PlanError."""
    chunks = n_stages // size
    for placement in ("interleaved", "vshape"):
        topo = Topology(stages=size, chunks=chunks, placement=placement)
        if sorted(indices) == sorted(s for s in range(n_stages) if topo.rank_of(s) == grank):
            return placement
    raise PlanError(
        f"group rank {grank} holds stages {sorted(indices)} of {n_stages} on {size} ranks:"
        " neither interleaved placement (stage i on rank i % P) nor V-shape"
        " (ScheduleZBVZeroBubble / ScheduleDualPipeV); ScheduleReadinessFirst supports those two"
    )


def layout_of_group(group: Any, group_rank: int, size: int) -> ProcessLayout:
    """The ``ProcessLayout`` of a pipeline process group: PP = the group, DP = the other
    groups like it (every rank all-gathers its group's global ranks as int64, no pickle)."""
    world = dist.get_world_size()
    mine = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    grid: tuple[tuple[tuple[int, ...], ...], ...]
    if world == size:
        grid = (tuple((r,) for r in mine),)
        return ProcessLayout(pp=size, rank=dist.get_rank(), grid=grid)
    rows = [torch.empty(size, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(mine, dtype=torch.int64))
    pipes = sorted({tuple(int(x) for x in r.tolist()) for r in rows})
    flat = sorted(r for p in pipes for r in p)
    if flat != list(range(world)):
        raise PlanError(
            f"the pipeline groups of the {world} ranks do not partition the world (each rank"
            " in exactly one pipeline group of the same size): ScheduleReadinessFirst needs"
            f" PP x DP; got pipelines {pipes[:4]}"
        )
    grid = tuple(tuple((r,) for r in p) for p in pipes)
    return ProcessLayout(pp=size, dp=len(pipes), rank=dist.get_rank(), grid=grid)
