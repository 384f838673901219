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

``measure_split_backward`` times ``B`` against ``I`` + ``W`` on a stage of the example model.

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

from .._bridges import ComputeWorker
from .._costs import CostModel, Durations, Microbatch
from .._errors import PlanError
from .._tasks import StepPlan, Task
from ..loop._executors import OutputHook, TaskContext
from ._split_backward import WeightWork, input_backward, weight_backward

__all__ = ["EmulatedCost", "TorchStageExecutor", "measure_split_backward"]


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
        output_hook: Set by a stage whose endpoint sends thread-safely: called on the
            compute thread with each task's output as soon as it exists (see ``Executor``).
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
        self.output_hook: OutputHook | None = None
        self._failed_step: int | None = None
        self.losses: dict[int, float] = {}
        self.compute_seconds = 0.0
        self.emulated_seconds = 0.0
        self._stash: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._kept: dict[tuple[int, int], WeightWork] = {}
        self._param_lists: dict[int, list[nn.Parameter]] = {}
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
        hook = self.output_hook
        if hook is not None:  # the stage sends the output from here (see Executor)
            hook(task, out, ctx.step)
        return out

    def step_failed(self, step: int) -> None:
        """The stage's step ``step`` failed: its stashed activations are dropped when the
        next step begins (on the compute thread, after any task of ``step`` still running)."""
        self._failed_step = step

    def _begin_step(self, ctx: TaskContext) -> None:
        if self._failed_step == self._step:
            self._stash.clear()
            self._kept.clear()
        if self._stash or self._kept:
            left = sorted({*self._stash, *self._kept})
            raise PlanError(f"rank {ctx.rank}: step {self._step} left activations {left}")
        self._step = ctx.step
        self.losses = {}
        self._param_lists = {}  # requires_grad may change between steps
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

    def _params(self, stage: int) -> list[nn.Parameter]:
        """The stage's parameters that require grad, listed once per step (walking the
        module tree in every I and W is a visible cost on a small stage)."""
        ps = self._param_lists.get(stage)
        if ps is None:
            ps = self._param_lists[stage] = [
                p for p in self.modules[stage].parameters() if p.requires_grad
            ]
        return ps

    def _input_grad(self, task: Task, grad: Any, ctx: TaskContext) -> Any:
        key = (task.stage, task.mb)
        x, out = self._stash.pop(key)
        g = None if self._is_last(task, ctx) else grad
        gx, self._kept[key] = input_backward(out, g, self._input_of(x), self._params(task.stage))
        return gx

    def _weight_grad(self, task: Task, _: Any, ctx: TaskContext) -> Any:
        work = self._kept.pop((task.stage, task.mb))
        grads = weight_backward(work)
        with torch.no_grad():
            for p, pg in zip(work.params, grads, strict=True):
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


def stage_inputs(
    modules: Mapping[int, nn.Module], microbatches: Sequence[Any], stage: int, *, seed: int = 0
) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Inputs of virtual stage ``stage`` (the earlier stages run on each microbatch's
    ``data``, no grad) and a small seeded random gradient of its output (None on the last
    stage, whose backward starts from the loss): what a stage-level measurement feeds F and
    B."""
    g = torch.Generator().manual_seed(seed)
    inputs: list[Any] = []
    grads: list[torch.Tensor | None] = []
    last = max(modules)
    with torch.no_grad():
        for mb in microbatches:
            x: Any = mb.data
            for s in range(stage):
                x = modules[s](x)
            inputs.append(x if stage == 0 else x.detach())
            if stage == last:
                grads.append(None)
            else:
                out = modules[stage](x)
                grads.append(torch.randn(out.shape, generator=g, dtype=out.dtype) * 1e-2)
    return inputs, grads


def measure_split_backward(
    *,
    stages: int = 4,
    stage: int | None = None,
    microbatches: int = 8,
    repeats: int = 5,
    seed: int = 0,
    threads: int | None = 1,
    config: Any = None,
) -> dict[str, float]:
    """Compute time of ``B`` against ``I`` + ``W`` on one stage of the example model.

    A benchmark, not a test. Builds the image-text model (``config``, default
    ``ImageTextConfig()``) split into ``stages`` virtual stages, takes stage ``stage``
    (default: a middle one) and ``microbatches`` microbatches of ``make_microbatches``: the
    stage input is the previous stages' real activation, the output gradient a fixed random
    tensor (the loss on the last stage). Each round runs, microbatch by microbatch, F then B
    on one executor and F then I then W on another (same module, same inputs), calling the
    task handlers on this thread (no worker hand-off, no emulated time). The first round
    warms up.

    Args:
        stages: Virtual stages of the split.
        stage: The stage measured (default ``stages // 2``).
        microbatches: Microbatches per round.
        repeats: Timed rounds.
        seed: Data seed.
        threads: torch intra-op threads while measuring (pipeline ranks use 1); None keeps
            the current setting.
        config: An ``ImageTextConfig`` (default: the example model's).

    Returns:
        Seconds per round (sum over the microbatches), median over the rounds: ``b``, ``i``,
        ``w``, ``iw`` (I + W per round) and ``ratio`` (``iw / b``), on the wall clock; the
        same on this thread's CPU clock as ``b_cpu``, ``iw_cpu``, ``ratio_cpu`` (less
        sensitive to other processes on shared cores); and ``stage``, ``stages``,
        ``microbatches``, ``tokens``, ``split`` (1.0: the graph split, 0.0: the recompute
        fallback).
    """
    import statistics

    from .._tasks import Topology
    from ..loop._executors import TaskContext
    from ..models.image_text import ImageTextConfig, build_stage_modules, loss_fn, make_microbatches

    cfg = ImageTextConfig() if config is None else config
    v = stages // 2 if stage is None else stage
    if not 0 <= v < stages:
        raise PlanError(f"stage {v} is outside 0..{stages - 1}")
    if repeats < 1 or microbatches < 1:
        raise PlanError("measure_split_backward needs repeats >= 1 and microbatches >= 1")
    n_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        modules = build_stage_modules(cfg, stages, list(range(stages)))
        mbs = make_microbatches(microbatches, cfg, seed=seed)
        inputs, grads = stage_inputs(modules, mbs, v, seed=seed)
        top = Topology(stages=stages)
        plain = StepPlan(topology=top, microbatches=microbatches)
        split = StepPlan(topology=top, microbatches=microbatches, split_backward=True)
        ex_b = TorchStageExecutor({v: modules[v]}, loss_fn)
        ex_s = TorchStageExecutor({v: modules[v]}, loss_fn)
        params = list(modules[v].parameters())
        keys = ("b", "i", "w", "b_cpu", "iw_cpu")
        rounds: dict[str, list[float]] = {k: [] for k in keys}
        split_used = True
        try:
            for rep in range(repeats + 1):
                ctx_b = TaskContext(0, rep, plain, mbs)
                ctx_s = TaskContext(0, rep, split, mbs)
                tot = dict.fromkeys(keys, 0.0)
                for m in range(microbatches):
                    data = mbs[m] if v == 0 else inputs[m]
                    ex_b._forward(Task(v, "F", m), data, ctx_b)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    ex_b._backward(Task(v, "B", m), grads[m], ctx_b)
                    tot["b"] += time.perf_counter() - t0
                    tot["b_cpu"] += time.thread_time() - c0
                    ex_s._forward(Task(v, "F", m), data, ctx_s)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    ex_s._input_grad(Task(v, "I", m), grads[m], ctx_s)
                    t1 = time.perf_counter()
                    split_used = split_used and ex_s._kept[(v, m)].recompute is None
                    ex_s._weight_grad(Task(v, "W", m), None, ctx_s)
                    tot["i"] += t1 - t0
                    tot["w"] += time.perf_counter() - t1
                    tot["iw_cpu"] += time.thread_time() - c0
                for p in params:
                    p.grad = None
                if rep:
                    for k in keys:
                        rounds[k].append(tot[k])
        finally:
            ex_b.close()
            ex_s.close()
    finally:
        torch.set_num_threads(n_threads)
    med = {k: statistics.median(vals) for k, vals in rounds.items()}
    iw = statistics.median(i + w for i, w in zip(rounds["i"], rounds["w"], strict=True))
    return {
        "b": med["b"],
        "i": med["i"],
        "w": med["w"],
        "iw": iw,
        "ratio": iw / med["b"],
        "b_cpu": med["b_cpu"],
        "iw_cpu": med["iw_cpu"],
        "ratio_cpu": med["iw_cpu"] / med["b_cpu"],
        "stage": float(v),
        "stages": float(stages),
        "microbatches": float(microbatches),
        "tokens": float(sum(mb.tokens for mb in mbs)),
        "split": 1.0 if split_used else 0.0,
    }
