"""Where each process sits: the PP x TP (x DP) layout and its process groups.

Default rank order (Megatron's): TP innermost, then PP, then DP::

    global rank = (dp_rank * pp + pp_rank) * tp + tp_rank

A ``DeviceMesh`` with named dimensions ("pp", and optionally "tp" and "dp") may define any
other order; the layout then reads the ranks off the mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .._errors import PeerError, PlanError
from .._tasks import StepPlan
from ..testing import nccl_logs, nccl_rules
from . import _pulse as pulse
from ._fd_check import agree_on_fds, group_fds

__all__ = [
    "ProcessLayout",
    "StageGroups",
    "build_groups",
    "payload_edges",
    "pipeline_neighbors",
]


@dataclass(frozen=True, kw_only=True)
class ProcessLayout:
    """This process's place in a PP x TP x DP job.

    Attributes:
        pp: Pipeline ranks.
        tp: Tensor-parallel ranks per stage.
        dp: Data-parallel replicas.
        rank: This process's global rank.
        grid: ``grid[dp][pp][tp]`` = global rank (default: Megatron's order).
    """

    pp: int
    tp: int = 1
    dp: int = 1
    rank: int
    grid: tuple[tuple[tuple[int, ...], ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} must be an int >= 1, got {v!r}")
        if not self.grid:
            grid = tuple(
                tuple(
                    tuple((d * self.pp + p) * self.tp + t for t in range(self.tp))
                    for p in range(self.pp)
                )
                for d in range(self.dp)
            )
            object.__setattr__(self, "grid", grid)
        flat = [r for plane in self.grid for row in plane for r in row]
        if sorted(flat) != list(range(self.world_size)):
            raise PlanError(f"the layout grid must hold each rank 0..{self.world_size - 1} once")
        if not 0 <= self.rank < self.world_size:
            raise PlanError(f"rank {self.rank} is outside the world of {self.world_size}")

    @property
    def world_size(self) -> int:
        """pp * tp * dp."""
        return self.pp * self.tp * self.dp

    def _coords(self) -> tuple[int, int, int]:
        for d, plane in enumerate(self.grid):
            for p, row in enumerate(plane):
                if self.rank in row:
                    return d, p, row.index(self.rank)
        raise AssertionError("unreachable: rank checked in __post_init__")

    @property
    def pp_rank(self) -> int:
        """This process's pipeline rank (its stage)."""
        return self._coords()[1]

    @property
    def tp_rank(self) -> int:
        """This process's rank inside its stage's TP group."""
        return self._coords()[2]

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica."""
        return self._coords()[0]

    def global_rank(
        self, pp_rank: int, tp_rank: int | None = None, dp_rank: int | None = None
    ) -> int:
        """Global rank of a (pp, tp, dp) position; tp and dp default to this process's."""
        d, _, t = self._coords()
        return self.grid[d if dp_rank is None else dp_rank][pp_rank][
            t if tp_rank is None else tp_rank
        ]

    def pipeline_peers(self) -> dict[int, int]:
        """Pipeline rank -> global rank of this process's peers (same TP and DP index)."""
        return {p: self.global_rank(p) for p in range(self.pp)}

    def tp_ranks(self) -> list[int]:
        """Global ranks of this process's stage's TP group, TP-rank order (leader first)."""
        d, p, _ = self._coords()
        return list(self.grid[d][p])

    def dp_ranks(self) -> list[int]:
        """Global ranks of the replicas of this process's position."""
        _, p, t = self._coords()
        return [self.grid[d][p][t] for d in range(self.dp)]

    @classmethod
    def from_world(cls, pp: int, tp: int = 1) -> ProcessLayout:
        """The layout of the initialised default group: dp = world / (pp * tp).

        Raises:
            PlanError: torch.distributed has no default process group yet (the message
                says to call ``dist.init_process_group`` first, under torchrun or
                ``rr.spawn``); the world size is not a multiple of pp * tp.
        """
        _require_default_group("ProcessLayout.from_world")
        world = dist.get_world_size()
        if world % (pp * tp):
            raise PlanError(f"world size {world} is not a multiple of pp * tp = {pp * tp}")
        return cls(pp=pp, tp=tp, dp=world // (pp * tp), rank=dist.get_rank())

    @classmethod
    def from_mesh(cls, mesh: Any) -> ProcessLayout:
        """The layout of a ``torch.distributed.DeviceMesh`` with named dimensions.

        The mesh must name a "pp" dimension and may name "tp" and "dp" (no others).

        Raises:
            PlanError: Missing or unknown dimension names; no default process group.
        """
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names or set(names) - {"pp", "tp", "dp"}:
            raise PlanError(f"the mesh needs dims named 'pp' (+ 'tp', 'dp'), got {names}")
        t = mesh.mesh
        for n in ("dp", "pp", "tp"):
            if n not in names:
                t = t.unsqueeze(0)
                names = (n, *names)
        order = [names.index(n) for n in ("dp", "pp", "tp")]
        t = t.permute(*order)
        grid = tuple(tuple(tuple(int(x) for x in row) for row in plane) for plane in t.tolist())
        dp, pp, tp = len(grid), len(grid[0]), len(grid[0][0])
        _require_default_group("ProcessLayout.from_mesh")
        return cls(pp=pp, tp=tp, dp=dp, rank=dist.get_rank(), grid=grid)


def _require_default_group(who: str) -> None:
    """Refuse to read this process's rank before there is a default process group
    (torch's own error, a ValueError about the default group, names neither the call that
    creates it nor the launchers that set up its environment)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError(
            f"{who}: torch.distributed is not initialized (no default process group to read"
            " this process's rank and the world size from): call"
            " dist.init_process_group(backend) first, in a"
            " process started by torchrun (torchrun --nproc-per-node=N script.py) or by"
            " rr.spawn(fn, world_size), which set RANK, WORLD_SIZE and MASTER_ADDR/PORT;"
            " rr.spawn also initialises the group before it calls fn"
        )


@dataclass(frozen=True)
class StageGroups:
    """The process groups of one process.

    Attributes:
        tp: This stage's TP group for model collectives (None when tp == 1).
        decisions: This stage's dedicated gloo group for TP decisions (None when tp == 1).
        dp: This position's data-parallel group (None when dp == 1).
        control: A gloo group of every rank, for ``DistributedStage``'s plan check (None:
            the check uses the default group).
        p2p: This process's pipeline's own group for ``DistributedStage``'s activations and
            gradients (None when pp == 1, or for groups built by hand: the default group).
            One open stage per p2p group in a process: two users of one group's p2p mix
            their messages (gloo aborts the process, or a peer hangs). Always gloo: it
            carries the headers and control messages (and, without ``payload``, the
            payloads).
        payload: The device path's payload communicators (``p2p_backend="nccl"``, or the
            NCCL-rules checker): ``(src, dst)`` pipeline ranks -> a 2-rank group that
            carries that directed edge's payloads, for the edges of this rank between
            neighbouring pipeline ranks (and last to first). None: payloads on ``p2p``.
    """

    tp: Any = None
    decisions: Any = None
    dp: Any = None
    control: Any = None
    p2p: Any = None
    payload: dict[tuple[int, int], Any] | None = None


def build_groups(
    layout: ProcessLayout, *, tp_group: Any = None, p2p_backend: str = "gloo"
) -> StageGroups:
    """Create the TP, TP-decision, DP, control and pipeline p2p groups. Collective: every
    rank calls it, in the same order relative to other ``new_group`` calls.

    The control group is a gloo group of every rank, used for nothing but the plan check
    at a stage's first step (so it never interleaves with model collectives, and works when
    the default group is NCCL). Each pipeline (the pp ranks of one TP and DP index) gets a
    p2p group of its own, so a stage's messages never meet another user of point-to-point
    on the default group (torch pipelining, a second stage, the user's own sends): call
    ``build_groups`` once per ``DistributedStage`` that is open at the same time.

    Args:
        layout: The layout.
        tp_group: An existing TP group for model collectives (e.g. ``mesh.get_group("tp")``);
            the decision group is always a new, dedicated gloo group.
        p2p_backend: Where payloads travel: "gloo" (a CUDA payload is staged through the
            CPU), or "nccl": device to device, on a 2-rank NCCL group per directed edge
            between neighbouring pipeline ranks (``StageGroups.payload``; headers and control
            stay on the gloo p2p group: see ``channels._p2p_device``). With
            ``RRFP_NCCL_RULES`` set, "gloo" and "nccl" alike build the payload groups as the
            NCCL-rules checker's gloo stand-ins (``rrfp_async.testing.nccl_rules``).

    Raises:
        PlanError: An unknown ``p2p_backend``.
        ResourceError: A rank is short of file descriptors (every rank raises it).
        PeerError: A rank was lost while the groups connected (the message names it when
            its heartbeat stopped: see ``_pulse``).
    """
    if p2p_backend not in ("gloo", "nccl"):
        raise PlanError(f"p2p_backend must be 'gloo' or 'nccl', got {p2p_backend!r}")
    # Before any new_group: gloo aborts the process (no Python error) when a socket cannot
    # be had inside it, and the other ranks would wait there for the lost one (_fd_check).
    on_device = nccl_rules.enabled() or p2p_backend == "nccl"
    mine = [e for e in payload_edges(layout.pp) if layout.pp_rank in e] if on_device else []
    agree_on_fds(layout, group_fds(layout, tp_group=tp_group, payload_edges=len(mine)))
    # This rank's heartbeat, from here on: a rank lost while the groups connect is named by
    # it (gloo's error names an address), and so are later stops and losses (``_pulse``).
    pulse.start(pulse.default_store(), layout.rank, layout.world_size)
    try:
        return _new_groups(layout, tp_group=tp_group, p2p_backend=p2p_backend)
    except RuntimeError as e:  # gloo's connectFullMesh, the store's timeout: a rank is gone
        silent = pulse.silent_ranks_sync()
        who = f"rank {layout.pp_rank} (global {layout.rank}): build_groups"
        if silent:
            why = pulse.describe(silent, lambda g: name_global(layout, g), broke=True)
            raise PeerError(f"{who}: {why}; creating the groups failed with it: {e}") from e
        seen = (
            "no rank's heartbeat stopped"
            if silent is not None
            else "the job's heartbeats could not be read"
        )
        raise PeerError(
            f"{who}: creating the groups failed ({seen}: a rank failed or the network broke): {e}"
        ) from e


def name_global(layout: ProcessLayout, g: int) -> str:
    """How messages name global rank ``g``: "rank 2 (global 2)" in this rank's pipeline,
    "global rank 9" elsewhere."""
    return name_among(layout.pipeline_peers(), g)


def name_among(peers: Mapping[int, int], g: int) -> str:
    """``name_global`` given this pipeline's ``{pipeline rank: global rank}``."""
    for p, gg in peers.items():
        if gg == g:
            return f"rank {p} (global {g})"
    return f"global rank {g}"


def _new_groups(layout: ProcessLayout, *, tp_group: Any, p2p_backend: str) -> StageGroups:
    """``build_groups``' groups, created (every ``new_group`` call of the job)."""
    tp = decisions = dp = None
    if layout.tp > 1:
        for plane in layout.grid:
            for row in plane:
                g_model = dist.new_group(list(row)) if tp_group is None else None
                g_dec = dist.new_group(list(row), backend="gloo")
                if layout.rank in row:
                    tp = tp_group if tp_group is not None else g_model
                    decisions = g_dec
    if layout.dp > 1:
        for p in range(layout.pp):
            for t in range(layout.tp):
                ranks = [layout.grid[d][p][t] for d in range(layout.dp)]
                g = dist.new_group(ranks)
                if layout.rank in ranks:
                    dp = g
    control = dist.new_group(list(range(layout.world_size)), backend="gloo")
    p2p = None
    payload: dict[tuple[int, int], Any] | None = None
    # RRFP_NCCL_RULES: the NCCL groups are checked gloo groups (rrfp_async.testing.nccl_rules).
    rules = nccl_rules.enabled()
    device = rules or p2p_backend == "nccl"
    if layout.pp > 1:  # one group per pipeline, created by every rank in the same order
        for plane in layout.grid:
            for t in range(layout.tp):
                ranks = [row[t] for row in plane]
                g = dist.new_group(ranks, backend="gloo")
                if layout.rank in ranks:
                    p2p = nccl_logs.observe(g) if rules else g
                if not device:
                    continue
                for a, b in payload_edges(layout.pp):
                    pg = dist.new_group([ranks[a], ranks[b]], backend="gloo" if rules else "nccl")
                    if layout.rank in (ranks[a], ranks[b]):
                        if payload is None:
                            payload = {}
                        payload[(a, b)] = nccl_rules.CheckedGroup(pg) if rules else pg
    return StageGroups(tp=tp, decisions=decisions, dp=dp, control=control, p2p=p2p, payload=payload)


def payload_edges(pp: int) -> list[tuple[int, int]]:
    """The directed edges that get a payload communicator in a pipeline of ``pp`` ranks:
    both ways between neighbours, and between the last rank and the first (interleaved
    schedules loop back), in the order every rank creates them."""
    edges: set[tuple[int, int]] = set()
    for p in range(pp):
        q = (p + 1) % pp
        if q != p:
            edges |= {(p, q), (q, p)}
    return sorted(edges)


def pipeline_neighbors(plan: StepPlan, rank: int) -> tuple[list[int], list[int]]:
    """The pipeline ranks that send to ``rank`` and that ``rank`` sends to, for ``plan``."""
    inbound: set[int] = set()
    outbound: set[int] = set()
    for t in plan.tasks_of(rank):
        p = plan.data_producer(t)
        if p is not None and plan.rank_of(p) != rank:
            inbound.add(plan.rank_of(p))
        c = plan.data_consumer(t)
        if c is not None and plan.rank_of(c) != rank:
            outbound.add(plan.rank_of(c))
    return sorted(inbound), sorted(outbound)
