"""megatron-core's ``get_forward_backward_func()`` over the readiness-first runtime
(``rr.megatron``).

A Megatron training script switches by one line::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from rrfp_async.megatron import get_forward_backward_func

and keeps the rest: its ``forward_step_func(data_iterator, model)`` returning ``(output,
loss_func)``, its model (wrapped in Megatron's DDP / ``Float16Module`` or not; a list of
model chunks for the interleaved, virtual-pipeline schedule), its ``TransformerConfig``
(``no_sync_func``, ``grad_sync_func``, ``param_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``, ``calculate_per_token_loss``, ``microbatch_group_size_per_vp_stage``),
its process groups (``parallel_state``, or Megatron-Bridge's ``p2p_communicator=`` and
``pg_collection=``), the keyword-only call and the returned list of loss dicts (last
pipeline stage; ``[]`` elsewhere). The factory and the function it returns take exactly the
arguments of the installed megatron-core's (read off its code: 0.16 and 0.19 differ), and
``inspect.signature`` shows them.

Design note
-----------
Megatron's schedules interleave their own p2p calls with ``forward_step`` and
``backward_step`` in one fixed order. The adapter keeps the two compute halves and replaces
the order: each ``F`` task calls Megatron's own ``forward_step`` (so ``set_input_tensor``,
autocast, ``set_current_microbatch``, the loss function's two- or three-tuple, the division
by the number of microbatches or the per-token path, the MoE/MTP loss scales are Megatron's
code, not a copy) and each ``B`` task Megatron's own ``backward_step`` (``grad_scale_func`` on
the last stage, the input tensor's gradient), called as the installed version's schedules
call them. What travels between stages, and when, is the runtime's: every activation carries
its own shape (``seq_length``, ``micro_batch_size``, ``decoder_seq_length``,
``variable_seq_lengths`` and a non-interleaved ``adjust_tensor_shapes_fn`` are not needed)
on a p2p group of its own.

The hint is Megatron's own order of the schedule its ``get_forward_backward_func`` would
have picked (``megatron_order``: 1F1B, or interleaved over ``len(model)`` chunks with
megatron's stage placement, chunk ``c`` of pipeline rank ``r`` = virtual stage ``c * P +
r``); readiness-first departs from it only when a later task is ready first. With
``policy="strict"`` the tasks run in Megatron's order and parameters and losses are bitwise
Megatron's.

Data is read in microbatch order whatever order the tasks run in: the F of microbatch ``m``
on chunk ``c`` gets an iterator whose ``next()`` returns the ``m``-th item of chunk ``c``'s
data iterator, reading the items before it first (and keeping them for their own Fs). A
rank whose ``forward_step_func`` never calls ``next`` (Megatron-LM's middle stages) reads
nothing, as under Megatron.

Gradient synchronisation follows Megatron's schedules, with "the last backward" read as the
last one this rank *runs* (under strict, Megatron's): ``no_sync_func`` (one, or one per
chunk) is entered for the step. Without interleaving it is left right before the last
backward (with a ``grad_sync_func``, only on pipeline rank 0; the others call
``grad_sync_func(model.parameters())`` after their last backward). Interleaved, it is left
around each chunk's last backward (without a ``grad_sync_func``), or each chunk's
``grad_sync_func`` runs right after that chunk's last backward; then it is left for good and
the chunks not yet synchronised are. A chunk's last backward depends on every other backward
of the chunk and on the next chunk's, so on every rank the chunks complete in the order
``V-1 .. 0`` whatever the dispatch: the data-parallel collectives these launch match across
replicas. Interleaved training steps first call every chunk's ``param_sync_func`` in chunk
order (Megatron calls chunks 0 and 1 there and later chunks just before their first
forward). Then ``finalize_model_grads_func(model chunks, num_tokens or None,
pg_collection=..., force_all_reduce=...)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._costs import Durations
from .._errors import PlanError
from .._pytree import map_tensors
from .._tasks import StepPlan, Task, Topology
from ..distributed._dist_stage import DEFAULT_STEP_TIMEOUT, DistributedStage
from ..distributed._layout import build_groups
from ..distributed._torch_executor import TorchStageExecutor
from ..loop._executors import TaskContext
from ..loop._records import StepStats
from ..policies._schedule import StepSchedule
from ._megatron_groups import CallGroups, call_groups, layout_of
from ._megatron_peer import MegatronPeer, megatron_order, peer

__all__ = ["MegatronForwardBackward", "get_forward_backward_func"]

_WHO = "the readiness-first get_forward_backward_func"

# config attribute -> (is it on?, what it is): megatron features whose schedule differs.
_REFUSED_CONFIG: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_microbatches_with_partial_activation_checkpoints": (
        lambda v: v is not None,
        "partial activation checkpointing per microbatch (its window is 1F1B's in-flight count)",
    ),
    "defer_embedding_wgrad_compute": (bool, "deferred embedding weight-gradient compute"),
    "fine_grained_activation_offloading": (bool, "fine-grained activation offloading"),
    "overlap_moe_expert_parallel_comm": (
        bool,
        "the combined 1F1B schedule (MoE expert-parallel communication overlap)",
    ),
    "moe_paged_stash": (bool, "the MoE paged stash"),
    "cuda_graph_impl": (lambda v: v == "local", "local CUDA graphs (cuda_graph_impl='local')"),
}

# The call's keywords this adapter serves (what megatron's schedules take, 0.16 - 0.19).
_SERVED = frozenset(
    {
        "forward_step_func",
        "data_iterator",
        "model",
        "num_microbatches",
        "seq_length",
        "micro_batch_size",
        "decoder_seq_length",
        "forward_only",
        "collect_non_loss_data",
        "first_val_step",
        "adjust_tensor_shapes_fn",
        "p2p_communicator",
        "pg_collection",
        "force_all_reduce",
    }
)


class _InOrder:
    """One chunk's ``data_iterator`` read in microbatch order, whatever order the Fs ask in."""

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
    """What ``ctx.microbatches[m]`` holds: microbatch ``m``'s data iterator of each chunk."""

    __slots__ = ("iterators", "mb")

    def __init__(self, sources: Sequence[_InOrder], mb: int) -> None:
        self.mb = mb
        self.iterators: list[Iterator[Any] | None] = [
            None if s.source is None else _OneItem(s, mb) for s in sources
        ]


def _per_chunk(fn: Any, chunks: int) -> list[Any]:
    """A config hook given once or once per chunk (megatron accepts both)."""
    return list(fn) if isinstance(fn, (list, tuple)) else [fn] * chunks


class _Call:
    """One call's arguments and gradient-sync state, read by the executor's tasks."""

    def __init__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        config: Any,
        models: list[Any],
        microbatches: int,
        forward_only: bool,
        collect_non_loss_data: bool,
        first_val_step: bool | None,
        cp_size: int,
        pp_rank: int,
        pp: int,
        interleaved: bool,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.config = config
        self.models = models
        self.microbatches = microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.grad_enabled = torch.is_grad_enabled() or not forward_only
        self.cp_size = cp_size
        self.pp_rank = pp_rank
        self.pp = pp
        self.interleaved = interleaved
        self.store: dict[int, list[Any]] = {}
        self.num_tokens: dict[tuple[int, int], torch.Tensor] = {}
        self.backwards = [0] * len(models)  # per chunk
        self.synced: set[int] = set()
        self.grad_sync = (
            None
            if config.grad_sync_func is None
            else _per_chunk(config.grad_sync_func, len(models))
        )
        # As megatron: no no_sync_func is a null context (so "sync disabled" is tracked).
        self._no_sync_func = config.no_sync_func or contextlib.nullcontext
        self.no_sync: contextlib.AbstractContextManager[Any] | None = None

    def disable_grad_sync(self) -> None:
        f = self._no_sync_func
        if self.no_sync is None:
            if isinstance(f, (list, tuple)):  # one per chunk: megatron's multi_no_sync
                stack = contextlib.ExitStack()
                for g in f:
                    stack.enter_context(g())
                self.no_sync = stack
            else:
                self.no_sync = f()
                self.no_sync.__enter__()

    def enable_grad_sync(self) -> None:
        ctx, self.no_sync = self.no_sync, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def backward(self, chunk: int, run: Callable[[], Any]) -> Any:
        """Run one backward of ``chunk`` with megatron's gradient-sync moves around it."""
        self.backwards[chunk] += 1
        last = self.backwards[chunk] == self.microbatches
        if not self.interleaved:
            if last and (self.grad_sync is None or self.pp_rank == 0):
                self.enable_grad_sync()  # the last backward launches the grad reduction
            return run()
        if last and self.grad_sync is None:
            self.enable_grad_sync()
            self.synced.add(chunk)
        out = run()
        if last and self.grad_sync is not None:
            self.enable_grad_sync()
            self.grad_sync[chunk](self.models[chunk].parameters())
            self.synced.add(chunk)
        self.disable_grad_sync()
        return out

    def finish_grad_sync(self) -> None:
        """After the step's last backward: megatron's final moves."""
        if not self.interleaved:
            was_disabled = self.no_sync is not None
            self.enable_grad_sync()
            if was_disabled and self.grad_sync is not None:
                self.grad_sync[0](self.models[0].parameters())
            return
        self.enable_grad_sync()
        if self.grad_sync is not None:
            for c in range(len(self.models)):
                if c not in self.synced:
                    self.grad_sync[c](self.models[c].parameters())
                    self.synced.add(c)


class _MegatronExecutor(TorchStageExecutor):
    """F = Megatron's ``forward_step``, B = Megatron's ``backward_step``, on the compute
    thread of ``TorchStageExecutor`` (whose task dispatch, step bookkeeping and failure
    handling it keeps)."""

    def __init__(self, modules: dict[int, Any], peer: MegatronPeer, rank: int) -> None:
        # Megatron's randomness stays Megatron's: its CUDA RNG tracker's named streams carry
        # on from call to call (a per-task stream of the default generator alone would
        # change its dropout masks and still leave the tracker's in dispatch order).
        super().__init__(modules, None, rank=rank, task_rng=False)
        self.peer = peer
        self.call: _Call | None = None
        # (stage, mb) -> (input tensor, output tensor) as Megatron's schedules keep them
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
        s = self.peer.schedules
        call = self.call
        assert call is not None
        model = self.modules[task.stage]
        chunk = task.stage // call.pp
        mb: _Microbatch = ctx.microbatches[task.mb]
        first, last = task.stage == 0, self._is_last(task, ctx)
        # Megatron's receive buffers want grad: the received activation is such a leaf.
        input_tensor = None if first else map_tensors(data, _received)
        store: list[Any] = []
        # As megatron's schedules call it: the interleaved one names the chunk (vp_stage).
        extra = {"vp_stage": chunk} if call.interleaved else {}
        with torch.set_grad_enabled(call.grad_enabled):
            output_tensor, num_tokens = s.forward_step(
                call.forward_step_func,
                mb.iterators[chunk],
                model,
                ctx.plan.microbatches,
                input_tensor,
                store,
                call.config,
                call.cp_size,
                collect_non_loss_data=call.collect_non_loss_data,
                is_first_microbatch=s.check_first_val_step(
                    call.first_val_step, call.forward_only, task.mb == 0
                ),
                current_microbatch=task.mb,
                is_last_stage=last,
                **extra,
            )
        if store:
            call.store[task.mb] = store
        call.num_tokens[(task.stage, task.mb)] = num_tokens
        out = None if last else map_tensors(output_tensor, _sendable)
        if not call.forward_only:
            self._mstash[(task.stage, task.mb)] = (input_tensor, output_tensor)
            if not last and isinstance(output_tensor, torch.Tensor):
                # The message keeps its storage (a detached alias); the stashed output's is
                # freed as Megatron frees it (the backward then needs only its graph).
                s.deallocate_output_tensor(output_tensor, call.config.deallocate_pipeline_outputs)
        return out

    def _mbackward(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        call = self.call
        assert call is not None
        input_tensor, output_tensor = self._mstash.pop((task.stage, task.mb))
        model = self.modules[task.stage]

        def run() -> Any:
            with torch.enable_grad():
                return self.peer.backward_step(
                    input_tensor, output_tensor, grad, call.config, model
                )

        gx = call.backward(task.stage // call.pp, run)
        return None if task.stage == 0 else gx


def _received(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def _sendable(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.requires_grad else t.detach()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class MegatronForwardBackward:
    """The function ``get_forward_backward_func()`` returns: call it as Megatron's.

    Its keywords are those of the installed megatron-core's
    ``forward_backward_pipelining_without_interleaving`` (or ``_with_interleaving``, when
    the factory picked the interleaved schedule); ``inspect.signature`` shows them.

    It keeps one ``rr.DistributedStage`` (and its p2p group) open from its first call on,
    for the pipeline it was first called with; ``close()`` closes it (call it before
    ``dist.destroy_process_group()``; the object can be called again afterwards and opens a
    new one).

    Attributes:
        interleaved: The interleaved (virtual pipeline) schedule: ``model`` is a list of
            chunks.
        last_stats: The runtime's ``StepStats`` of the last call on this rank.
    """

    def __init__(
        self,
        *,
        interleaved: bool,
        pp_size: int | None,
        vp_size: int | None,
        policy: Any = "readiness_first",
        hint: Any = None,
        memory_factor: float | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        durations: Callable[[StepPlan], Durations] | None = None,
        **stage_kwargs: Any,
    ) -> None:
        self.peer = peer()
        self.interleaved = interleaved
        self.pp_size = pp_size
        self.vp_size = vp_size
        self.policy = policy
        self.hint = hint
        self.memory_factor = memory_factor
        self.step_timeout = step_timeout
        self.durations = durations
        self.stage_kwargs = stage_kwargs
        self.last_stats: StepStats | None = None
        self._signature = self.peer.interleaved if interleaved else self.peer.one_f_one_b
        self.__signature__ = self._signature
        self._fn_name = (
            "forward_backward_pipelining_with_interleaving"
            if interleaved
            else "forward_backward_pipelining_without_interleaving"
        )
        self._rr: DistributedStage | None = None
        self._executor: _MegatronExecutor | None = None
        self._key: Any = None
        self._pp_rank = 0
        self._schedules: dict[tuple[Topology, int, int, bool], StepSchedule] = {}

    # ------------------------------------------------------------------ the call

    def __call__(self, **kwargs: Any) -> list[Any]:
        """One step of ``num_microbatches`` microbatches, as megatron's schedule.

        Keywords: exactly those of the installed megatron-core's schedule function
        (``forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data,
        first_val_step, adjust_tensor_shapes_fn, p2p_communicator, pg_collection,
        force_all_reduce`` in 0.16 - 0.19). ``seq_length``, ``micro_batch_size`` and
        ``decoder_seq_length`` are accepted and not needed (activations carry their
        shapes); so is ``adjust_tensor_shapes_fn`` without interleaving.

        Returns:
            The loss dicts (what each ``loss_func`` returned last) in microbatch order on
            the last pipeline stage, ``[]`` elsewhere (with ``collect_non_loss_data``, what
            ``loss_func(output, non_loss_data=True)`` returned).

        Raises:
            PlanError: A keyword megatron's function does not take, or a required one
                missing (naming it and the megatron-core version); a feature this adapter
                does not support, named: context parallelism, a multi-module (cross-grid)
                collection, ``collect_non_loss_data`` in a training step, partial activation
                checkpointing, deferred embedding wgrad, activation offloading, the combined
                MoE 1F1B, local CUDA graphs, an interleaved ``adjust_tensor_shapes_fn``;
                model chunks that do not match the schedule; megatron's interleaved
                microbatch constraints; or bad values.
            StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        try:
            bound = self._signature.bind(**kwargs)
        except TypeError as e:
            raise PlanError(f"{self.peer.name}'s {self._fn_name}: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        for name, param in self._signature.parameters.items():
            if name not in _SERVED and a.get(name, param.default) is not param.default:
                raise PlanError(
                    f"{name}: {self.peer.name}'s {self._fn_name} keyword {name}= is not"
                    f" supported by {_WHO}"
                )
        m = a["num_microbatches"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PlanError(f"num_microbatches must be an int >= 1, got {m!r}")
        models, iterators = self._chunks(a["model"], a["data_iterator"])
        from megatron.core.utils import get_model_config

        config = get_model_config(models[0])
        forward_only = bool(a["forward_only"])
        self._check_config(config, models, m, a, forward_only)
        groups = call_groups(self.peer, a["p2p_communicator"], a["pg_collection"])
        pp = int(groups.pp.size())
        if self.pp_size is not None and self.pp_size != pp:
            raise PlanError(
                f"get_forward_backward_func(pp_size={self.pp_size}), but the call's pipeline"
                f" group ({groups.source}) has {pp} ranks"
            )
        group = self._group_size(config, pp, m)
        topology = Topology(stages=pp, chunks=len(models))
        schedule = self._schedule(topology, m, group, forward_only)
        if self.durations is not None and not forward_only:
            schedule = schedule.with_durations(self.durations(schedule.plan))
        stage = self._open(groups, models, self._schedule(topology, m, group, False))
        executor = self._executor
        assert executor is not None
        call = _Call(
            forward_step_func=a["forward_step_func"],
            config=config,
            models=models,
            microbatches=m,
            forward_only=forward_only,
            collect_non_loss_data=bool(a["collect_non_loss_data"]),
            first_val_step=a["first_val_step"],
            cp_size=groups.cp_size,
            pp_rank=self._pp_rank,
            pp=pp,
            interleaved=self.interleaved,
        )
        executor.modules = {c * pp + self._pp_rank: mod for c, mod in enumerate(models)}
        executor.call = call
        srcs = [_InOrder(it) for it in iterators]
        mbs = [_Microbatch(srcs, i) for i in range(m)]
        timers = getattr(config, "timers", None)
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if self.interleaved and not forward_only and config.param_sync_func is not None:
            sync = _per_chunk(config.param_sync_func, len(models))
            for c, mod in enumerate(models):
                sync[c](mod.parameters())
        call.disable_grad_sync()
        try:
            stats = stage.run_step_sync(mbs, schedule=schedule, train=not forward_only)
        except BaseException:
            call.enable_grad_sync()
            raise
        finally:
            executor.call = None
        self.last_stats = stats
        # Megatron leaves no_sync entered after a forward-only step; it is closed here.
        if forward_only:
            call.enable_grad_sync()
        else:
            call.finish_grad_sync()
        if not forward_only and config.finalize_model_grads_func is not None:
            total = torch.zeros([], dtype=torch.int, device=_device())
            for key in sorted(call.num_tokens, key=lambda k: (k[1], k[0])):
                total += call.num_tokens[key].to(total.device)  # megatron's sum
            config.finalize_model_grads_func(
                models if self.interleaved else [models[0]],
                total if config.calculate_per_token_loss else None,
                pg_collection=groups.pg_collection,
                force_all_reduce=a["force_all_reduce"],
            )
        if timers is not None:
            timers("forward-backward").stop()
        return [x for i in range(m) for x in call.store.get(i, [])]

    def _chunks(self, model: Any, data_iterator: Any) -> tuple[list[Any], list[Any]]:
        """The model chunks and their data iterators, as this schedule takes them."""
        if not self.interleaved:
            one = []
            for name, x in (("model", model), ("data_iterator", data_iterator)):
                if isinstance(x, list):
                    if len(x) != 1:
                        raise PlanError(
                            f"{name} is a list of {len(x)} model chunks, but"
                            " get_forward_backward_func picked the non-interleaved schedule"
                            " (vp_size=None): pass vp_size= (or set parallel_state's"
                            " virtual_pipeline_model_parallel_size) for the interleaved one"
                        )
                    x = x[0]
                one.append(x)
            return [one[0]], [one[1]]
        if not isinstance(model, list) or not model:
            raise PlanError(
                "the interleaved (virtual pipeline) schedule takes model as a list of model"
                f" chunks, got {type(model).__name__}"
            )
        if not all(isinstance(c, torch.nn.Module) for c in model):
            raise PlanError("model must be a list of torch.nn.Module chunks")
        if not isinstance(data_iterator, list) or len(data_iterator) != len(model):
            got = len(data_iterator) if isinstance(data_iterator, list) else None
            raise PlanError(
                "the interleaved (virtual pipeline) schedule takes data_iterator as a list of"
                f" one iterator (or None) per model chunk ({len(model)}), got"
                f" {type(data_iterator).__name__}" + (f" of {got}" if got is not None else "")
            )
        if self.vp_size is not None and self.vp_size != len(model):
            raise PlanError(
                f"get_forward_backward_func(vp_size={self.vp_size}), but model has"
                f" {len(model)} chunks"
            )
        return list(model), list(data_iterator)

    def _check_config(
        self, config: Any, models: list[Any], m: int, a: dict[str, Any], forward_only: bool
    ) -> None:
        for attr, (on, what) in _REFUSED_CONFIG.items():
            if on(getattr(config, attr, None)):
                raise PlanError(f"config.{attr}: {what} is not supported by {_WHO}")
        if a["collect_non_loss_data"] and not forward_only:
            raise PlanError(
                f"collect_non_loss_data=True in a training step (forward_only=False) is not"
                f" supported by {_WHO}"
            )
        if not self.interleaved:
            return
        if a["adjust_tensor_shapes_fn"] is not None:
            raise PlanError(
                "adjust_tensor_shapes_fn with the interleaved schedule: megatron's interleaved"
                f" schedule does not take it ({self.peer.name}), nor does {_WHO}"
            )
        vp = config.virtual_pipeline_model_parallel_size
        if vp != len(models):
            raise PlanError(
                f"config.virtual_pipeline_model_parallel_size={vp}, but model has"
                f" {len(models)} chunks: megatron's interleaved schedule needs them equal"
            )
        if not self.peer.forward_takes_vp_stage:
            raise PlanError(
                f"{self.peer.name}'s forward_step takes no vp_stage: its interleaved schedule"
                f" is not supported by {_WHO}"
            )

    def _group_size(self, config: Any, pp: int, m: int) -> int:
        """``microbatch_group_size_per_vp_stage``, with megatron's interleaved constraints."""
        g = getattr(config, "microbatch_group_size_per_vp_stage", None)
        g = pp if g is None else int(g)
        if not self.interleaved:
            return pp  # megatron's 1F1B does not read it
        if g > m or g < pp:
            raise PlanError(
                f"config.microbatch_group_size_per_vp_stage={g}: megatron's interleaved"
                f" schedule needs it in [PP={pp}, M={m}] (the microbatches a virtual stage"
                " runs in a row)"
            )
        rest = m % g
        if 0 < rest < pp:
            raise PlanError(
                f"num_microbatches={m} with microbatch_group_size_per_vp_stage={g} leaves a"
                f" last group of {rest} < PP={pp}: megatron's interleaved schedule refuses it"
                " (dependency bubbles)"
            )
        return g

    # ------------------------------------------------------------------ the runtime

    def _open(self, groups: CallGroups, models: list[Any], base: StepSchedule) -> DistributedStage:
        key = (groups.key, len(models))
        if self._rr is not None:
            if key != self._key:
                raise PlanError(
                    f"this forward-backward function runs the pipeline {self._key} it was"
                    f" first called with, not {key}: close() it first, or use another"
                    " get_forward_backward_func(...) keyword set"
                )
            return self._rr
        layout = layout_of(groups)
        self._pp_rank = layout.pp_rank
        pp = layout.pp
        self._executor = _MegatronExecutor(
            {c * pp + layout.pp_rank: mod for c, mod in enumerate(models)},
            self.peer,
            dist.get_rank(),
        )
        kwargs: dict[str, Any] = {"check_ties": False}  # finalize_model_grads reduces ties
        kwargs.update(self.stage_kwargs)
        stage = DistributedStage(
            layout,
            base,
            self._executor,
            groups=build_groups(layout, tp_group=groups.tp if layout.tp > 1 else None),
            policy=self.policy,
            step_timeout=self.step_timeout,
            **kwargs,
        )
        stage.__enter__()
        self._rr, self._key = stage, key
        return stage

    def _hint_source(self, topo: Topology, group: int) -> Any:
        if self.hint is not None:
            return self.hint
        interleaved = self.interleaved

        def megatron(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
            return megatron_order(
                topo.stages, topo.chunks, plan.microbatches, group, interleaved=interleaved
            )

        megatron.__name__ = "megatron_interleaved" if interleaved else "megatron_1f1b"
        return megatron

    def _build(self, plan: StepPlan, group: int) -> StepSchedule:
        return StepSchedule.build(
            plan, self._hint_source(plan.topology, group), memory_factor=self.memory_factor
        )

    def _schedule(self, topo: Topology, m: int, group: int, forward_only: bool) -> StepSchedule:
        """This step's schedule: megatron's order for ``m`` microbatches (or the user's
        hint); forward-only steps in megatron's forward-only order. Built once per size."""
        key = (topo, m, group, forward_only)
        got = self._schedules.get(key)
        if got is None:
            plan = StepPlan(topology=topo, microbatches=m)
            if not forward_only:
                got = self._build(plan, group)
            elif self.hint is not None:
                got = self._build(plan, group).forward_only()
            else:
                fplan = StepPlan(topology=topo, microbatches=m, forward_only=True)
                order = megatron_order(
                    topo.stages,
                    topo.chunks,
                    m,
                    group,
                    interleaved=self.interleaved,
                    forward_only=True,
                )
                got = StepSchedule.build(fplan, order)
            self._schedules[key] = got
        return got

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread) and compute thread."""
        stage, self._rr, self._key = self._rr, None, None
        if stage is not None:
            stage.__exit__(None, None, None)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()

    def __enter__(self) -> MegatronForwardBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CACHE: dict[tuple[Any, ...], MegatronForwardBackward] = {}


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    schedule_pg_collection: Any = None,
    *,
    policy: Any = "readiness_first",
    hint: Any = None,
    memory_factor: float | None = None,
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
    durations: Callable[[StepPlan], Durations] | None = None,
    **stage_kwargs: Any,
) -> Any:
    """The readiness-first forward-backward function, picked as megatron's own factory
    picks its schedule.

    Megatron's arguments keep their meaning: with neither ``pp_size`` nor ``vp_size`` both
    come from ``parallel_state``; otherwise they are taken as given. ``pp_size > 1`` gives
    the interleaved (virtual pipeline) schedule when ``vp_size`` is not None, else 1F1B;
    ``pp_size == 1`` gives megatron's own ``forward_backward_no_pipelining`` (one stage:
    nothing to schedule). Megatron-LM calls the factory at every training step: the same
    arguments give the same function object (and so the same open stage and p2p group).

    Args:
        pp_size: Megatron's pipeline size (checked against the call's pipeline group).
        vp_size: Megatron's virtual pipeline size (checked against ``len(model)``).
        schedule_pg_collection: Megatron's argument where the installed megatron-core has
            it (0.19): a ``ProcessGroupCollection`` is accepted (megatron ignores it too); a
            ``MultiModuleProcessGroupCollection`` (cross-grid) is refused.
        policy: The dispatch policy (default ``readiness_first``; ``strict`` runs the hint's
            order as Megatron does).
        hint: The hint (default: megatron's own order of the picked schedule).
        memory_factor: Scale of the admission bound (default: what megatron's order holds).
        step_timeout: Seconds a step may take before every rank fails it (None: no limit).
        durations: ``plan -> rr.Durations``, called at every training call: this step's
            declared task durations (from its microbatches' sizes), so that a cost-aware
            ``hint`` (``"breadth_first_weighted"``) orders the step's heavy microbatches
            first. Every rank must return the same (megatron's middle stages read no data:
            share the sizes). Without it a cost-aware hint is cost-blind.
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``observer``, ...).

    Returns:
        A ``MegatronForwardBackward`` (call it with Megatron's keywords; ``close()`` it
        before ``dist.destroy_process_group()``), or megatron's
        ``forward_backward_no_pipelining`` when ``pp_size`` is 1.

    Raises:
        PlanError: ``schedule_pg_collection`` where megatron's factory has no such argument
            (naming the version) or a multi-module one; ``parallel_state`` not initialised
            when it is needed; ``vp_size`` without ``pp_size``.
    """
    mp = peer()
    if schedule_pg_collection is not None:
        if "schedule_pg_collection" not in mp.factory.parameters:
            raise PlanError(
                f"schedule_pg_collection: {mp.name}'s get_forward_backward_func takes no"
                " such argument (megatron-core 0.19 added it)"
            )
        mm = mp.multi_module_types()
        if mm and isinstance(schedule_pg_collection, mm):
            raise PlanError(
                f"schedule_pg_collection is a {type(schedule_pg_collection).__name__} (several"
                f" modules on separate grids, {mp.name}'s cross-grid schedule): not supported"
                f" by {_WHO}"
            )
    if pp_size is None and vp_size is None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise PlanError(
                "get_forward_backward_func() reads the pipeline sizes from"
                " megatron.core.parallel_state, which is not initialized: call"
                " initialize_model_parallel(...) first, or pass pp_size= and vp_size= (as"
                " Megatron-Bridge does)"
            )
        pp_size = ps.get_pipeline_model_parallel_world_size()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if pp_size is None:
        raise PlanError(
            f"get_forward_backward_func(vp_size={vp_size}) without pp_size: megatron takes"
            " both as given once one is"
        )
    if pp_size <= 1:
        return mp.schedules.forward_backward_no_pipelining
    interleaved = vp_size is not None
    key = (
        interleaved,
        pp_size,
        vp_size,
        _key(policy),
        _key(hint),
        memory_factor,
        step_timeout,
        _key(durations),
        tuple(sorted((k, _key(v)) for k, v in stage_kwargs.items())),
    )
    fb = _CACHE.get(key)
    if fb is None:  # a closed one is reused: it opens again at its next call
        fb = _CACHE[key] = MegatronForwardBackward(
            interleaved=interleaved,
            pp_size=pp_size,
            vp_size=vp_size,
            policy=policy,
            hint=hint,
            memory_factor=memory_factor,
            step_timeout=step_timeout,
            durations=durations,
            **stage_kwargs,
        )
    return fb


def _key(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v
