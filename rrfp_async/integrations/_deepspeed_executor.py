"""The DeepSpeed drop-in's executor: F is the engine's own forward pass, B its backward.

Each task calls the ``PipelineEngine``'s own instruction handlers (``_exec_load_micro_batch``,
``_exec_forward_pass``, ``_exec_backward_pass``) on the compute thread of
``TorchStageExecutor`` (whose task dispatch, step bookkeeping and failure handling it keeps),
so the engine's numerics stay DeepSpeed's: its input clone, its loss function and loss
scaling (by the gradient accumulation steps on the last stage, the fp16 loss scaler), the
bf16 optimizer's gradient hooks, activation checkpointing. What changes is the order and
the transport: DeepSpeed's ``Send*``/``Recv*`` instructions are the runtime's messages (a
tensor or a tuple of them, any shape each microbatch), and the engine's single-slot state is
kept per microbatch here:

* ``engine.pipe_buffers`` get one buffer per microbatch (buffer id = microbatch);
* the last stage's ``engine.loss`` (one slot in DeepSpeed, read by the next backward) is kept
  per microbatch and put back before that microbatch's backward; the received gradient
  (``engine.grad_layer``) likewise;
* the data is read in microbatch order whatever order the forwards run in (DeepSpeed's
  ``LoadMicroBatch`` reads ``data_iter`` on the first and last stages once per microbatch);
* the losses a step's forwards add up (``total_loss``, the module's additional losses,
  ``fwd_outputs``) are kept per microbatch and summed in microbatch order once the step has
  run (``fold``), as DeepSpeed's order sums them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._errors import PlanError
from .._pytree import tensor_leaves
from .._tasks import Task
from ..distributed import TorchStageExecutor
from ..loop import TaskContext
from ._deepspeed_peer import WHO
from ._draws import DrawWatch

__all__ = ["DeepSpeedExecutor"]


class DeepSpeedExecutor(TorchStageExecutor):
    """F = the engine's ``_exec_forward_pass``, B = its ``_exec_backward_pass``, on the
    compute thread of ``TorchStageExecutor``.

    Args:
        engine: The ``PipelineEngine`` (this rank's stage).
        rank: This process's global rank.
    """

    def __init__(self, engine: Any, rank: int) -> None:
        # DeepSpeed's randomness stays DeepSpeed's (its dropout draws from the global
        # generators in its own order; activation checkpointing saves and restores them).
        super().__init__(
            {int(engine.stage_id): engine.module},
            None,
            rank=rank,
            task_rng=False,
            task_handlers={"F": self._dforward, "B": self._dbackward},
        )
        self.engine = engine
        self.grad_enabled = True
        """The grad mode of the step's caller (``train_batch``: on; ``eval_batch``: off)."""
        self._ds_loaded = 0  # microbatches read from data_iter this step
        self._ds_loss: dict[int, Any] = {}  # the last stage's loss, until its backward
        self._ds_total: dict[int, Any] = {}  # each forward's share of total_loss
        self._ds_additional: dict[int, Any] = {}  # ... of total_additional_losses
        self._ds_fwd: dict[int, list[Any]] = {}  # ... of fwd_outputs
        self._ds_outputs: dict[int, Any] = {}  # eval_batch(return_logits=True)'s outputs
        self._ds_final_loss: Any = None  # the last microbatch's loss (``engine.loss`` after)
        self.draws = DrawWatch()
        """The watch of the training forwards' random draws (``_draws``: where one draws,
        learning stops and the forwards keep DeepSpeed's order)."""
        self.preloaded = 0
        """Microbatches the runner read before the step (to read their sizes), for the next
        step: its forwards read from there on."""

    def begin_step(self, ctx: TaskContext, *, previous: int | None, failed: bool) -> None:
        """Start the step's per-microbatch state afresh."""
        self._ds_loaded, self.preloaded = self.preloaded, 0
        self._ds_final_loss = None
        self._ds_loss.clear()
        self._ds_total.clear()
        self._ds_additional.clear()
        self._ds_fwd.clear()
        self._ds_outputs.clear()

    def preload(self, microbatches: int) -> list[Any]:
        """Before a step, on the calling thread: read the step's data as DeepSpeed's
        ``LoadMicroBatch`` reads it (every microbatch, in order) and return each
        microbatch's loaded input (None past a dry ``data_iter``: the forward that needs it
        raises). The step's forwards then use what was read."""
        e = self.engine
        self._ds_loaded = 0
        with contextlib.suppress(PlanError):
            self._load_through(microbatches - 1, microbatches)
        self.preloaded = self._ds_loaded
        got = [e.pipe_buffers["inputs"][k] for k in range(self._ds_loaded)]
        return got + [None] * (microbatches - len(got))

    def _load_through(self, mb: int, microbatches: int) -> None:
        e = self.engine
        while self._ds_loaded <= mb:
            k = self._ds_loaded
            try:
                e._exec_load_micro_batch(k)
            except StopIteration as ex:
                raise PlanError(
                    f"{WHO}: rank {self.rank}: data_iter ran out at microbatch {k} of"
                    f" {microbatches}: DeepSpeed's train_batch / eval_batch read"
                    " gradient_accumulation_steps items from it (on the first and last"
                    " pipeline stages) each call; give an iterator with enough items, or"
                    " wrap the loader in deepspeed.utils.RepeatingLoader"
                ) from ex
            self._ds_loaded = k + 1

    def _dforward(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        e = self.engine
        mb = task.mb
        first, last = e.is_first_stage(), e.is_last_stage()
        with torch.set_grad_enabled(self.grad_enabled):
            if first or last:
                self._load_through(mb, ctx.plan.microbatches)
            if not first:
                e.pipe_buffers["inputs"][mb] = _received(data)
            # One forward's losses alone: DeepSpeed adds each to these as it runs.
            e.fwd_outputs = []
            e.total_loss = None
            e.total_additional_losses = None
            watch = self.draws.forward() if self.grad_enabled else contextlib.nullcontext()
            meter = self.forward_meter
            if self.grad_enabled and meter.enabled:
                # What the forward keeps until its backward (``_activation_meter``): its
                # saved tensors, its received input, its output (and loss) held.
                inputs = [t for t in tensor_leaves(e.pipe_buffers["inputs"][mb]) if t.requires_grad]
                with watch, meter.forward(task.stage, task.mb, e.module, inputs) as m:
                    e._exec_forward_pass(mb)
                    held = e.loss if last else e.pipe_buffers["outputs"][mb]
                    m.hold(tensor_leaves(held))
            else:
                with watch:
                    e._exec_forward_pass(mb)
            if last:
                self._ds_loss[mb] = e.loss
                if mb == ctx.plan.microbatches - 1:
                    self._ds_final_loss = e.loss
                self._ds_total[mb] = e.total_loss
                self._ds_additional[mb] = e.total_additional_losses
                self._ds_fwd[mb] = list(e.fwd_outputs)
                if e.eval_return_logits:
                    self._ds_outputs[mb] = e.outputs
                if not self.grad_enabled:  # (no backward: the slot is not needed)
                    e.pipe_buffers["outputs"][mb] = None
                return None
            out = e.pipe_buffers["outputs"][mb]
            if not self.grad_enabled:
                e.pipe_buffers["outputs"][mb] = None
                e.pipe_buffers["inputs"][mb] = None
            return _sendable(out)

    def _dbackward(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        e = self.engine
        mb = task.mb
        if e.is_last_stage():
            e.loss = self._ds_loss.pop(mb)
        else:
            e.grad_layer = grad if isinstance(grad, torch.Tensor) else list(grad)
        with torch.enable_grad():
            e._exec_backward_pass(mb)
        e.grad_layer = None
        inputs = e.pipe_buffers["inputs"][mb]
        e.pipe_buffers["inputs"][mb] = None  # (DeepSpeed frees it after its SendGrad)
        if e.is_first_stage():
            return None
        return _input_grads(e, inputs, task)

    def fold(self, microbatches: int) -> None:
        """Put the step's losses where DeepSpeed's own step leaves them: ``total_loss``,
        ``total_additional_losses`` and ``fwd_outputs`` summed in microbatch order (the
        order DeepSpeed's forwards add them in); ``loss`` and ``outputs`` those of the last
        microbatch."""
        e = self.engine
        if not e.is_last_stage():
            e.fwd_outputs = []
            return
        total: Any = None
        additional: Any = None
        fwd: list[Any] = []
        for mb in range(microbatches):
            total = _add(total, self._ds_total.get(mb))
            extra = self._ds_additional.get(mb)
            if extra is not None:
                if additional is None:
                    additional = type(extra)()
                for name, value in extra.items():
                    additional[name] = _add(additional.get(name), value)
            fwd.extend(self._ds_fwd.get(mb, []))
        e.total_loss = total
        e.total_additional_losses = additional
        e.fwd_outputs = fwd
        if self._ds_final_loss is not None:  # (DeepSpeed's slot ends on the last one's)
            e.loss = self._ds_final_loss
            self._ds_final_loss = None
        if self._ds_outputs:
            e.outputs = self._ds_outputs[max(self._ds_outputs)]
        self._ds_total.clear()
        self._ds_additional.clear()
        self._ds_fwd.clear()
        self._ds_outputs.clear()


def _add(total: Any, share: Any) -> Any:
    """DeepSpeed's ``add_to_total_loss`` over per-forward shares (each share is ``0 + loss``,
    exact: the sum in microbatch order is DeepSpeed's, bit for bit)."""
    if share is None:
        return total
    if total is None:
        return share.clone() if isinstance(share, torch.Tensor) else [s.clone() for s in share]
    if isinstance(share, torch.Tensor):
        total += share
    else:
        for i, s in enumerate(share):
            total[i] += s
    return total


def _received(data: Any) -> Any:
    """A received activation as DeepSpeed's ``RecvActivation`` leaves it: a detached tensor
    (or tuple of them) that wants grad where it is floating point."""
    if isinstance(data, torch.Tensor):
        return data.detach().requires_grad_(data.is_floating_point())
    if isinstance(data, (tuple, list)):
        return tuple(_received(t) for t in data)
    raise PlanError(
        f"{WHO}: a stage received {type(data).__name__}: DeepSpeed's pipeline passes a"
        " tensor or a tuple of tensors between stages"
    )


def _sendable(out: Any) -> Any:
    """What a forward sends on: detached aliases (the engine's buffer keeps the graph)."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(t.detach() for t in out)
    raise PlanError(
        f"{WHO}: a stage's forward returned {type(out).__name__}: DeepSpeed's pipeline"
        " passes a tensor or a tuple of tensors between stages"
    )


def _input_grads(e: Any, inputs: Any, task: Task) -> Any:
    """What DeepSpeed's ``SendGrad`` sends for ``inputs``: the input's gradient, or those of
    a tuple's floating-point tensors (the last one dropped with an attention mask or bool
    tensors, as DeepSpeed drops it)."""
    if e.has_attention_mask or e.has_bool_tensors:
        inputs = tuple(list(inputs)[:-1])
    if isinstance(inputs, torch.Tensor):
        if inputs.grad is None:
            raise PlanError(f"{WHO}: {task}: the stage's input got no gradient")
        return inputs.grad
    grads = []
    for i, t in enumerate(inputs):
        if not t.is_floating_point():
            continue
        if t.grad is None:
            raise PlanError(
                f"{WHO}: {task}: input {i} of the stage is floating point and got no"
                " gradient (DeepSpeed's SendGrad needs one for each)"
            )
        grads.append(t.grad)
    return tuple(grads)
