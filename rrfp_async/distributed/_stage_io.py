"""Stage I/O for the torch executor: how a stage's inputs and outputs travel.

What crosses a stage boundary is a pytree of tensors (``rrfp_async._pytree``): a received
value becomes the stage's input leaves (``input_leaf``: detached, wanting grad when the
sender's did), an output leaves without its graph (``sendable``), and a gradient message has
one gradient per output leaf that requires grad (``grads_in`` / ``grads_out``: a tensor for
one leaf, a tuple for several, None when nothing flows). What does not cross it: side inputs
(``SideInputs``: per-microbatch keywords each rank reads from its own microbatch) and tied
parameters (``SharedSpec``: where one parameter lives on several stages; their gradients are
reduced by the stage, never sent). Kept apart from ``_torch_executor`` so that the executor
reads as running tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._costs import Microbatch
from .._errors import PlanError
from .._pytree import Args
from .._tasks import Task
from ..loop import TaskContext

__all__ = [
    "SharedSpec",
    "SideInputs",
    "default_input",
    "detached",
    "grads_in",
    "grads_out",
    "input_leaf",
    "resolve_shared",
    "sendable",
    "side_inputs_of",
    "validate_side_inputs",
]

SideInputs = Callable[[int, Any], Mapping[str, Any]] | Sequence[str]
"""Per-microbatch inputs a stage reads from its own rank's microbatch, not from the pipeline:
a function ``(virtual stage, microbatch) -> {keyword: value}``, or the names of keys to take
from each microbatch (a mapping, an ``rr.Args``' keywords, or a ``Microbatch`` whose ``data``
is one) for every stage after the first."""

SharedSpec = Mapping[str, Sequence[tuple[int, str]]]
"""Tied parameters: tie name -> the places the parameter lives, as ``(virtual stage,
parameter name inside that stage's module)``; the same mapping on every rank (see
``rr.split_model``, which finds ties for you)."""


def default_input(mb: Any) -> Any:
    """The first stage's input by default: ``mb.data`` for a ``Microbatch``, else ``mb``."""
    return mb.data if isinstance(mb, Microbatch) else mb


def input_leaf(t: torch.Tensor) -> torch.Tensor:
    """A received tensor as this stage's input leaf (grad wanted when the sender's was)."""
    return t.detach().requires_grad_(t.requires_grad)


def sendable(t: torch.Tensor) -> torch.Tensor:
    """An output tensor as it leaves the stage: no graph, its ``requires_grad`` kept."""
    return t.detach().requires_grad_(True) if t.requires_grad else t.detach()


def detached(t: torch.Tensor) -> torch.Tensor:
    """A tensor without its graph (a forward-only step's output)."""
    return t.detach()


def validate_side_inputs(side_inputs: SideInputs | None) -> SideInputs | None:
    """``side_inputs`` as the executor keeps it: a function, key names as a tuple, or None.

    Raises:
        PlanError: neither a function nor a sequence of key names.
    """
    if side_inputs is None or callable(side_inputs):
        return side_inputs
    if isinstance(side_inputs, str) or not all(isinstance(k, str) for k in side_inputs):
        raise PlanError(
            "side_inputs must be a function (stage, microbatch) -> {keyword: value} or"
            f" a sequence of key names, got {side_inputs!r}"
        )
    return tuple(side_inputs)


def side_inputs_of(side: SideInputs | None, task: Task, mb: Any) -> Mapping[str, Any]:
    """The keyword inputs ``task`` reads from its own rank's microbatch ``mb``.

    Raises:
        PlanError: the function returned no mapping, or the microbatch is no mapping or
            lacks one of the named keys.
    """
    if side is None:
        return {}
    if callable(side):
        got = side(task.stage, mb)
        if not isinstance(got, Mapping):
            raise PlanError(
                f"{task}: side_inputs returned {type(got).__name__}, not a mapping of"
                " keyword -> value"
            )
        return got
    if task.stage == 0:
        return {}
    src = default_input(mb)
    if isinstance(src, Args):
        src = src.kwargs
    if not isinstance(src, Mapping):
        raise PlanError(
            f"{task}: side_inputs={list(side)} reads keys of each microbatch, but"
            f" microbatch {task.mb} is a {type(src).__name__}, not a mapping"
        )
    missing = [k for k in side if k not in src]
    if missing:
        raise PlanError(f"{task}: microbatch {task.mb} has no side input(s) {missing}")
    return {k: src[k] for k in side}


def resolve_shared(
    modules: Mapping[int, nn.Module], shared: SharedSpec
) -> tuple[dict[str, tuple[tuple[int, str], ...]], dict[str, list[nn.Parameter]]]:
    """Check a ``SharedSpec`` and find its parameters among this rank's ``modules``.

    Returns:
        ``(spec, mine)``: tie name -> its places, sorted; tie name -> the distinct parameter
        objects of ``modules`` in that tie (ties with none here left out).

    Raises:
        PlanError: a malformed spec, a tie of fewer than two places, or a place on this
            rank that names no parameter of its module.
    """
    if not isinstance(shared, Mapping):
        raise PlanError(
            "shared must map a tie name to [(virtual stage, parameter name), ...], got"
            f" {type(shared).__name__}"
        )
    specs: dict[str, tuple[tuple[int, str], ...]] = {}
    params: dict[str, list[nn.Parameter]] = {}
    for name, places in shared.items():
        if not isinstance(name, str):
            raise PlanError(f"shared: tie names must be strings, got {name!r}")
        spec: list[tuple[int, str]] = []
        mine: list[nn.Parameter] = []
        for place in places:
            if (
                not isinstance(place, (tuple, list))
                or len(place) != 2
                or not isinstance(place[0], int)
                or not isinstance(place[1], str)
            ):
                raise PlanError(
                    f"shared[{name!r}]: each place is (virtual stage, parameter name), got"
                    f" {place!r}"
                )
            v, pname = int(place[0]), place[1]
            spec.append((v, pname))
            mod = modules.get(v)
            if mod is None:
                continue
            try:
                param = mod.get_parameter(pname)
            except AttributeError:
                raise PlanError(
                    f"shared[{name!r}]: virtual stage {v}'s module has no parameter"
                    f" {pname!r} (its parameters: {[n for n, _ in mod.named_parameters()][:8]}"
                    " ...)"
                ) from None
            if all(param is not q for q in mine):
                mine.append(param)
        if len(spec) < 2:
            raise PlanError(f"shared[{name!r}] names {len(spec)} place(s); a tie needs >= 2")
        specs[name] = tuple(sorted(spec))
        if mine:
            params[name] = mine
    return specs, params


def grads_in(task: Task, ctx: TaskContext, grad: Any, n: int) -> list[torch.Tensor | None]:
    """The received gradient message as one gradient per output leaf that requires grad
    (see ``rrfp_async._pytree``: a tensor for one leaf, a tuple for several).

    Raises:
        PlanError: the message does not match the ``n`` output leaves.
    """
    if grad is None:
        return [None] * n
    if isinstance(grad, torch.Tensor):
        got: list[Any] = [grad]
    elif isinstance(grad, (tuple, list)):
        got = list(grad)
    else:
        got = [None] * (n + 1)  # reported below
    if len(got) != n or not all(g is None or isinstance(g, torch.Tensor) for g in got):
        raise PlanError(
            f"rank {ctx.rank} step {ctx.step} {task}: the gradient message does not match"
            f" the stage's {n} output tensor(s) that require grad: got"
            f" {type(grad).__name__} of {len(got)}"
        )
    return got


def grads_out(gx: Sequence[torch.Tensor | None]) -> Any:
    """The input gradients as the message sent upstream (see ``grads_in``)."""
    if not gx or all(g is None for g in gx):
        return None
    return gx[0] if len(gx) == 1 else tuple(gx)
