"""The torch stage executor: runs a stage's ``nn.Module`` chunks for F, B, I and W tasks.

Compute runs on the stage's ``ComputeWorker`` (one thread, like a GPU stream; with CUDA a
side stream awaited through its event), so the event loop keeps receiving messages while a
task computes.

Per task:

* ``F(m, v)``: input = the microbatch (first stage) or the received activation, turned into a
  leaf that requires grad; output = ``module(input)``; the last stage computes the loss
  ``loss_fn(output, microbatch) / M`` instead of returning an output. Input and output are
  stashed for the backward; the output is sent on detached.
* ``B(m, v)``: backward from the received gradient (the loss on the last stage); parameter
  gradients accumulate in ``.grad`` in the order the Bs run (floating-point summation order
  differs from a fixed order by ~1e-7); returns the input gradient.
* ``I(m, v)`` / ``W(m, v)``: the input gradient alone, then the parameter gradients from
  what ``I`` kept, without re-running the stage's backward: see ``_split_backward``.

Randomness: each ``F(m, v)`` of step ``s`` runs on the random stream of ``task_seed(seed, s,
v, m)`` (CPU and the stage's CUDA devices; see ``rrfp_async._rng``), so dropout masks do not
depend on the order the forwards run in. No backward re-runs a forward (the split backward's
fallback re-runs the *backward* of a kept graph), so the masks of a microbatch are drawn
once; a module's own activation checkpointing (``torch.utils.checkpoint``) saves the task's
stream at the forward and replays it in the recomputation.

How values cross the stage boundary (pytrees, side inputs, ties, gradient messages) is
``_stage_io``; emulated GPU time (``emulate=``, a sleep after the real compute) is
``_emulation``; timing ``B`` against ``I`` + ``W`` is lab code (``rrfp_lab._split_measure``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from .._bridges import ComputeWorker
from .._costs import Durations
from .._errors import PlanError
from .._pytree import call_module, map_tensors, tensor_leaves
from .._rng import (
    MAX_MICROBATCHES,
    MAX_STAGES,
    TASK_RNG_LOCK,
    cuda_indices,
    fork_seeded,
    step_key,
    task_key,
)
from .._streams import Device, wait_ready
from .._tasks import Task
from ..loop import OutputHook, TaskContext
from ._activation_meter import ForwardBytes
from ._call_hints import call_hint
from ._emulation import EmulatedCost
from ._executor_checks import check_modules, closed_executor
from ._nonfinite import FiniteCheck, NonFinite, NonFiniteMode
from ._split_backward import WeightWork, input_backward, weight_backward
from ._stage_io import (
    SharedSpec,
    SideInputs,
    default_input,
    detached,
    grads_in,
    grads_out,
    input_leaf,
    resolve_shared,
    sendable,
    side_inputs_of,
    validate_side_inputs,
)

__all__ = ["TaskHandler", "TokenCounted", "TorchStageExecutor"]

TaskHandler = Callable[[Task, Any, TaskContext], Any]
"""Runs one kind of task on the compute thread: ``handler(task, data, ctx)``, returning what
to send on (or None); see ``TorchStageExecutor(task_handlers=...)``."""


@runtime_checkable
class TokenCounted(Protocol):
    """Optional: a microbatch that counts its tokens (``rr.Microbatch`` does).

    With ``loss_scale="tokens"`` and no ``tokens_fn``, each microbatch's ``tokens`` (an int
    >= 0) is read when a step starts, to scale each loss by its share of the step's tokens;
    a microbatch without it is refused with a ``PlanError`` that says to pass
    ``rr.Microbatch`` objects or ``tokens_fn``. Other loss scales never read it."""

    @property
    def tokens(self) -> object:
        """The microbatch's token count."""


LossScale = Literal["microbatch", "tokens", "sum"]
"""How a step's loss is made from the microbatches' losses: ``"microbatch"``, the mean of
the microbatch losses (each ``/ M``); ``"tokens"``, weighted by each microbatch's token count
(``loss_m * tokens_m / sum(tokens)``: with per-token mean losses this is the mean over every
token of the step, what variable-length data needs); ``"sum"``, their sum (no scaling; what
torch pipelining does before it divides the gradients by M, ``scale_grads=True``)."""

_GRAD_LOCK = threading.Lock()  # W's `p.grad += g` for a parameter two compute threads share


class TorchStageExecutor:
    """Runs one rank's model chunks (one ``nn.Module`` per virtual stage).

    A stage's input and output may be any pytree of tensors (a tensor, tuple, list, dict,
    ``rr.Args``, nested, with None/bool/int/float/str leaves): the same structure reaches the
    next stage, which is called as ``module(*value)`` for a tuple, ``module(**value)`` for a
    dict with string keys, ``module(*a, **kw)`` for ``rr.Args(*a, **kw)`` and
    ``module(value)`` otherwise (the first stage's input follows the same rule, so a dict
    microbatch gives its keys as keywords). Gradients flow back for the tensor
    leaves that require grad; a stage whose parameters are frozen and whose input needs no
    grad (a frozen embedding or encoder) runs its backward as a no-op.

    Args:
        modules: Virtual stage -> module, for the stages of this rank.
        loss_fn: ``(last stage output, microbatch) -> scalar loss`` (the mean over the
            microbatch); the executor scales it (``loss_scale``). May be None for a rank
            without the last stage, and for forward-only steps (then no loss is computed).
        emulate: Optional emulated GPU time (sleeps after the real compute).
        worker: The compute thread (default: a new CPU ``ComputeWorker``).
        rank: Global rank, for per-rank emulated noise.
        input_fn: Turns a microbatch into the first stage's input (default: ``mb.data``
            for a ``Microbatch``, else the object itself); return ``rr.Args(...)`` to call
            the first module with several arguments or keywords.
        side_inputs: Per-microbatch keyword inputs read from this rank's own microbatch
            (attention mask, position ids, packed-sequence boundaries; see ``SideInputs``):
            each rank's loader provides them, nothing travels through the pipeline.
        shared: Tied parameters (``SharedSpec``): their gradients are summed over every
            place they live once per step, before the optimizer (``DistributedStage`` across
            processes, ``LocalPipeline`` in one process).
        loss_scale: ``"microbatch"`` (default), ``"tokens"`` or ``"sum"`` (see ``LossScale``).
        tokens_fn: Tokens of a microbatch for ``loss_scale="tokens"`` (default:
            ``Microbatch.tokens``).
        return_outputs: Keep the last stage's outputs of training steps too (forward-only
            steps always keep them); ``StepStats.outputs`` returns them.
        seed: The seed of the tasks' random streams: the forward of microbatch ``m`` on
            virtual stage ``v`` in step ``s`` draws from ``rr.task_rng(seed, s, v, m)``
            whatever order the forwards run in (dropout masks are then the same under every
            policy and hint). Default: the job's seed: ``torch.initial_seed()`` when the
            executor is built, replaced at the first plan check of a ``DistributedStage`` by
            that of the lowest global rank whose seed is the default too, so that every rank
            of the job draws from one seed however each process seeded torch (or not: a
            fresh process's default seed is random). A given seed is kept; the ranks of one
            TP group must agree (``DistributedStage`` checks it with the plan).
        task_rng: False: forwards draw from torch's global generators as they stand, in
            dispatch order (results with dropout then depend on that order).
        nonfinite: What a NaN or infinite loss (and, with ``check_tensors``, activation or
            gradient) gets: ``"warn"`` (default: a warning naming the rank, step, task and
            microbatch, and a record in ``nonfinite_events``), ``"raise"`` (a
            ``NonFiniteError`` from the task: the step fails on every rank) or ``"off"``.
        check_tensors: Also check every floating tensor a task sends on (one ``isfinite``
            pass per tensor; on CUDA a host sync per task). Losses are always checked
            unless ``nonfinite="off"`` (free: they are read anyway).
        task_handlers: Task kind (``"F"``, ``"B"``, ``"I"``, ``"W"``) -> the function that
            runs such a task on the compute thread, ``handler(task, data, ctx)`` returning
            what to send on, in place of the built-in one (an adapter that keeps a peer's
            own compute, as the megatron drop-in does); the executor's dispatch, random
            streams, step bookkeeping and failure handling stay.
        measure_activations: Measure the bytes each training forward keeps until its
            backward (``activation_bytes``; see ``_activation_meter``): saved-tensor hooks
            on a CPU worker, the CUDA allocator's bytes in use on a CUDA one. Off by
            default: the hooks cost a Python call per saved tensor, a large share of a tiny
            model's forward (``scripts/activation_meter_cost.py`` measures it; figures in
            docs/memory.md), and ``activation_bytes`` then stays empty.

    Raises:
        PlanError: ``modules`` is no dict of stage indices (ints >= 0) to modules (a bare
            module or a list: the message says to pass ``{0: module}``), no modules, a
            ``shared`` place that names no parameter of this rank's modules, a bad
            ``loss_scale``/``side_inputs``, a ``seed`` that is no int, or a
            ``measure_activations`` that is no bool.

    Attributes:
        losses: ``{microbatch: loss value}`` of the last step (on the last stage's rank),
            unscaled (what ``loss_fn`` returned).
        outputs: ``{microbatch: output}`` of the last step (last stage, see
            ``return_outputs``), detached.
        rng_seed: The seed of the tasks' random streams (None with ``task_rng=False``).
        nonfinite_events: The non-finite values found in the last step (``NonFinite``
            records; see ``nonfinite``).
        rng_seed_given: Whether ``seed`` was given (False: the default, agreed on by the
            job's ranks at the first plan check).
    """

    waits_for_events = True
    """Inputs are consumed through their receive's event (``_streams.wait_ready``), on the
    compute stream: the channel hands them on at once (``P2PChannel.consumer_waits``)."""

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        emulate: EmulatedCost | None = None,
        worker: ComputeWorker | None = None,
        rank: int = 0,
        input_fn: Callable[[Any], Any] = default_input,
        side_inputs: SideInputs | None = None,
        shared: SharedSpec | None = None,
        loss_scale: LossScale = "microbatch",
        tokens_fn: Callable[[Any], int] | None = None,
        return_outputs: bool = False,
        seed: int | None = None,
        task_rng: bool = True,
        nonfinite: NonFiniteMode = "warn",
        check_tensors: bool = False,
        task_handlers: Mapping[str, TaskHandler] | None = None,
        measure_activations: bool = False,
    ) -> None:
        check_modules(modules)
        if loss_scale not in ("microbatch", "tokens", "sum"):
            raise PlanError(
                f"loss_scale must be 'microbatch', 'tokens' or 'sum', got {loss_scale!r}"
            )
        side_inputs = validate_side_inputs(side_inputs)
        self.modules = dict(modules)
        self.loss_fn = loss_fn
        self.emulate = emulate
        self.worker = worker if worker is not None else ComputeWorker(name=f"rrfp-compute-{rank}")
        self.rank = rank
        self.input_fn = input_fn
        self.side_inputs = side_inputs
        self.loss_scale = loss_scale
        self.tokens_fn = tokens_fn
        self.return_outputs = return_outputs
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise PlanError(f"seed must be an int or None, got {seed!r}")
        if not isinstance(task_rng, bool):
            raise PlanError(f"task_rng must be a bool, got {task_rng!r}")
        self.rng_seed: int | None = None
        #: False: ``rng_seed`` is the default, which ``DistributedStage`` makes the job's.
        self.rng_seed_given = seed is not None
        if task_rng:
            self.rng_seed = (torch.initial_seed() if seed is None else seed) & ((1 << 64) - 1)
        self.shared_spec: dict[str, tuple[tuple[int, str], ...]] = {}
        self._shared: dict[str, list[nn.Parameter]] = {}
        if shared is not None:
            self.shared_spec, self._shared = resolve_shared(self.modules, shared)
        self._output_hook: OutputHook | None = None
        self._finite = FiniteCheck(nonfinite, check_tensors, rank)
        self._ready_device = Device(self.worker.device or "cpu")
        if not isinstance(measure_activations, bool):
            raise PlanError(f"measure_activations must be a bool, got {measure_activations!r}")
        self._meter = ForwardBytes(self._ready_device, enabled=measure_activations)
        self._failed_step: int | None = None
        self._losses: dict[int, float] = {}
        self._loss_t: dict[int, torch.Tensor] = {}  # CUDA losses, read on the host at the end
        self._loss_tasks: dict[int, Task] = {}  # (and the task of each)
        self.outputs: dict[int, Any] = {}
        self.compute_seconds = 0.0
        self.emulated_seconds = 0.0
        # (stage, mb) -> (input leaves that require grad, output leaves that require grad)
        self._stash: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._kept: dict[tuple[int, int], WeightWork] = {}
        self._param_lists: dict[int, list[nn.Parameter]] = {}
        self._cuda_lists: dict[int, tuple[int, ...]] = {}
        self._rng_key: int | None = None  # the step's step_key (None: no per-task streams)
        self._step: int | None = None
        self._total_tokens = 0
        self._durations: Durations | None = None
        self._handlers: dict[str, TaskHandler] = {
            "F": self._forward,
            "B": self._backward,
            "I": self._input_grad,
            "W": self._weight_grad,
            **(task_handlers or {}),
        }

    @property
    def nonfinite_events(self) -> list[NonFinite]:
        """The non-finite values found in the last step (see ``nonfinite``)."""
        self.losses  # noqa: B018 (on CUDA, reading the losses checks them)
        return list(self._finite.events)

    def adopt_seed(self, seed: int, /) -> None:
        """Draw the tasks' random streams from ``seed`` from the next step on: the job's
        seed, which ``DistributedStage``'s plan check gives an executor whose seed is the
        default (see ``seed``). A given seed is kept; without per-task streams
        (``task_rng=False``) there is nothing to seed."""
        if self.rng_seed is not None and not self.rng_seed_given:
            self.rng_seed = seed & ((1 << 64) - 1)

    def shared_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Tie name -> the distinct parameter objects of this executor's modules in that tie."""
        return {k: list(v) for k, v in self._shared.items()}

    def step_results(self, step: int) -> tuple[dict[int, float], dict[int, Any]]:
        """``(losses, outputs)`` of ``step`` on this rank, by microbatch (empty elsewhere)."""
        if step != self._step:
            return {}, {}
        return dict(self.losses), dict(self.outputs)

    @property
    def losses(self) -> dict[int, float]:
        """``{microbatch: loss value}`` of the last step (the last stage's rank), unscaled.
        On CUDA the values are read here, once the step's kernels completed (one host wait
        when read, none per task)."""
        if self._loss_t:
            ev = self.worker.last_event
            if ev is not None:
                ev.synchronize()
            for mb, t in self._loss_t.items():
                self._losses[mb] = float(t)
                if self._step is not None:  # read here, so checked here (warned, not raised)
                    self._finite.loss(self._step, self._loss_tasks[mb], self._losses[mb], late=True)
            self._loss_t = {}
        return self._losses

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        """Run ``task`` on the compute thread; return the value to send on (or None). On
        CUDA the task counts as done once its kernels are enqueued on the side stream (no
        host sync per task: ``ComputeWorker.run_enqueued``); what consumes its output is
        ordered after them on the device (the next task on the same stream, a send through
        the event recorded at ``send``, the caller's stream through ``order_after_step``).
        ``ClosedError`` after ``close()``, naming the task and the fix."""
        if task.stage not in self.modules:
            raise PlanError(f"rank {ctx.rank}: no module for virtual stage {task.stage}")
        if self.worker.closed:
            raise closed_executor(self, task, ctx)
        return await self.worker.run_enqueued(self._run, task, data, ctx)

    def task_handler(self, kind: str) -> TaskHandler:
        """The function that runs tasks of ``kind`` (``"F"``, ``"B"``, ``"I"``, ``"W"``) as
        ``handler(task, data, ctx)``, on the calling thread, with none of the executor's
        per-task bookkeeping (random streams, emulated time, output hook): for measuring a
        task body alone (the lab's split-backward measurement)."""
        return self._handlers[kind]

    def activation_bytes(self) -> dict[tuple[int, int], int]:
        """The activation bytes of the last step's forwards on this rank: ``{(virtual stage,
        microbatch): bytes}``, what each training forward kept until its backward (its saved
        tensors, received input and outputs, each storage once, no weights; see
        ``_activation_meter`` for what each mode counts). Reset when a step begins; empty
        for a forward-only step, with ``measure_activations=False``, and for forwards of a
        ``task_handlers`` replacement that does not measure itself (``forward_meter``)."""
        return dict(self._meter.bytes)

    @property
    def forward_meter(self) -> ForwardBytes:
        """The forwards' meter, for a ``task_handlers`` F: while ``.enabled``, ``with
        forward_meter.forward(stage, mb, module, inputs)`` around it counts its bytes."""
        return self._meter

    def measure_activations(self, on: bool, /) -> None:
        """Measure the training forwards of the next steps (``on``) or stop (between steps;
        the torch drop-in measures the steps it learns from). PlanError: ``on`` no bool."""
        if not isinstance(on, bool):
            raise PlanError(f"measure_activations takes True or False, got {on!r}")
        self._meter.enable(on)

    def weight_recomputes(self, stage: int, mb: int) -> bool:
        """Whether the ``W`` kept for microbatch ``mb`` of ``stage`` (after its ``I``) will
        recompute the backward instead of replaying the kept graph (see ``_split_backward``);
        False when nothing is kept for it."""
        work = self._kept.get((stage, mb))
        return work is not None and work.recompute is not None

    def set_output_hook(self, hook: OutputHook | None, /) -> None:
        """Called by a stage when it is built (``OutputHookExecutor``): ``hook`` gets each
        task's output on the compute thread as soon as it exists (None: outputs go back
        through ``execute`` only)."""
        self._output_hook = hook

    def order_after_step(self) -> None:
        """Order the device's current stream (the default stream, from the loop thread)
        after every kernel of the step, on the device: the gradients are then ready for
        whatever the caller runs next there (an optimizer step, an all-reduce). No-op off
        CUDA."""
        self.worker.order_after()

    def _run(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        if ctx.step != self._step:
            self._begin_step(ctx)
        # A received input carries its receive's event: the compute stream (on a CPU, this
        # thread) waits for it before anything reads the input (see _streams.wait_ready).
        wait_ready(data, self._ready_device)
        t0 = time.perf_counter()
        handler = self._handlers[task.kind]
        key = self._rng_key
        if key is None:
            out = handler(task, data, ctx)
        else:
            # The lock covers every task, not only F: a backward can replay a forward
            # (activation checkpointing sets the global generators too). See _rng.
            with TASK_RNG_LOCK:
                if task.kind == "F":
                    s = task_key(key, task.stage, task.mb)
                    with fork_seeded(s, self._cuda_of(task.stage)):
                        out = handler(task, data, ctx)
                else:
                    out = handler(task, data, ctx)
        self.compute_seconds += time.perf_counter() - t0
        if self._durations is not None:
            assert self.emulate is not None
            d = self._durations.of(task) * self.emulate.scale
            self.emulated_seconds += d
            time.sleep(d)
        if self._finite.tensors:  # (off the per-task path unless asked for)
            self._finite.output(ctx.step, task, out)
        hook = self._output_hook
        if hook is not None:  # the stage sends the output from here (see Executor)
            hook(task, out, ctx.step)
        return out

    async def settle(self) -> None:
        """Wait for the task still running on the compute thread (the stage calls this when
        a step is cancelled while a task computes: see ``StageLoop.settle_timeout``)."""
        await self.worker.drain()

    def step_failed(self, step: int) -> None:
        """The stage's step ``step`` failed: its stashed activations are dropped when the
        next step begins (on the compute thread, after any task of ``step`` still running)."""
        self._failed_step = step

    def begin_step(self, ctx: TaskContext, *, previous: int | None, failed: bool) -> None:
        """Called on the compute thread when step ``ctx.step``'s first task starts, before
        the executor drops or checks what step ``previous`` kept (``failed``: that step
        failed). Nothing here; a subclass that keeps state per step (an adapter's
        activations) drops it after a failed step and refuses what a finished one left.

        Raises:
            PlanError: What a finished step left (a subclass's check).
        """

    def _begin_step(self, ctx: TaskContext) -> None:
        self.begin_step(ctx, previous=self._step, failed=self._failed_step == self._step)
        if self._failed_step == self._step:
            self._stash.clear()
            self._kept.clear()
        if self._stash or self._kept:
            left = sorted({*self._stash, *self._kept})
            raise PlanError(f"rank {ctx.rank}: step {self._step} left activations {left}")
        self._step = ctx.step
        self._finite.begin_step()
        self._losses = {}
        self._loss_t = {}
        self.outputs = {}
        self._param_lists = {}  # requires_grad may change between steps
        self._meter.reset()
        self._cuda_lists = {}  # and so may devices
        if self.rng_seed is not None:
            plan = ctx.plan
            if plan.num_virtual > MAX_STAGES or plan.microbatches > MAX_MICROBATCHES:
                raise PlanError(
                    f"rank {ctx.rank} step {ctx.step}: per-task random streams tell apart at"
                    f" most {MAX_STAGES} virtual stages and {MAX_MICROBATCHES} microbatches"
                    f" a step; this plan has {plan.num_virtual} and {plan.microbatches}"
                    " (TorchStageExecutor(task_rng=False) switches the streams off)"
                )
            self._rng_key = step_key(self.rng_seed, ctx.step)
        if self.loss_scale == "tokens":
            self._total_tokens = sum(self._tokens(mb, i) for i, mb in enumerate(ctx.microbatches))
        if self.emulate is not None:
            self._durations = self.emulate.durations(
                ctx.plan, ctx.microbatches, ctx.step, self.rank
            )

    def _tokens(self, mb: Any, i: int) -> int:
        n: object
        if self.tokens_fn is not None:
            n = self.tokens_fn(mb)
        else:
            n = mb.tokens if isinstance(mb, TokenCounted) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            src = "tokens_fn" if self.tokens_fn is not None else "Microbatch.tokens"
            raise PlanError(
                f"rank {self.rank}: loss_scale='tokens' needs a token count per microbatch"
                f" ({src}); microbatch {i} gave {n!r} (pass rr.Microbatch objects or tokens_fn)"
            )
        return n

    def _is_last(self, task: Task, ctx: TaskContext) -> bool:
        return task.stage == ctx.plan.num_virtual - 1

    def _loss(self, task: Task, out: Any, mb: Any, ctx: TaskContext) -> torch.Tensor:
        assert self.loss_fn is not None
        loss = self.loss_fn(out, mb)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise PlanError(
                f"rank {ctx.rank} step {ctx.step} {task}: loss_fn must return a scalar tensor"
                f" (the mean loss of the microbatch), got {what}; reduce it (e.g. .mean())"
            )
        loss = loss.reshape(())
        if loss.is_cuda:  # read on the host once per step (``losses``), not per task
            self._loss_t[task.mb] = loss.detach().clone()
            self._loss_tasks[task.mb] = task
        else:
            self._losses[task.mb] = value = float(loss.detach())
            self._finite.loss(ctx.step, task, value)
        if self.loss_scale == "tokens":
            tok = self._tokens(mb, task.mb)
            return loss * (tok / self._total_tokens) if self._total_tokens else loss * 0.0
        if self.loss_scale == "sum":
            return loss
        return loss / ctx.plan.microbatches

    def _forward(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        mod = self.modules[task.stage]
        mb = ctx.microbatches[task.mb]
        inputs: list[torch.Tensor] = []
        if task.stage == 0:
            x = self.input_fn(data)  # data, never a leaf that wants grad
        else:
            x = map_tensors(data, input_leaf)
            inputs = [t for t in tensor_leaves(x) if t.requires_grad]
        kwargs = side_inputs_of(self.side_inputs, task, mb)
        last = self._is_last(task, ctx)
        if ctx.plan.forward_only:
            with torch.no_grad():
                out = self._call(mod, x, kwargs, task, ctx)
                if not last:
                    return map_tensors(out, detached)
                self.outputs[task.mb] = map_tensors(out, detached)
                if self.loss_fn is not None:
                    self._loss(task, out, mb, ctx)
            return None
        if not self._meter.enabled:
            return self._train_forward(mod, x, kwargs, inputs, task, ctx)
        # The loss is inside the measurement: what it saves (the log-softmax of the logits)
        # is kept until the backward like any activation.
        with self._meter.forward(task.stage, task.mb, mod, inputs) as m:
            sent = self._train_forward(mod, x, kwargs, inputs, task, ctx)
            m.hold(self._stash[(task.stage, task.mb)][1])
        return sent

    def _train_forward(
        self,
        mod: nn.Module,
        x: Any,
        kwargs: Mapping[str, Any],
        inputs: list[torch.Tensor],
        task: Task,
        ctx: TaskContext,
    ) -> Any:
        """A training step's forward: stash what the backward needs, return what to send."""
        mb = ctx.microbatches[task.mb]
        with torch.enable_grad():
            out = self._call(mod, x, kwargs, task, ctx)
            if self._is_last(task, ctx):
                if self.loss_fn is None:
                    raise PlanError(
                        f"rank {ctx.rank} step {ctx.step} {task}: a training step needs a"
                        " loss_fn on the last stage's executor (or run it with train=False)"
                    )
                loss = self._loss(task, out, mb, ctx)
                if self.return_outputs:
                    self.outputs[task.mb] = map_tensors(out, detached)
                self._check_grad(task, ctx, [loss] if loss.requires_grad else [], inputs, "loss")
                self._stash[(task.stage, task.mb)] = (inputs, [loss] if loss.requires_grad else [])
                return None
        outs = [t for t in tensor_leaves(out) if t.requires_grad]
        self._check_grad(task, ctx, outs, inputs, "output")
        self._stash[(task.stage, task.mb)] = (inputs, outs)
        return map_tensors(out, sendable)

    def _call(
        self,
        mod: nn.Module,
        x: Any,
        kwargs: Mapping[str, Any],
        task: Task,
        ctx: TaskContext,
    ) -> Any:
        """``call_module``, with what went wrong said where a user can act on it: an error
        from the module keeps its type and traceback; one about its input (a signature or
        shape that does not fit, ``_INPUT_ERRORS``; an in-place change of the received
        input) gains a note (``add_note``) naming the task and the fix (``call_hint``)."""
        try:
            return call_module(mod, x, kwargs)
        except (TypeError, RuntimeError, ValueError) as e:
            hint = call_hint(e, task, x, ctx, default_input=self.input_fn is default_input)
            if hint is not None:
                e.add_note(hint)
            raise

    def _check_grad(
        self,
        task: Task,
        ctx: TaskContext,
        outs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        what: str,
    ) -> None:
        """A stage with something to train must produce an output that carries grad."""
        if outs or not (inputs or self._params(task.stage)):
            return
        why = "its input needs grad" if inputs else "it has parameters that require grad"
        raise PlanError(
            f"rank {ctx.rank} step {ctx.step} {task}: the stage's {what} needs no grad although"
            f" {why}: its backward could not reach them (was it computed under"
            " torch.no_grad(), detached, or from integer tensors only?). Freeze the stage's"
            " parameters (requires_grad_(False)) if it is meant to be frozen"
        )

    def _backward(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        inputs, outs = self._stash.pop((task.stage, task.mb))
        if outs:
            if self._is_last(task, ctx):
                torch.autograd.backward(outs)
            else:
                gs = grads_in(task, ctx, grad, len(outs))
                live = [(o, g) for o, g in zip(outs, gs, strict=True) if g is not None]
                if live:
                    torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        return grads_out([t.grad for t in inputs])

    def _params(self, stage: int) -> list[nn.Parameter]:
        """The stage's parameters that require grad, listed once per step (walking the
        module tree in every I and W is a visible cost on a small stage)."""
        ps = self._param_lists.get(stage)
        if ps is None:
            ps = self._param_lists[stage] = [
                p for p in self.modules[stage].parameters() if p.requires_grad
            ]
        return ps

    def _cuda_of(self, stage: int) -> tuple[int, ...]:
        """The CUDA devices whose generators a forward of ``stage`` seeds: those of its
        parameters and buffers and the compute worker's, listed once per step."""
        got = self._cuda_lists.get(stage)
        if got is None:
            mod = self.modules[stage]
            tensors = [*mod.parameters(), *mod.buffers()]
            got = self._cuda_lists[stage] = cuda_indices(
                [*(t.device for t in tensors), self.worker.device]
            )
        return got

    def _input_grad(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        key = (task.stage, task.mb)
        inputs, outs = self._stash.pop(key)
        params = self._params(task.stage)
        if self._is_last(task, ctx):
            live: list[tuple[torch.Tensor, torch.Tensor | None]] = [(o, None) for o in outs]
        else:
            gs = grads_in(task, ctx, grad, len(outs))
            live = [(o, g) for o, g in zip(outs, gs, strict=True) if g is not None]
        if not live:
            self._kept[key] = WeightWork([], [], {}, params)
            return None
        gx, self._kept[key] = input_backward(
            [o for o, _ in live], [g for _, g in live], inputs, params
        )
        return grads_out(gx)

    def _weight_grad(self, task: Task, _: Any, ctx: TaskContext) -> Any:
        work = self._kept.pop((task.stage, task.mb))
        if not work.ops and work.seed is None and work.recompute is None:
            return None  # nothing flowed into this stage (frozen, or no gradient came)
        grads = weight_backward(work)
        with torch.no_grad(), _GRAD_LOCK:
            for p, pg in zip(work.params, grads, strict=True):
                if pg is None:
                    continue
                if p.grad is None:
                    p.grad = pg.detach().clone()
                else:
                    p.grad += pg
        return None

    def close(self) -> None:
        """Stop the compute thread: the executor runs no more tasks (a step that gets here
        later fails with ``ClosedError``). Close it after the last step."""
        self.worker.close()
