"""What the torch drop-in reads off the user's ``PipelineStage`` objects.

The adapter takes from torch's stage objects what they describe and nothing else: the
submodule, the stage index, the number of stages, the process group and its ranks. From
those it builds the runtime's ``Topology`` (placement read off the stages a rank holds: stage
``i`` on group rank ``i % P``, interleaved, or V-shape, chunk 0 down the ranks and chunk 1
back up, as ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` place them) and its
``ProcessLayout`` (PP = the stage's group, DP = the other groups like it). What does not fit
(stages of several pipelines, a placement neither interleaved nor V-shape, a ``dw_builder``,
groups that are not PP x DP) is refused by name.

A rank's stage indices do not always tell the placement: on an odd number of ranks with two
stages each, the middle rank holds the same stages either way (3 ranks: stages 1 and 4 are
``1 % 3`` and ``4 % 3``, and also V-shape's ``1`` and ``2 * 3 - 1 - 1``), and with one stage
a rank both placements are one. So ``stage_topologies`` gives every topology the stages fit,
and the hint decides (``_torch_schedule_hint.hint_source``): a torch schedule brings its
placement, an rrfp_async hint orders interleaved placement, and with no hint interleaved is
taken, as torch's ``PipelineStage`` maps stages until a V-shape schedule remaps them. No rank
asks the others (a collective at construction would hang where one rank fails first); ranks
that read different placements are found by the plan check at the first step, on every rank,
and ``placement_note`` says why and what to give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PlanError
from .._tasks import Placement, Topology
from ..distributed import ProcessLayout

__all__ = [
    "ambiguous_ranks",
    "check_stages",
    "layout_of_group",
    "placement_note",
    "placements_of",
    "stage_topologies",
]


def check_stages(stages: Sequence[Any]) -> None:
    """PlanError unless ``stages`` are torch pipelining stage objects (at least one)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if not stages or not all(isinstance(s, _PipelineStageBase) for s in stages):
        raise PlanError(
            "ScheduleReadinessFirst takes the torch.distributed.pipelining PipelineStage of"
            " this rank (or a list of them), got"
            f" {[type(s).__name__ for s in stages] or 'nothing'}"
        )


def stage_topologies(stages: Sequence[Any]) -> list[Topology]:
    """Every ``Topology`` this rank's ``stages`` fit (one pipeline's, placement read off the
    stage indices; interleaved first): two where both placements put these stages on this
    rank (see the module's note), one otherwise.

    Raises:
        PlanError: Naming what does not fit (stages of several pipelines, a count of stages
            that is not this rank's share, a placement neither interleaved nor V-shape, a
            ``dw_builder``).
    """
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
    placements = placements_of([s.stage_index for s in stages], size, grank, n_stages)
    return [Topology(stages=size, chunks=chunks, placement=p) for p in placements]


def _held(topo: Topology, rank: int) -> list[int]:
    return [s for s in range(topo.num_virtual) if topo.rank_of(s) == rank]


def placements_of(indices: Sequence[int], size: int, grank: int, n_stages: int) -> list[Placement]:
    """The placements (interleaved, V-shape, or both, in that order) that put the stages
    ``indices`` on group rank ``grank``.

    Raises:
        PlanError: Neither does.
    """
    chunks = n_stages // size
    fits: list[Placement] = [
        p
        for p in ("interleaved", "vshape")
        if sorted(indices) == _held(Topology(stages=size, chunks=chunks, placement=p), grank)
    ]
    if fits:
        return fits
    raise PlanError(
        f"group rank {grank} holds stages {sorted(indices)} of {n_stages} on {size} ranks:"
        " neither interleaved placement (stage i on rank i % P) nor V-shape"
        " (ScheduleZBVZeroBubble / ScheduleDualPipeV); ScheduleReadinessFirst supports those two"
    )


def ambiguous_ranks(stages: int, chunks: int) -> list[int]:
    """The ranks whose stages both placements place alike, with several stages a rank (so
    that their placement could be either): the middle rank of an odd number of ranks."""
    if chunks < 2:
        return []  # one stage a rank: the two placements are one
    loop, vee = (
        Topology(stages=stages, chunks=chunks, placement=p) for p in ("interleaved", "vshape")
    )
    return [r for r in range(stages) if _held(loop, r) == _held(vee, r)]


def placement_note(topo: Topology, grank: int) -> str | None:
    """What to add to a failed first step of a schedule given no hint, where the ranks may
    have read different placements off their stages (None where they cannot have): this
    rank's stages are V-shape, or fit both placements, on a pipeline with such a rank."""
    middle = ambiguous_ranks(topo.stages, topo.chunks)
    if topo.stages < 2 or not middle or (topo.placement != "vshape" and grank not in middle):
        return None
    held = {r: _held(topo, r) for r in middle}
    return (
        "rrfp_async: if the ranks disagree on placement: with no hint, a rank reads its"
        f" placement off its stages, and on {topo.stages} ranks with {topo.chunks} stages each"
        f" the stages of group rank(s) {', '.join(f'{r} {held[r]}' for r in middle)} fit both"
        " interleaved and V-shape placement, so those take interleaved (as torch's"
        " PipelineStage maps them) while V-shape ranks take V-shape: for a V-shape pipeline,"
        " give every rank its V-shape order as the hint (hint=ScheduleZBVZeroBubble or"
        " ScheduleDualPipeV)"
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
