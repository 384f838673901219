"""The real I/W split of a stage's backward (used by ``TorchStageExecutor``).

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
  call per parameter group, each walking the whole graph below (a multiple of ``B`` for
  I + W: BENCHMARKS.md#split-backward-costs); and it adds to ``.grad`` itself.

  Cost: the walk in ``I`` visits every node of the stage graph once in Python and W handles
  each weight op and parameter-only node from Python; on a model as small as the example
  one this bookkeeping, not the arithmetic, sets the price (``measure_split_backward``;
  BENCHMARKS.md#split-backward-costs).

  Fallback: a stage whose weight ops or parameter-only nodes include custom
  ``autograd.Function`` backwards (not callable one by one), or a torch without
  ``torch.autograd.graph.GradientEdge`` (declared support is torch >= 2.4), keeps the whole
  graph in ``I`` and recomputes the stage's backward for the parameters in ``W`` (correct,
  at the price of about one more backward).

  Memory between ``I`` and ``W``: the captured gradients and the graph below the topmost
  weight op (autograd nodes hold their saved tensors and their inputs' nodes); the nodes
  above it (e.g. the loss) are freed at ``I``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.autograd.graph import Node

try:  # autograd.grad on GradientEdges: torch >= 2.4 (the declared support)
    from torch.autograd.graph import GradientEdge as _GradientEdge

    _SPLIT = True
except ImportError:  # pragma: no cover - older torch: W recomputes the backward
    _SPLIT = False

__all__ = ["WeightWork", "input_backward", "weight_backward"]


_ACT = 1
"""Graph-walk flag: the node depends on the stage input (on the first stage: on data)."""
_PARAM = 2
"""Graph-walk flag: the node leads to a parameter of the stage."""

_ENGINE_MIN_WORK = 1 << 20
"""W: an op whose recomputed input gradient would cost about this many multiply-adds or more
(rows of its output gradient x size of its largest parameter input) gets its parameter
outputs from one autograd engine call (which computes only those, for a fixed overhead per
call: BENCHMARKS.md#split-backward-costs) instead of a direct call of its node (which
recomputes the input gradient too)."""

_Edges = list[tuple[int, Node, int]]
"""A weight op's parameter edges: (output index, child node, child's input slot)."""


@dataclass(slots=True)
class WeightWork:
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
    push, pop, expanded = stack.append, stack.pop, kids.get  # hot loop: once per node
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
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """The fallback ``I``: input gradients only, the whole graph kept for ``W``."""
    gx: list[torch.Tensor | None] = [None] * len(inputs)
    if inputs and out.requires_grad:
        gx = list(
            torch.autograd.grad(out, list(inputs), grad, retain_graph=True, allow_unused=True)
        )
    return gx, WeightWork([], [], {}, params, recompute=(out, grad))


def _one_root(
    outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One tensor whose backward is the backward of every ``outs[i]`` from ``grads[i]``.

    Several outputs (a tuple boundary) are joined as ``sum((o * g).sum())``: the gradient
    that reaches each ``o`` is ``1.0 * g``, bitwise ``g``, so the split stays exact.
    """
    if len(outs) == 1:
        return outs[0], grads[0]
    with torch.enable_grad():
        total = None
        for o, g in zip(outs, grads, strict=True):
            assert g is not None  # outputs without a gradient are left out by the caller
            part = (o * g).sum()
            total = part if total is None else total + part
    assert total is not None
    return total, None


def input_backward(
    outs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """``I``: the gradients of ``inputs`` and what ``W`` needs (see the module docstring).

    Args:
        outs: The stage outputs that require grad (the loss on the last stage), at least one.
        grads: The gradient of each output (None for a scalar loss).
        inputs: The stage input leaves that require grad (none on a first stage, whose
            input is data).
        params: The stage's parameters that require grad.

    Returns:
        The gradient of each input (None where none flows), and what ``W`` needs.
    """
    out, grad = _one_root(outs, grads)
    root = out.grad_fn
    if not _SPLIT or root is None:
        return _recompute_input(out, grad, inputs, params)
    inputs = list(inputs)
    rflags, ops, below, leaves, top, ok = _walk(root, inputs, params)
    if not ok:
        return _recompute_input(out, grad, inputs, params)
    slot = out.output_nr
    if slot > top.get(root, 0):
        top[root] = slot
    edges = [_GradientEdge(m, k) for m, _ in ops for k in range(top.get(m, 0) + 1)]
    gx: list[torch.Tensor | None] = [None] * len(inputs)
    caps: Sequence[torch.Tensor | None] = ()
    if inputs or edges:
        res = torch.autograd.grad(
            [out],
            cast(list[torch.Tensor], [*inputs, *edges]),  # tensors and edges mix at runtime
            None if grad is None else [grad],
            retain_graph=bool(ops) or rflags == _PARAM,
            allow_unused=True,
        )
        gx = list(res[: len(inputs)])
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
    return gx, WeightWork(kept, below, leaves, params, seed)


def weight_backward(work: WeightWork) -> list[torch.Tensor | None]:
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
