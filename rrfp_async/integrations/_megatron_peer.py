"""What the installed megatron-core offers, read off its code (feature, not version string).

The drop-in calls megatron's own ``forward_step`` and ``backward_step`` and must call them
the way the installed version's schedules do; its factory and its forward-backward
function must take exactly the arguments the installed version's do. Those differ between
releases (0.16 -> 0.19: ``backward_step`` lost ``model_type``; the factory gained
``schedule_pg_collection``; ``MultiModuleProcessGroupCollection`` appeared), so every such
choice here is made by looking at the code (``inspect.signature``, ``hasattr``); the version
string only appears in messages.

``megatron_order`` is megatron's own per-rank order of a step, 1F1B or interleaved, built
with megatron's own helpers (``get_schedule_table``, ``get_pp_rank_microbatches``) as
megatron's schedules walk them: it is the drop-in's default hint and the order its strict
policy runs.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

from .._errors import PlanError
from .._tasks import Task

__all__ = ["MegatronPeer", "megatron_order", "peer"]


def _import_schedules() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine / Apex not installed"
        try:
            from megatron.core.pipeline_parallel import schedules
        except ImportError as exc:
            raise PlanError(
                f"rrfp_async.megatron needs megatron-core (pip install rrfp-async[megatron]): {exc}"
            ) from exc
    return schedules


@dataclass(frozen=True)
class MegatronPeer:
    """The installed megatron-core's pipeline-schedule surface.

    Attributes:
        version: ``megatron-core``'s distribution version (for messages only).
        schedules: ``megatron.core.pipeline_parallel.schedules``.
        factory: ``inspect.Signature`` of its ``get_forward_backward_func``.
        one_f_one_b: Signature of ``forward_backward_pipelining_without_interleaving``.
        interleaved: Signature of ``forward_backward_pipelining_with_interleaving``.
        backward_takes_model_type: ``backward_step(input, output, grad, model_type, config)``
            (0.16) rather than ``backward_step(input, output, grad, config)`` (0.19).
        forward_takes_vp_stage: ``forward_step(..., vp_stage=)`` (the interleaved schedule
            names each call's chunk).
    """

    version: str
    schedules: Any
    factory: inspect.Signature
    one_f_one_b: inspect.Signature
    interleaved: inspect.Signature
    backward_takes_model_type: bool
    forward_takes_vp_stage: bool

    @property
    def name(self) -> str:
        """``megatron-core X.Y.Z``, for messages."""
        return f"megatron-core {self.version}"

    def backward_step(
        self, input_tensor: Any, output_tensor: Any, grad: Any, config: Any, model: Any
    ) -> Any:
        """Megatron's ``backward_step``, called as this version's schedules call it."""
        bs = self.schedules.backward_step
        if self.backward_takes_model_type:
            from megatron.core.utils import get_model_type

            return bs(input_tensor, output_tensor, grad, get_model_type(model), config)
        return bs(input_tensor, output_tensor, grad, config)

    def default_pg_collection(self) -> Any:
        """The ``ProcessGroupCollection`` this version's schedules build from
        ``parallel_state`` when the caller gives none (handed to
        ``finalize_model_grads_func``)."""
        build = getattr(self.schedules, "_build_default_pg_collection", None)
        if build is not None:  # 0.19: one helper for every schedule
            return build()
        # 0.16: each schedule builds it inline, with these six groups.
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = ProcessGroupCollection()
        pgc.tp = ps.get_tensor_model_parallel_group()
        pgc.cp = ps.get_context_parallel_group()
        pgc.embd = ps.get_embedding_group(check_initialized=False)
        pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
        pgc.pp = ps.get_pipeline_model_parallel_group()
        pgc.dp_cp = ps.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=False
        )
        return pgc

    def multi_module_types(self) -> tuple[type, ...]:
        """This version's cross-grid (multi-module) collection and communicator classes
        (none before 0.19)."""
        return _multi_module_types()


@functools.cache
def _multi_module_types() -> tuple[type, ...]:
    out: list[type] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time notes of optional dependencies
        from megatron.core import process_groups_config as pgc

        # Only recent megatron-core versions have multi-module pipelines.
        mm = getattr(pgc, "MultiModuleProcessGroupCollection", None)
        if isinstance(mm, type):
            out.append(mm)
        try:
            from megatron.core.pipeline_parallel import multimodule_communicator as mmc
        except ImportError:
            mmc = None
    # Only recent megatron-core versions have multi-module pipelines.
    comm = getattr(mmc, "MultiModulePipelineCommunicator", None)
    if isinstance(comm, type):
        out.append(comm)
    return tuple(out)


@functools.cache
def peer() -> MegatronPeer:
    """The installed megatron-core, inspected once.

    Raises:
        PlanError: megatron-core is not installed.
    """
    import importlib.metadata as md

    s = _import_schedules()
    try:
        version = md.version("megatron-core")
    except md.PackageNotFoundError:  # a source checkout on the path
        version = "(source)"
    bw = inspect.signature(s.backward_step)
    return MegatronPeer(
        version=version,
        schedules=s,
        factory=inspect.signature(s.get_forward_backward_func),
        one_f_one_b=inspect.signature(s.forward_backward_pipelining_without_interleaving),
        interleaved=inspect.signature(s.forward_backward_pipelining_with_interleaving),
        backward_takes_model_type="model_type" in bw.parameters,
        forward_takes_vp_stage="vp_stage" in inspect.signature(s.forward_step).parameters,
    )


class _Group:
    """What ``get_pp_rank_microbatches`` reads of a pipeline group: its size and rank."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Communicator:
    """What ``get_pp_rank_microbatches`` reads of a ``P2PCommunicator``."""

    def __init__(self, size: int, rank: int, vp: int | None) -> None:
        self.pp_group = _Group(size, rank)
        self.virtual_pipeline_model_parallel_size = vp


def megatron_order(
    stages: int,
    chunks: int,
    microbatches: int,
    group_size: int,
    *,
    interleaved: bool,
    forward_only: bool = False,
) -> dict[int, list[Task]]:
    """Megatron's per-rank task order of one step, from megatron's own helpers.

    Megatron's schedules run a virtual microbatch ``k`` (``0 .. M*V-1``) as the forward of
    ``get_schedule_table(M, V, G)[k] = (microbatch, chunk)`` and its backward on chunk
    ``V - 1 - chunk`` (each chunk's backwards pop its stash first in, first out, so the
    backward of ``k`` is of the same microbatch); ``get_pp_rank_microbatches`` gives rank
    ``r`` its ``W`` warm-up forwards; then ``F(W + i)``, ``B(i)`` alternate and the remaining
    backwards close the step. Chunk ``c`` of rank ``r`` is virtual stage ``c * P + r``
    (megatron's placement). ``interleaved=False`` is
    ``forward_backward_pipelining_without_interleaving`` (one chunk, ``P - r - 1`` warm-up
    forwards).

    Args:
        stages: Pipeline ranks P.
        chunks: Model chunks per rank V (1 without interleaving).
        microbatches: Microbatches M.
        group_size: ``config.microbatch_group_size_per_vp_stage`` (G).
        interleaved: The interleaved schedule (``vp_size`` not None) or 1F1B.
        forward_only: Megatron's forward-only order (every forward, in table order).

    Returns:
        ``{rank: [Task, ...]}``.
    """
    s = peer().schedules
    table = s.get_schedule_table(microbatches, chunks, group_size)
    out: dict[int, list[Task]] = {}
    for r in range(stages):
        comm = _Communicator(stages, r, chunks if interleaved else None)
        total, _, warm, remaining = s.get_pp_rank_microbatches(
            microbatches,
            chunks,
            group_size,
            forward_only=forward_only,
            overlap_moe_expert_parallel_comm=False,
            p2p_communicator=comm,
        )

        def fwd(k: int, r: int = r) -> Task:
            mb, c = table[k]
            return Task(c * stages + r, "F", mb)

        def bwd(k: int, r: int = r) -> Task:
            mb, c = table[k]
            return Task((chunks - 1 - c) * stages + r, "B", mb)

        order = [fwd(k) for k in range(warm)]
        for i in range(remaining):
            order += [fwd(warm + i), bwd(i)]
        if not forward_only:
            order += [bwd(k) for k in range(remaining, total)]
        out[r] = order
    return out
