"""megatron-core's ``get_forward_backward_func()`` over the readiness-first runtime
(``rr.megatron``).

A Megatron training script switches by one line::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from rrfp_async.megatron import get_forward_backward_func

and keeps the rest: its ``forward_step_func(data_iterator, model)`` returning ``(output,
loss_func)``, its model (wrapped in Megatron's DDP / ``Float16Module`` or not), its
``TransformerConfig`` (``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``, ``calculate_per_token_loss``), the keyword-only call and the returned
list of loss dicts (last pipeline stage; ``[]`` elsewhere).

Design note
-----------
Megatron's 1F1B interleaves its own p2p calls with ``forward_step`` and ``backward_step``
in one fixed order. The adapter keeps the two compute halves and replaces the order:
each ``F`` task calls Megatron's own ``forward_step`` (so ``set_input_tensor``, autocast,
``set_current_microbatch``, the loss function's two- or three-tuple, the division by the
number of microbatches or the per-token path, the MoE/MTP loss scales are Megatron's code,
not a copy) and each ``B`` task Megatron's own ``backward_step`` (``grad_scale_func`` on the
last stage, the input tensor's gradient). What travels between stages, and when, is the
runtime's: every activation carries its own shape (``seq_length``, ``micro_batch_size``,
``variable_seq_lengths`` and ``adjust_tensor_shapes_fn`` are not needed and ignored) on a
p2p group of its own.

Data is read in microbatch order whatever order the tasks run in: the F of microbatch
``m`` gets an iterator whose ``next()`` returns the ``m``-th item of ``data_iterator``,
reading the items before it first (and keeping them for their own Fs). A rank whose
``forward_step_func`` never calls ``next`` (Megatron-LM's middle stages) reads nothing, as
under Megatron.

Gradient synchronisation follows Megatron's 1F1B: ``no_sync_func`` is entered for the
step and left right before this rank's last backward (with a ``grad_sync_func``, only on
pipeline rank 0; the others call ``grad_sync_func(model.parameters())`` after their last
backward), then ``finalize_model_grads_func([model], num_tokens or None, ...)``. With the
hint ``"1f1b"`` and ``policy="strict"`` the tasks run in Megatron's order and the gradients
are bitwise Megatron's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PlanError
from .._pytree import map_tensors
from .._tasks import StepPlan, Task, Topology
from ..distributed._layout import ProcessLayout, build_groups
from ..distributed._stage import DEFAULT_STEP_TIMEOUT, DistributedStage
from ..distributed._torch_executor import TorchStageExecutor
from ..loop._executors import TaskContext
from ..loop._records import StepStats
from ..policies._schedule import StepSchedule

__all__ = ["MegatronForwardBackward", "get_forward_backward_func"]

_REFUSED_CONFIG = {
    "num_microbatches_with_partial_activation_checkpoints": (
        "partial activation checkpointing per microbatch (its window is 1F1B's in-flight count)"
    ),
    "defer_embedding_wgrad_compute": "deferred embedding weight-gradient compute",
    "fine_grained_activation_offloading": "fine-grained activation offloading",
}


class _InOrder:
    """``data_iterator`` read in microbatch order, whatever order the Fs ask in."""

    def __init__(self, source: Iterator[Any] | None) -> None:
        self.source = source
        self.items: dict[int, Any] = {}
        self.read = 0
        self.lock = threading.Lock()

    def item(self, m: int) -> Any:
        assert self.source is not None
        with self.lock:
            while self.read <= m:
                self.items[self.read] = next(self.source)
                self.read += 1
            return self.items.pop(m)


class _OneItem:
    """The iterator one F's ``forward_step_func`` gets: its own microbatch, once."""

    __slots__ = ("_done", "_mb", "_src")

    def __init__(self, src: _InOrder, mb: int) -> None:
        self._src, self._mb, self._done = src, mb, False

    def __iter__(self) -> _OneItem:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise PlanError(
                f"microbatch {self._mb}: forward_step_func called next(data_iterator) twice;"
                " the readiness-first schedule gives each microbatch's forward exactly one"
                " item of the data iterator (one next() per microbatch, as Megatron's"
                " get_batch does)"
            )
        self._done = True
        return self._src.item(self._mb)


class _Microbatch:
    """What ``ctx.microbatches[m]`` holds: microbatch ``m``'s data iterator."""

    __slots__ = ("iterator", "mb")

    def __init__(self, src: _InOrder, mb: int) -> None:
        self.mb = mb
        self.iterator: Iterator[Any] | None = None if src.source is None else _OneItem(src, mb)


class _Call:
    """One call's arguments, read by the executor's tasks."""

    def __init__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        config: Any,
        forward_only: bool,
        collect_non_loss_data: bool,
        first_val_step: bool | None,
        grad_enabled: bool,
        cp_size: int,
        pp_rank: int,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.config = config
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.grad_enabled = grad_enabled
        self.cp_size = cp_size
        self.pp_rank = pp_rank
        self.store: dict[int, list[Any]] = {}
        self.num_tokens: dict[int, torch.Tensor] = {}
        self.backwards = 0
        self.no_sync: contextlib.AbstractContextManager[Any] | None = None

    def disable_grad_sync(self) -> None:
        if self.no_sync is None and self.config.no_sync_func is not None:
            self.no_sync = self.config.no_sync_func()
            self.no_sync.__enter__()

    def enable_grad_sync(self) -> None:
        ctx, self.no_sync = self.no_sync, None
        if ctx is not None:
            ctx.__exit__(None, None, None)


class _MegatronExecutor(TorchStageExecutor):
    """F = Megatron's ``forward_step``, B = Megatron's ``backward_step``, on the compute
    thread of ``TorchStageExecutor`` (whose task dispatch, step bookkeeping and failure
    handling it keeps)."""

    def __init__(self, model: Any, stage: int, rank: int) -> None:
        # Megatron's randomness stays Megatron's: its CUDA RNG tracker's named streams carry
        # on from call to call (a per-task stream of the default generator alone would
        # change its dropout masks and still leave the tracker's in dispatch order).
        super().__init__({stage: model}, None, rank=rank, task_rng=False)
        self.call: _Call | None = None
        # (stage, mb) -> (input tensor, output tensor) as Megatron's 1F1B keeps them
        self._mstash: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._handlers["F"] = self._mforward
        self._handlers["B"] = self._mbackward

    def _begin_step(self, ctx: TaskContext) -> None:
        if self._failed_step == self._step:
            self._mstash.clear()
        if self._mstash:
            raise PlanError(
                f"rank {ctx.rank}: step {self._step} left activations {sorted(self._mstash)}"
            )
        super()._begin_step(ctx)

    def _mforward(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        from megatron.core.pipeline_parallel.schedules import (
            check_first_val_step,
            deallocate_output_tensor,
            forward_step,
        )

        call = self.call
        assert call is not None
        model = self.modules[task.stage]
        mb: _Microbatch = ctx.microbatches[task.mb]
        first, last = task.stage == 0, self._is_last(task, ctx)
        # Megatron's receive buffers want grad: the received activation is such a leaf.
        input_tensor = None if first else map_tensors(data, _received)
        store: list[Any] = []
        with torch.set_grad_enabled(call.grad_enabled):
            output_tensor, num_tokens = forward_step(
                call.forward_step_func,
                mb.iterator,
                model,
                ctx.plan.microbatches,
                input_tensor,
                store,
                call.config,
                call.cp_size,
                collect_non_loss_data=call.collect_non_loss_data,
                is_first_microbatch=check_first_val_step(
                    call.first_val_step, call.forward_only, task.mb == 0
                ),
                current_microbatch=task.mb,
                is_last_stage=last,
            )
        call.store[task.mb] = store
        call.num_tokens[task.mb] = num_tokens
        out = None if last else map_tensors(output_tensor, _sendable)
        if not call.forward_only:
            self._mstash[(task.stage, task.mb)] = (input_tensor, output_tensor)
            if not last and isinstance(output_tensor, torch.Tensor):
                # The message keeps its storage (a detached alias); the stashed output's is
                # freed as Megatron frees it (the backward then needs only its graph).
                deallocate_output_tensor(output_tensor, call.config.deallocate_pipeline_outputs)
        return out

    def _mbackward(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        from megatron.core.pipeline_parallel.schedules import backward_step
        from megatron.core.utils import get_model_type

        call = self.call
        assert call is not None
        input_tensor, output_tensor = self._mstash.pop((task.stage, task.mb))
        call.backwards += 1
        if call.backwards == ctx.plan.microbatches and (
            call.config.grad_sync_func is None or call.pp_rank == 0
        ):
            call.enable_grad_sync()  # the last backward launches the grad reduction
        model = self.modules[task.stage]
        with torch.enable_grad():
            gx = backward_step(
                input_tensor, output_tensor, grad, get_model_type(model), call.config
            )
        return None if task.stage == 0 else gx


def _received(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def _sendable(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.requires_grad else t.detach()


def _megatron_layout() -> tuple[ProcessLayout, int, int]:
    """This rank's ``ProcessLayout`` from ``megatron.core.parallel_state`` and its CP size
    and PP rank (a grid ``[dp][pp][tp]`` of global ranks; every rank all-gathers its
    coordinates once when the world is more than one pipeline)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise PlanError(
            "megatron.core.parallel_state is not initialized: call"
            " parallel_state.initialize_model_parallel(...) before the first step"
        )
    pp = ps.get_pipeline_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    if cp != 1:
        raise PlanError(
            f"context parallelism (context_parallel_size={cp}) is not supported by the"
            " readiness-first get_forward_backward_func"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if pp * tp * dp != world:
        raise PlanError(
            f"the world of {world} ranks is not PP x TP x DP = {pp} x {tp} x {dp}: not"
            " supported by the readiness-first get_forward_backward_func"
        )
    pp_rank = ps.get_pipeline_model_parallel_rank()
    if world == pp:
        grid = (
            tuple(
                (dist.get_global_rank(ps.get_pipeline_model_parallel_group(), i),)
                for i in range(pp)
            ),
        )
        return ProcessLayout(pp=pp, rank=rank, grid=grid), cp, pp_rank
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(
        [ps.get_data_parallel_rank(), pp_rank, ps.get_tensor_model_parallel_rank(), rank],
        dtype=torch.int64,
        device=device,
    )
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    cells: dict[tuple[int, int, int], int] = {}
    for r in rows:
        d, p, t, g = (int(x) for x in r.tolist())
        cells[(d, p, t)] = g
    grid3 = tuple(
        tuple(tuple(cells[(d, p, t)] for t in range(tp)) for p in range(pp)) for d in range(dp)
    )
    return ProcessLayout(pp=pp, tp=tp, dp=dp, rank=rank, grid=grid3), cp, pp_rank


def _pg_collection() -> Any:
    """The process groups Megatron's 1F1B hands ``finalize_model_grads_func``."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = ps.get_tensor_model_parallel_group()
    pgc.pp = ps.get_pipeline_model_parallel_group()
    pgc.embd = ps.get_embedding_group(check_initialized=False)
    pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pgc.cp = ps.get_context_parallel_group()
    pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc


class MegatronForwardBackward:
    """The function ``get_forward_backward_func()`` returns: call it as Megatron's.

    It keeps one ``rr.DistributedStage`` (and its p2p group) open from its first call on;
    ``close()`` closes it (call it before ``dist.destroy_process_group()``; the object can be
    called again afterwards and opens a new one).
    """

    def __init__(
        self,
        *,
        policy: Any = "readiness_first",
        hint: Any = "1f1b",
        memory_factor: float | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        **stage_kwargs: Any,
    ) -> None:
        self.policy = policy
        self.hint = hint
        self.memory_factor = memory_factor
        self.step_timeout = step_timeout
        self.stage_kwargs = stage_kwargs
        self.last_stats: StepStats | None = None
        self._rr: DistributedStage | None = None
        self._executor: _MegatronExecutor | None = None
        self._base: StepSchedule | None = None
        self._pp_rank = 0
        self._cp = 1

    def __call__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list[Any]:
        """One step of ``num_microbatches`` microbatches, as Megatron's
        ``forward_backward_pipelining_without_interleaving``.

        ``seq_length``, ``micro_batch_size``, ``decoder_seq_length`` and
        ``adjust_tensor_shapes_fn`` are accepted and ignored (activations carry their
        shapes).

        Returns:
            The loss dicts (what each ``loss_func`` returned last) in microbatch order on
            the last pipeline stage, ``[]`` elsewhere (with ``collect_non_loss_data``, what
            ``loss_func(output, non_loss_data=True)`` returned).

        Raises:
            PlanError: A feature this adapter does not support, named: a list of several
                model chunks (interleaved), custom ``p2p_communicator`` / ``pg_collection``,
                context parallelism, ``collect_non_loss_data`` in a training step, partial
                activation checkpointing, deferred embedding wgrad, activation offloading;
                or bad values.
            StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        del seq_length, micro_batch_size, decoder_seq_length, adjust_tensor_shapes_fn
        model = self._one_chunk(model, "model")
        data_iterator = self._one_chunk(data_iterator, "data_iterator")
        if p2p_communicator is not None or pg_collection is not None:
            named = [
                n
                for n, v in (
                    ("p2p_communicator", p2p_communicator),
                    ("pg_collection", pg_collection),
                )
                if v is not None
            ]
            raise PlanError(
                f"{' and '.join(named)}: custom process groups are not supported by the"
                " readiness-first get_forward_backward_func (it reads"
                " megatron.core.parallel_state)"
            )
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
            raise PlanError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
        if num_microbatches < 1:
            raise PlanError(f"num_microbatches must be an int >= 1, got {num_microbatches}")
        from megatron.core.utils import get_model_config

        config = get_model_config(model)
        for attr, what in _REFUSED_CONFIG.items():
            if getattr(config, attr, None):
                raise PlanError(
                    f"config.{attr}: {what} is not supported by the readiness-first"
                    " get_forward_backward_func"
                )
        if collect_non_loss_data and not forward_only:
            raise PlanError(
                "collect_non_loss_data=True in a training step (forward_only=False) is not"
                " supported by the readiness-first get_forward_backward_func"
            )
        stage = self._open(model)
        executor = self._executor
        assert executor is not None and self._base is not None
        call = _Call(
            forward_step_func=forward_step_func,
            config=config,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
            grad_enabled=torch.is_grad_enabled() or not forward_only,
            cp_size=self._cp,
            pp_rank=self._pp_rank,
        )
        executor.modules[self._pp_rank] = model
        executor.call = call
        src = _InOrder(data_iterator)
        mbs = [_Microbatch(src, m) for m in range(num_microbatches)]
        call.disable_grad_sync()
        try:
            stats = stage.run_step_sync(
                mbs,
                schedule=self._base.for_microbatches(num_microbatches),
                train=not forward_only,
            )
        except BaseException:
            call.enable_grad_sync()
            raise
        finally:
            executor.call = None
        self.last_stats = stats
        # Megatron leaves no_sync entered after a forward-only step; it is closed here.
        call.enable_grad_sync()
        if not forward_only:
            if config.grad_sync_func is not None and self._pp_rank != 0:
                config.grad_sync_func(model.parameters())
            if config.finalize_model_grads_func is not None:
                total = torch.zeros([], dtype=torch.int, device=_device())
                for m in range(num_microbatches):  # Megatron's sum, in microbatch order
                    total += call.num_tokens[m].to(total.device)
                config.finalize_model_grads_func(
                    [model],
                    total if config.calculate_per_token_loss else None,
                    pg_collection=_pg_collection(),
                    force_all_reduce=force_all_reduce,
                )
        return [x for m in range(num_microbatches) for x in call.store.get(m, [])]

    @staticmethod
    def _one_chunk(x: Any, name: str) -> Any:
        if isinstance(x, list):
            if len(x) != 1:
                raise PlanError(
                    f"{name} is a list of {len(x)} model chunks: the interleaved (virtual"
                    " pipeline) schedule is not supported by the readiness-first"
                    " get_forward_backward_func yet; pass one chunk per rank"
                )
            return x[0]
        return x

    def _open(self, model: Any) -> DistributedStage:
        if self._rr is not None:
            return self._rr
        from megatron.core import parallel_state as ps

        vp = ps.get_virtual_pipeline_model_parallel_world_size()
        if vp is not None and vp > 1:
            raise PlanError(
                f"virtual_pipeline_model_parallel_size={vp}: the interleaved (virtual"
                " pipeline) schedule is not supported by the readiness-first"
                " get_forward_backward_func yet"
            )
        layout, self._cp, self._pp_rank = _megatron_layout()
        topology = Topology(stages=layout.pp)
        plan = StepPlan(topology=topology, microbatches=1)
        self._base = StepSchedule.build(plan, self.hint, memory_factor=self.memory_factor)
        self._executor = _MegatronExecutor(model, layout.pp_rank, dist.get_rank())
        kwargs: dict[str, Any] = {"check_ties": False}  # finalize_model_grads reduces ties
        kwargs.update(self.stage_kwargs)
        stage = DistributedStage(
            layout,
            self._base,
            self._executor,
            groups=build_groups(layout),
            policy=self.policy,
            step_timeout=self.step_timeout,
            **kwargs,
        )
        stage.__enter__()
        self._rr = stage
        return stage

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread) and compute thread."""
        stage, self._rr = self._rr, None
        if stage is not None:
            stage.__exit__(None, None, None)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()

    def __enter__(self) -> MegatronForwardBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_CACHE: dict[tuple[Any, ...], MegatronForwardBackward] = {}


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    *,
    policy: Any = "readiness_first",
    hint: Any = "1f1b",
    memory_factor: float | None = None,
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
    **stage_kwargs: Any,
) -> MegatronForwardBackward:
    """The readiness-first forward-backward function, called as Megatron's.

    Megatron-LM calls ``get_forward_backward_func()`` at every training step: the same
    keywords give the same function object (and so the same open stage and p2p group).

    Args:
        pp_size: Megatron's argument: accepted; the pipeline size comes from
            ``parallel_state`` (and must match it when given).
        vp_size: Megatron's argument: only None or 1 (the interleaved schedule is refused).
        policy: The dispatch policy (default ``readiness_first``; ``strict`` runs the hint's
            order as Megatron does).
        hint: The hint (default ``"1f1b"``: Megatron's non-interleaved order).
        memory_factor: Scale of the admission bound (default: what 1F1B holds).
        step_timeout: Seconds a step may take before every rank fails it (None: no limit).
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``observer``, ...).

    Returns:
        A ``MegatronForwardBackward``: call it with Megatron's keywords; ``close()`` it
        before ``dist.destroy_process_group()``.

    Raises:
        PlanError: ``vp_size`` > 1, or a ``pp_size`` other than ``parallel_state``'s.
    """
    if vp_size is not None and vp_size > 1:
        raise PlanError(
            f"vp_size={vp_size}: the interleaved (virtual pipeline) schedule is not supported"
            " by the readiness-first get_forward_backward_func yet"
        )
    if pp_size is not None:
        from megatron.core import parallel_state as ps

        have = ps.get_pipeline_model_parallel_world_size()
        if pp_size != have:
            raise PlanError(f"pp_size={pp_size}, but parallel_state's pipeline size is {have}")
    key = (
        _key(policy),
        _key(hint),
        memory_factor,
        step_timeout,
        tuple(sorted((k, _key(v)) for k, v in stage_kwargs.items())),
    )
    fb = _CACHE.get(key)
    if fb is None:  # a closed one is reused: it opens again at its next call
        fb = _CACHE[key] = MegatronForwardBackward(
            policy=policy,
            hint=hint,
            memory_factor=memory_factor,
            step_timeout=step_timeout,
            **stage_kwargs,
        )
    return fb


def _key(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v
