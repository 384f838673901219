"""Where a megatron-core call's process groups come from, and the runtime's layout of them.

A call names its groups one of two ways, as megatron's schedules take them:

* neither ``p2p_communicator`` nor ``pg_collection`` (megatron-core's README, Megatron-LM's
  ``training.py``): ``megatron.core.parallel_state``;
* both (Megatron-Bridge, which may build its groups with ``HyperCommGrid`` and never
  initialise ``parallel_state``): the pipeline group is the communicator's ``pp_group``, the
  tensor and context groups are the collection's ``tp`` and ``cp``.

Design note: the layout from the groups alone
---------------------------------------------
The runtime needs the job as a grid ``[dp][pp][tp]`` of global ranks whose rows are the
caller's pipeline groups. It is read off the groups themselves, not off a rank-order
convention: every rank all-gathers its pipeline group's and its tensor group's global ranks
(int64, no pickle); the pipelines are the distinct pipeline groups; two pipelines belong to
one model replica when a tensor group joins them, and their order inside it is their members'
tensor rank. Any rank order Megatron, Megatron-Bridge or a hand-made ``HyperCommGrid`` uses
then gives the right grid, and one that is no PP x TP x DP grid is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PlanError
from ..distributed import ProcessLayout
from ._megatron_peer import MegatronPeer

__all__ = ["CallGroups", "call_groups", "layout_of"]

_WHO = "the readiness-first get_forward_backward_func"


@dataclass(frozen=True)
class CallGroups:
    """The process groups of one forward-backward call.

    Attributes:
        pp: The pipeline group.
        tp: The tensor-parallel group (None: TP 1).
        cp_size: The context-parallel size.
        pg_collection: What ``finalize_model_grads_func`` gets: the caller's collection, or
            the one megatron's schedule builds from ``parallel_state``.
        source: ``"parallel_state"`` or ``"pg_collection"`` (for messages).
    """

    pp: Any
    tp: Any
    cp_size: int
    pg_collection: Any
    source: str

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The groups' global ranks: a stage opened for one key serves only calls of it."""
        tp = () if self.tp is None else tuple(dist.get_process_group_ranks(self.tp))
        return tuple(dist.get_process_group_ranks(self.pp)), tp


def _ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def call_groups(peer: MegatronPeer, p2p_communicator: Any, pg_collection: Any) -> CallGroups:
    """The groups of a call (see the module docstring).

    Raises:
        PlanError: Only one of ``p2p_communicator`` / ``pg_collection``; a multi-module
            (cross-grid) collection or communicator; a collection without ``tp``/``cp``; a
            communicator without ``pp_group``; pipeline groups that disagree;
            ``parallel_state`` not initialised; context parallelism.
    """
    if (p2p_communicator is None) != (pg_collection is None):
        given = "p2p_communicator" if pg_collection is None else "pg_collection"
        missing = "pg_collection" if pg_collection is None else "p2p_communicator"
        raise PlanError(
            f"{given} without {missing}: {peer.name}'s schedules take both or neither (the"
            " pipeline group from the communicator, the others from the collection)"
        )
    mm = peer.multi_module_types()
    for name, v in (("p2p_communicator", p2p_communicator), ("pg_collection", pg_collection)):
        if mm and isinstance(v, mm):
            raise PlanError(
                f"{name} is a {type(v).__name__} (several modules on separate grids,"
                f" {peer.name}'s cross-grid schedule): not supported by {_WHO}; pass one"
                " module's P2PCommunicator and ProcessGroupCollection"
            )
    if p2p_communicator is None:
        return _from_parallel_state(peer)
    # megatron-core's P2PCommunicator holds pp_group; an object of another kind may not.
    pp = getattr(p2p_communicator, "pp_group", None)
    if pp is None:
        raise PlanError(
            f"p2p_communicator {type(p2p_communicator).__name__} has no pp_group: {_WHO}"
            " takes megatron's P2PCommunicator(pp_group=..., config=...)"
        )
    for attr in ("tp", "cp"):
        # ProcessGroupCollection's fields are optional (unset until the caller fills them).
        if getattr(pg_collection, attr, None) is None:
            raise PlanError(
                f"pg_collection has no {attr} group: {peer.name}'s schedules need tp and cp"
                " (set them, e.g. ProcessGroupCollection.use_mpu_process_groups())"
            )
    own_pp = getattr(pg_collection, "pp", None)
    if own_pp is not None and _ranks(own_pp) != _ranks(pp):
        raise PlanError(
            f"pg_collection.pp holds ranks {_ranks(own_pp)} but p2p_communicator.pp_group"
            f" holds {_ranks(pp)}: one call runs one pipeline"
        )
    cp = int(pg_collection.cp.size())
    _check_cp(cp)
    return CallGroups(
        pp=pp, tp=pg_collection.tp, cp_size=cp, pg_collection=pg_collection, source="pg_collection"
    )


def _check_cp(cp: int) -> None:
    if cp != 1:
        raise PlanError(
            f"context parallelism (context_parallel_size={cp}) is not supported by {_WHO}"
        )


def _from_parallel_state(peer: MegatronPeer) -> CallGroups:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise PlanError(
            "megatron.core.parallel_state is not initialized and the call names no groups:"
            " call parallel_state.initialize_model_parallel(...) before the first step, or"
            " pass p2p_communicator= and pg_collection= (as Megatron-Bridge does)"
        )
    cp = ps.get_context_parallel_world_size()
    _check_cp(cp)
    return CallGroups(
        pp=ps.get_pipeline_model_parallel_group(),
        tp=ps.get_tensor_model_parallel_group(),
        cp_size=cp,
        pg_collection=peer.default_pg_collection(),
        source="parallel_state",
    )


def layout_of(groups: CallGroups) -> ProcessLayout:
    """The runtime's ``ProcessLayout`` of the call's groups (see "The layout from the
    groups alone"). Collective over the world when the world is more than one pipeline.

    Raises:
        PlanError: The groups are no PP x TP x DP grid of the world.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    pp_ranks = _ranks(groups.pp)
    tp_ranks = [rank] if groups.tp is None else _ranks(groups.tp)
    pp, tp = len(pp_ranks), len(tp_ranks)
    if pp == world:
        return ProcessLayout(pp=pp, rank=rank, grid=(tuple((r,) for r in pp_ranks),))
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(pp_ranks + tp_ranks, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    table = [[int(x) for x in r.tolist()] for r in rows]
    pipes = {tuple(row[:pp]) for row in table}
    tp_of = {g: tuple(table[g][pp:]) for g in range(world)}
    replicas: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for pipe in pipes:
        # The replica is named by the tensor group of its first stage's member.
        replicas.setdefault(tuple(sorted(tp_of[pipe[0]])), []).append(pipe)
    grid: list[tuple[tuple[int, ...], ...]] = []
    for tp_group in sorted(replicas):
        members = replicas[tp_group]
        # Inside a replica, a pipeline's tensor rank is its first member's place in the group.
        by_t = sorted(members, key=lambda p: tp_of[p[0]].index(p[0]))
        plane = tuple(tuple(pipe[s] for pipe in by_t) for s in range(pp))
        for row in plane:
            if len(row) != tp or list(row) != list(tp_of[row[0]]):
                raise PlanError(
                    f"rank {rank}: the pipeline groups and the tensor-parallel groups do not"
                    f" form a PP x TP x DP grid (pipeline stage ranks {list(row)} are not one"
                    f" tensor group; {groups.source}): not supported by {_WHO}"
                )
        grid.append(plane)
    dp = len(grid)
    if pp * tp * dp != world:
        raise PlanError(
            f"the world of {world} ranks is not PP x TP x DP = {pp} x {tp} x {dp} (from"
            f" {groups.source}): not supported by {_WHO}"
        )
    return ProcessLayout(pp=pp, tp=tp, dp=dp, rank=rank, grid=tuple(grid))
