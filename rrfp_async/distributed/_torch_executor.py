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
* ``I(m, v)``: only the input gradient, plus what ``W`` needs. The stage's autograd graph is
  split at its *weight ops*: the backward nodes that take an activation (something that
  depends on the stage input) and also a parameter, directly or through parameter-only
  nodes (``t()``, slicing, ...). ``I`` runs one backward from the output to the input that
  stops at the weight ops' parameter edges (autograd computes only the outputs a request
  needs: an ``addmm`` gives ``dX`` but not ``dW``) and keeps the gradient flowing *into*
  each weight op. On the first stage the input is data, not a leaf that requires grad: there
  the non-differentiable arguments of an op (the data) play the input's part, so ``I`` still
  runs the activation part of the backward down to the first weight op and ``W`` only the
  parameter part (a stage whose output depends on parameters only gets all of it in ``W``).
* ``W(m, v)``: the parameter gradients from what ``I`` kept, added to ``.grad``, without
  running the rest of the stage's backward again: each weight op's backward runs once more
  from its kept gradient, for its parameter outputs, then the parameter-only nodes below it
  run in topological order, reduced to each tensor's shape like the engine does. Then the
  graph is released. A small op's node is called directly (no autograd engine run; it also
  recomputes its own input-gradient output, e.g. ``dX`` of a linear, and drops it: a node
  called outside the engine computes all its outputs); a large one (``_ENGINE_MIN_WORK``)
  gets one engine call that computes only its parameter outputs, when nothing else leads to
  them. Per microbatch these gradients are those of ``B``, bitwise (the same backward functions on
  the same values; only where several contributions meet in one parameter, e.g. a weight
  used twice, is the sum taken in W's fixed order rather than the engine's). They depend on
  the microbatch alone, so with ``StepPlan(ordered_weights=True)``, where the Ws of a stage
  run in microbatch order, ``.grad`` is bitwise independent of the order the Is ran in.
  W never calls a node of the activation path, so backward collectives there (a TP
  all-reduce of the input gradient) run once, in ``I``.

  Not ``torch.distributed.pipelining._backward`` (``stage_backward_input`` /
  ``stage_backward_weight``): on a first stage (no input that requires grad) its parameter
  groups come out empty and W silently yields no gradient; its W runs one autograd engine
  call per parameter group, each walking the whole graph below (about 2.6x ``B`` for I + W
  on the example model); and it adds to ``.grad`` itself.

  Cost: the walk in ``I`` visits every node of the stage graph once in Python (~2 us per
  node on a slow CPU) and W handles each weight op and parameter-only node from Python; on
  a model as small as the example one this bookkeeping, not the arithmetic, sets the price
  (``measure_split_backward``).

  Fallback: a stage whose weight ops or parameter-only nodes include custom
  ``autograd.Function`` backwards (not callable one by one), or a torch without
  ``torch.autograd.graph.GradientEdge`` (declared support is torch >= 2.4), keeps the whole
  graph in ``I`` and recomputes the stage's backward for the parameters in ``W`` (correct,
  at the price of about one more backward).

  Memory between ``I`` and ``W``: the captured gradients and the graph below the topmost
  weight op (autograd nodes hold their saved tensors and their inputs' nodes); the nodes
  above it (e.g. the loss) are freed at ``I``.

``measure_split_backward`` times ``B`` against ``I`` + ``W`` on a stage of the example model.

Emulated GPU time (``EmulatedCost``): on a CPU, after the real computation, the worker thread
sleeps for the duration a declared cost model gives the task (per token, per image patch,
backward = 2x forward, with seeded jitter), like a host waiting for a GPU kernel. Reports of
runs that use it must say so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import Node

from .._bridges import ComputeWorker
from .._costs import CostModel, Durations, Microbatch
from .._errors import PlanError
from .._tasks import StepPlan, Task
from ..loop._executors import OutputHook, TaskContext

try:  # autograd.grad on GradientEdges: torch >= 2.4 (the declared support)
    from torch.autograd.graph import GradientEdge as _GradientEdge

    _SPLIT = True
except ImportError:  # pragma: no cover - older torch: W recomputes the backward
    _SPLIT = False

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


_ACT = 1
"""Graph-walk flag: the node depends on the stage input (on the first stage: on data)."""
_PARAM = 2
"""Graph-walk flag: the node leads to a parameter of the stage."""

_ENGINE_MIN_WORK = 1 << 20
"""W: an op whose recomputed input gradient would cost about this many multiply-adds or more
(rows of its output gradient x size of its largest parameter input) gets its parameter
outputs from one autograd engine call (which computes only those, for ~0.1 ms of overhead)
instead of a direct call of its node (which recomputes the input gradient too)."""

_Edges = list[tuple[int, Node, int]]
"""A weight op's parameter edges: (output index, child node, child's input slot)."""


@dataclass(slots=True)
class _WeightWork:
    """What ``I`` keeps for ``W`` (one microbatch of one virtual stage).

    Attributes:
        ops: The weight ops, children first: node, the gradients captured at its input
            slots, its parameter edges.
        below: The parameter-only nodes under them (not the leaves), children first.
        leaves: Parameter AccumulateGrad node -> index in the stage's parameter list.
        params: The stage's parameters that require grad, as listed at ``I``.
        seed: ``(root, slot, gradient)`` when the whole graph is parameter-only.
        recompute: Fallback: ``(output, output gradient)``; ``W`` reruns the backward.
    """

    ops: list[tuple[Node, tuple[torch.Tensor | None, ...], _Edges]]
    below: list[Node]
    leaves: dict[Node, int]
    params: Sequence[torch.Tensor]
    seed: tuple[Node, int, torch.Tensor] | None = None
    recompute: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _walk(
    root: Node, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[int, list[tuple[Node, _Edges]], list[Node], dict[Node, int], dict[Node, int], bool]:
    """One post-order walk of the graph under ``root``: find the weight ops.

    A node is ``_ACT`` when it leads to one of ``inputs`` (with no inputs, the first stage:
    when it or a node under it has a non-differentiable tensor argument, i.e. data) and
    ``_PARAM`` when it leads to one of ``params``. A weight op is an ``_ACT`` node with a
    child that is ``_PARAM`` only.

    Returns:
        The root's flags; the weight ops with their parameter edges; the parameter-only
        non-leaf nodes; the parameter leaves (node -> index); the highest input slot a
        parent feeds, per node (when above 0); whether every node ``W`` calls is callable
        (custom ``autograd.Function`` backwards are not).
    """
    data = not inputs
    input_ids = {id(t) for t in inputs}
    param_ids = {id(p): i for i, p in enumerate(params)}
    kids: dict[Node, tuple[tuple[Node | None, int], ...]] = {}
    flags: dict[Node, int] = {}
    top: dict[Node, int] = {}
    ops: list[tuple[Node, _Edges]] = []
    below: list[Node] = []
    leaves: dict[Node, int] = {}
    ok = True
    stack = [root]
    push, pop, expanded = stack.append, stack.pop, kids.get  # hot loop: ~2 us per node
    while stack:
        n = stack[-1]
        nf = expanded(n)
        if nf is None:  # first visit: expand
            nf = kids[n] = n.next_functions
            for c, k in nf:
                if c is not None:
                    if k and k > top.get(c, 0):
                        top[c] = k
                    if c not in kids:
                        push(c)
            continue
        pop()
        if n in flags:  # pushed twice, done already
            continue
        f = 0
        if nf:
            for c, _ in nf:
                if c is not None:
                    f |= flags[c]
                elif data:
                    f |= _ACT
            if f == _PARAM:
                below.append(n)
                ok = ok and callable(n)
            elif f == _ACT | _PARAM:
                edges = [
                    (j, c, k) for j, (c, k) in enumerate(nf) if c is not None and flags[c] == _PARAM
                ]
                if edges:
                    ops.append((n, edges))
                    ok = ok and callable(n)
        else:
            v = getattr(n, "variable", None)  # AccumulateGrad: the leaf tensor
            if v is not None:
                i = param_ids.get(id(v))
                if i is not None:
                    f = _PARAM
                    leaves[n] = i
                elif id(v) in input_ids:
                    f = _ACT
        flags[n] = f
    return flags[root], ops, below, leaves, top, ok


def _recompute_input(
    out: torch.Tensor,
    grad: torch.Tensor | None,
    xi: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, _WeightWork]:
    """The fallback ``I``: input gradient only, the whole graph kept for ``W``."""
    gx = None
    if xi is not None:
        (gx,) = torch.autograd.grad(out, [xi], grad, retain_graph=True)
    return gx, _WeightWork([], [], {}, params, recompute=(out, grad))


def _input_backward(
    out: torch.Tensor,
    grad: torch.Tensor | None,
    xi: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, _WeightWork]:
    """``I``: the gradient of ``xi`` and what ``W`` needs (see the module docstring).

    Args:
        out: The stage output (the loss on the last stage).
        grad: The gradient of ``out`` (None for a scalar loss).
        xi: The stage input leaf, or None (first stage: the input is data).
        params: The stage's parameters that require grad.
    """
    root = out.grad_fn
    if not _SPLIT or root is None:
        return _recompute_input(out, grad, xi, params)
    inputs = [] if xi is None else [xi]
    rflags, ops, below, leaves, top, ok = _walk(root, inputs, params)
    if not ok:
        return _recompute_input(out, grad, xi, params)
    slot = out.output_nr
    if slot > top.get(root, 0):
        top[root] = slot
    edges = [_GradientEdge(m, k) for m, _ in ops for k in range(top.get(m, 0) + 1)]
    gx = None
    caps: Sequence[torch.Tensor | None] = ()
    if inputs or edges:
        res = torch.autograd.grad(
            [out],
            cast(list[torch.Tensor], [*inputs, *edges]),  # tensors and edges mix at runtime
            None if grad is None else [grad],
            retain_graph=bool(ops) or rflags == _PARAM,
            allow_unused=True,
        )
        gx = res[0] if inputs else None
        caps = res[len(inputs) :]
    kept = []
    i = 0
    for m, pe in ops:
        j = i + top.get(m, 0) + 1
        kept.append((m, tuple(caps[i:j]), pe))
        i = j
    seed = None
    if rflags == _PARAM:  # nothing depends on the input: W runs the graph from the root
        seed = (root, slot, torch.ones_like(out) if grad is None else grad)
    return gx, _WeightWork(kept, below, leaves, params, seed)


def _weight_backward(work: _WeightWork) -> list[torch.Tensor | None]:
    """``W``: the parameter gradients of one microbatch from what ``I`` kept.

    Returns:
        One gradient per parameter of ``work.params`` (None where none flows), not yet
        added to ``.grad``.
    """
    params = work.params
    if work.recompute is not None:
        out, grad = work.recompute
        if not params:
            return []
        return list(torch.autograd.grad(out, list(params), grad, allow_unused=True))
    leaves = work.leaves
    buf: dict[Node, list[torch.Tensor | None]] = {}

    def add(c: Node, k: int, g: torch.Tensor) -> None:
        # Like the engine's validate_outputs: reduce to the input's shape and dtype.
        i = leaves.get(c)
        if i is not None:
            shape, dtype, n_in = params[i].shape, params[i].dtype, 1
        else:
            meta = c._input_metadata
            shape, dtype, n_in = torch.Size(meta[k].shape), meta[k].dtype, len(meta)
        if g.shape != shape:
            g = g.sum_to_size(shape)
        if g.dtype != dtype:
            g = g.to(dtype)
        slots = buf.get(c)
        if slots is None:
            slots = buf[c] = [None] * n_in
        prev = slots[k]
        slots[k] = g if prev is None else prev + g

    def call(n: Node, grads: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
        # A node called directly takes one gradient per input slot and returns one per
        # next edge (a bare tensor when it has one edge).
        outs = cast(Callable[..., Any], n)(*grads)
        return outs if isinstance(outs, tuple) else (outs,)

    below = set(work.below)
    ways: dict[Node, int] = {}

    def alone(pe: _Edges) -> bool:
        # An op's engine call returns the gradients at its parameter edges only when no
        # other path (another op, a parameter-only parent) leads there; otherwise the engine
        # would also run the activation path down to that other way in.
        if not ways:
            for _, _, edges in work.ops:
                for _, c, _ in edges:
                    ways[c] = ways.get(c, 0) + 1
            for n in work.below:
                for child, _ in n.next_functions:
                    if child is not None:
                        ways[child] = 2
        return all(ways[c] == 1 for _, c, _ in pe)

    def size(c: Node, k: int) -> int:
        i = leaves.get(c)
        return params[i].numel() if i is not None else math.prod(c._input_metadata[k].shape)

    largest = max((p.numel() for p in params), default=0)
    with torch.no_grad():
        if work.seed is not None:
            add(*work.seed)
        for m, grads, pe in work.ops:
            g0 = next((g for g in grads if g is not None), None)
            if g0 is None:
                continue
            rows = g0.numel() // max(1, g0.shape[-1] if g0.dim() else 1)
            if (
                rows * largest >= _ENGINE_MIN_WORK  # cheap bound first
                and rows * max(size(c, k) for _, c, k in pe) >= _ENGINE_MIN_WORK
                and alone(pe)
            ):
                # Large op: the engine computes just its parameter outputs (one call).
                live = [(k, g) for k, g in enumerate(grads) if g is not None]
                res = torch.autograd.grad(
                    [_GradientEdge(m, k) for k, _ in live],
                    [_GradientEdge(c, k) for _, c, k in pe],
                    [g for _, g in live],
                    allow_unused=True,
                )
                for (_, c, k), g in zip(pe, res, strict=True):
                    if g is not None:
                        add(c, k, g)
                continue
            n_in = len(m._input_metadata)
            if len(grads) < n_in:  # slots no parent feeds
                grads = (*grads, *([None] * (n_in - len(grads))))
            outs = call(m, grads)
            for j, c, k in pe:
                if outs[j] is not None:
                    add(c, k, outs[j])
        for n in reversed(work.below):  # parents first
            slots = buf.pop(n, None)
            if slots is None:
                continue
            outs = call(n, slots)  # slots: one per input (see add)
            for j, (child, k) in enumerate(n.next_functions):
                if outs[j] is not None and (child in leaves or child in below):
                    add(child, k, outs[j])
    dws: list[torch.Tensor | None] = [None] * len(params)
    for leaf, i in leaves.items():
        got = buf.get(leaf)
        if got is not None:
            dws[i] = got[0]
    return dws


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
        self._kept: dict[tuple[int, int], _WeightWork] = {}
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
        gx, self._kept[key] = _input_backward(out, g, self._input_of(x), self._params(task.stage))
        return gx

    def _weight_grad(self, task: Task, _: Any, ctx: TaskContext) -> Any:
        work = self._kept.pop((task.stage, task.mb))
        grads = _weight_backward(work)
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
