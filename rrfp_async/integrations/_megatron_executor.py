"""The megatron drop-in's executor: F is Megatron's ``forward_step``, B its ``backward_step``.

The adapter keeps Megatron's two compute halves and replaces their order (the design note of
``_megatron_dropin``): each task calls Megatron's own function as the installed version's
schedules call it (the interleaved one naming the chunk, ``vp_stage``), on the compute
thread of ``TorchStageExecutor``, whose task dispatch, step bookkeeping and failure handling
it keeps. Each forward's input and output tensors are kept for its backward as Megatron's
schedules keep them (the sent output's storage freed as Megatron frees it); the gradient
sync around each backward is the call's (``_megatron_grad_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._errors import PlanError
from .._pytree import map_tensors, tensor_leaves
from .._tasks import Task
from ..distributed import TorchStageExecutor
from ..loop import TaskContext
from ._draws import DrawWatch, megatron_tracker_states
from ._megatron_data import Microbatch
from ._megatron_grad_sync import MegatronCall
from ._megatron_peer import MegatronPeer

__all__ = ["MegatronExecutor"]


class MegatronExecutor(TorchStageExecutor):
    """F = Megatron's ``forward_step``, B = Megatron's ``backward_step``, on the compute
    thread of ``TorchStageExecutor`` (whose task dispatch, step bookkeeping and failure
    handling it keeps)."""

    def __init__(
        self,
        modules: dict[int, Any],
        peer: MegatronPeer,
        rank: int,
        *,
        measure_activations: bool = False,
    ) -> None:
        # Megatron's randomness stays Megatron's: its CUDA RNG tracker's named streams carry
        # on from call to call (a per-task stream of the default generator alone would
        # change its dropout masks and still leave the tracker's in dispatch order).
        super().__init__(
            modules,
            None,
            rank=rank,
            task_rng=False,
            task_handlers={"F": self._mforward, "B": self._mbackward},
            measure_activations=measure_activations,
        )
        self.peer = peer
        self.call: MegatronCall | None = None
        self.draws = DrawWatch(megatron_tracker_states)
        """The watch of the training forwards' random draws (``_draws``: where one draws,
        learning stops and the forwards keep Megatron's order)."""
        # (stage, mb) -> (input tensor, output tensor) as Megatron's schedules keep them
        self._mstash: dict[tuple[int, int], tuple[Any, Any]] = {}

    def begin_step(self, ctx: TaskContext, *, previous: int | None, failed: bool) -> None:
        """Drop the activations a failed step kept; refuse what a finished one left."""
        if failed:
            self._mstash.clear()
        if self._mstash:
            raise PlanError(
                f"rank {ctx.rank}: step {previous} left activations {sorted(self._mstash)}"
            )

    def _mforward(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        call = self.call
        assert call is not None
        model = self.modules[task.stage]
        chunk = task.stage // call.pp
        first, last = task.stage == 0, task.stage == ctx.plan.num_virtual - 1
        # Megatron's receive buffers want grad: the received activation is such a leaf.
        input_tensor = None if first else map_tensors(data, _received)
        meter = self.forward_meter
        if call.forward_only or not meter.enabled:
            return self._mforward_body(task, input_tensor, ctx, model, chunk, first, last)
        # What the forward keeps until its backward (``_activation_meter``): its saved
        # tensors and received input, and its output where Megatron does not free it.
        inputs = [t for t in tensor_leaves(input_tensor) if t.requires_grad]
        with meter.forward(task.stage, task.mb, model, inputs) as m:
            out = self._mforward_body(task, input_tensor, ctx, model, chunk, first, last)
            m.hold(tensor_leaves(self._mstash[(task.stage, task.mb)][1]))
        return out

    def _mforward_body(
        self,
        task: Task,
        input_tensor: Any,
        ctx: TaskContext,
        model: Any,
        chunk: int,
        first: bool,
        last: bool,
    ) -> Any:
        s = self.peer.schedules
        call = self.call
        assert call is not None
        mb: Microbatch = ctx.microbatches[task.mb]
        store: list[Any] = []
        # As megatron's schedules call it: the interleaved one names the chunk (vp_stage).
        extra = {"vp_stage": chunk} if call.interleaved else {}
        training = call.grad_enabled and not call.forward_only
        watch = self.draws.forward() if training else contextlib.nullcontext()
        with torch.set_grad_enabled(call.grad_enabled), _foreign_iterator(call, task, ctx), watch:
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


@contextlib.contextmanager
def _foreign_iterator(call: MegatronCall, task: Task, ctx: TaskContext) -> Iterator[None]:
    """A ``StopIteration`` out of ``forward_step_func`` (or PEP 479's ``RuntimeError`` of a
    generator that let one out) came from an iterator it reads itself, not the
    ``data_iterator`` the task passed it (that one raises its own ``PlanError``,
    ``InOrder``): on the compute thread it would become a bare ``RuntimeError:
    StopIteration raised``. A ``PlanError`` naming the function, the microbatch and the
    count instead."""
    try:
        yield
    except (StopIteration, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not isinstance(e.__cause__, StopIteration):
            raise
        fn = call.forward_step_func
        fn = getattr(fn, "func", fn)  # (a functools.partial: the function it calls)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        m = ctx.plan.microbatches
        raised = f"{type(e).__name__}" + (f" ({e})" if str(e) else "")
        raise PlanError(
            f"rank {ctx.rank} step {ctx.step} {task}: forward_step_func {name} raised"
            f" {raised} in the forward of microbatch {task.mb} of num_microbatches={m}: an"
            " iterator it reads itself ran"
            " out, not the data_iterator argument the schedule passes it (that one is"
            " counted, and refused with its own message). Read the step's data through that"
            " argument, next(data_iterator) once per microbatch as Megatron's get_batch"
            " does (each forward then gets its own microbatch's item, whatever order the"
            " forwards run in), or give the other iterator at least num_microbatches="
            f"{m} items per forward_backward call"
        ) from e


def _received(t: torch.Tensor) -> torch.Tensor:
    """A received activation as Megatron's receive buffers hold it: a leaf wanting grad."""
    return t.detach().requires_grad_(t.is_floating_point())


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """What a forward sends on: a detached alias (the stashed output keeps the graph)."""
    return t.detach().requires_grad_(True) if t.requires_grad else t.detach()
