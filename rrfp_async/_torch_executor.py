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
* ``I(m, v)``: only the input gradient (``autograd.grad(..., retain_graph=True)``).
* ``W(m, v)``: only the parameter gradients, added to ``.grad``. With
  ``StepPlan(ordered_weights=True)`` the Ws of a stage run in microbatch order, so ``.grad``
  is bitwise independent of the dispatch order. (W recomputes the backward of the stage's
  graph for the parameters: simple, at the price of some extra compute.)

Emulated GPU time (``EmulatedCost``): on a CPU, after the real computation, the worker thread
sleeps for the duration a declared cost model gives the task (per token, per image patch,
backward = 2x forward, with seeded jitter), like a host waiting for a GPU kernel. Reports of
runs that use it must say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._costs import CostModel, Durations, Microbatch
from ._errors import PlanError
from ._executors import TaskContext
from ._tasks import StepPlan, Task
from .loop._bridges import ComputeWorker

__all__ = ["EmulatedCost", "TorchStageExecutor"]


@dataclass(frozen=True, kw_only=True)
class EmulatedCost:
    """Emulated GPU time for CPU runs: each task also sleeps for its cost-model duration.

    Attributes:
        cost: The declared cost model (per token / per patch, backward factor, jitter).
        seed: Seed of the realized jitter; combined with the step number.
        per_rank_noise: Draw the jitter per process (TP ranks then see different timings,
            which is how divergence is provoked in tests), else per step only.
        scale: Multiply every emulated duration (e.g. 0.1 for quick tests).
    """

    cost: CostModel
    seed: int = 0
    per_rank_noise: bool = False
    scale: float = 1.0

    def durations(
        self, plan: StepPlan, microbatches: Sequence[Any], step: int, rank: int
    ) -> Durations:
        """The realized emulated durations of ``step`` (Microbatch sizes required)."""
        if not all(isinstance(m, Microbatch) for m in microbatches):
            raise PlanError("EmulatedCost needs rrfp_async.Microbatch objects (with sizes)")
        seed = hash((self.seed, step, rank if self.per_rank_noise else -1)) & 0xFFFFFFFF
        return self.cost.realize(plan, microbatches, seed=seed)


def _default_input(mb: Any) -> Any:
    return mb.data if isinstance(mb, Microbatch) else mb


class TorchStageExecutor:
    """Runs one rank's model chunks (one ``nn.Module`` per virtual stage).

    Args:
        modules: Virtual stage -> module, for the stages of this rank.
        loss_fn: ``(last stage output, microbatch) -> scalar loss`` (mean over the
            microbatch); the executor divides it by the number of microbatches.
        emulate: Optional emulated GPU time (sleeps after the real compute).
        worker: The compute thread (default: a new CPU ``ComputeWorker``).
        rank: Global rank, for per-rank emulated noise.
        input_fn: Turns a microbatch into the first stage's input (default: ``mb.data``
            for a ``Microbatch``, else the object itself).

    Attributes:
        losses: ``{microbatch: loss value}`` of the last step (on the last stage's rank).
    """

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        emulate: EmulatedCost | None = None,
        worker: ComputeWorker | None = None,
        rank: int = 0,
        input_fn: Callable[[Any], Any] = _default_input,
    ) -> None:
        if not modules:
            raise PlanError("a TorchStageExecutor needs at least one module")
        self.modules = dict(modules)
        self.loss_fn = loss_fn
        self.emulate = emulate
        self.worker = worker if worker is not None else ComputeWorker(name=f"rrfp-compute-{rank}")
        self.rank = rank
        self.input_fn = input_fn
        self.losses: dict[int, float] = {}
        self.compute_seconds = 0.0
        self.emulated_seconds = 0.0
        self._stash: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self._step: int | None = None
        self._durations: Durations | None = None
        self._handlers: dict[str, Callable[[Task, Any, TaskContext], Any]] = {
            "F": self._forward,
            "B": self._backward,
            "I": self._input_grad,
            "W": self._weight_grad,
        }

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        """Run ``task`` on the compute thread; return the tensor to send on (or None)."""
        if task.stage not in self.modules:
            raise PlanError(f"rank {ctx.rank}: no module for virtual stage {task.stage}")
        return await self.worker.run(self._run, task, data, ctx)

    def _run(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        if ctx.step != self._step:
            self._begin_step(ctx)
        t0 = time.perf_counter()
        out = self._handlers[task.kind](task, data, ctx)
        self.compute_seconds += time.perf_counter() - t0
        if self._durations is not None:
            assert self.emulate is not None
            d = self._durations.of(task) * self.emulate.scale
            self.emulated_seconds += d
            time.sleep(d)
        return out

    def _begin_step(self, ctx: TaskContext) -> None:
        if self._stash:
            left = sorted(self._stash)
            raise PlanError(f"rank {ctx.rank}: step {self._step} left activations {left}")
        self._step = ctx.step
        self.losses = {}
        if self.emulate is not None:
            self._durations = self.emulate.durations(
                ctx.plan, ctx.microbatches, ctx.step, self.rank
            )

    def _is_last(self, task: Task, ctx: TaskContext) -> bool:
        return task.stage == ctx.plan.num_virtual - 1

    def _forward(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        mod = self.modules[task.stage]
        if task.stage == 0:
            x = self.input_fn(data)
        else:
            if not isinstance(data, torch.Tensor):
                raise PlanError(f"{task}: expected an activation tensor, got {type(data).__name__}")
            x = data.detach().requires_grad_(data.is_floating_point())
        with torch.enable_grad():
            out = mod(x)
            if self._is_last(task, ctx):
                loss = self.loss_fn(out, ctx.microbatches[task.mb]) / ctx.plan.microbatches
                self.losses[task.mb] = float(loss.detach()) * ctx.plan.microbatches
                self._stash[(task.stage, task.mb)] = (x, loss)
                return None
        self._stash[(task.stage, task.mb)] = (x, out)
        return out.detach()

    def _input_of(self, x: Any) -> torch.Tensor | None:
        return x if isinstance(x, torch.Tensor) and x.requires_grad else None

    def _backward(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        x, out = self._stash.pop((task.stage, task.mb))
        if self._is_last(task, ctx):
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, grad)
        xi = self._input_of(x)
        return None if xi is None else xi.grad

    def _input_grad(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        key = (task.stage, task.mb)
        x, out = self._stash[key]
        g = None if self._is_last(task, ctx) else grad
        self._grads[key] = g
        xi = self._input_of(x)
        if xi is None:
            return None
        (gx,) = torch.autograd.grad(out, [xi], g, retain_graph=True)
        return gx

    def _weight_grad(self, task: Task, _: Any, ctx: TaskContext) -> Any:
        key = (task.stage, task.mb)
        _x, out = self._stash.pop(key)
        g = self._grads.pop(key)
        params = [p for p in self.modules[task.stage].parameters() if p.requires_grad]
        grads: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
            out, params, g, allow_unused=True
        )
        with torch.no_grad():
            for p, pg in zip(params, grads, strict=True):
                if pg is None:
                    continue
                if p.grad is None:
                    p.grad = pg.detach().clone()
                else:
                    p.grad += pg
        return None

    def close(self) -> None:
        """Stop the compute thread."""
        self.worker.close()
