"""What a stage module's error about its input says to the user: the note
``TorchStageExecutor`` adds (``add_note``) to an error raised by a stage's module when the
error is about the input it was given (a signature or shape that does not fit), naming the
task and the fix; the stage sends the note with the step's ABORT, so every peer's
``PeerStepError`` carries it too. A module that changes its received input in place gets
one too: that input is a leaf that requires grad (its gradient is what the stage sends
back), which autograd refuses to change in place. Any other error keeps its text as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from .._pytree import tensor_leaves
from .._tasks import Task
from ..loop import TaskContext

__all__ = ["call_hint"]


def _shape_of(value: Any) -> str:
    leaves = tensor_leaves(value)
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    kind = type(value).__name__
    shapes = ", ".join(str(tuple(t.shape)) for t in leaves[:4])
    return f"a {kind} of {len(leaves)} tensor(s) ({shapes}{', ...' if len(leaves) > 4 else ''})"


_INPUT_ERRORS = (
    "positional argument",
    "unexpected keyword argument",
    "missing 1 required",
    "missing 2 required",
    "shapes cannot be multiplied",
    "must match the size of tensor",
    "size mismatch",
    "expected input",
    "expected 2d",
    "expected 3d",
    "expected 4d",
    "input type",
    "not enough values to unpack",
    "too many values to unpack",
    "cannot unpack",
)
"""Message fragments (lower case) of the errors a module raises on an input it was not built
for: what ``call_hint`` explains. Other errors keep their text as it is."""

_IN_PLACE = "leaf variable that requires grad is being used in an in-place operation"
"""autograd's refusal to change a leaf that requires grad (or a view of one) in place."""


def call_hint(
    e: BaseException, task: Task, x: Any, ctx: TaskContext, *, default_input: bool
) -> str | None:
    """The note on ``e``, raised by a stage's module (see ``TorchStageExecutor._call``): the
    task, and how the input was made, when the error is about the input (None otherwise)."""
    text = str(e).lower()
    where = f"rank {ctx.rank} step {ctx.step} {task}: the module of virtual stage {task.stage}"
    if _IN_PLACE in text:
        return _in_place_hint(where, task, x)
    if not any(frag in text for frag in _INPUT_ERRORS):
        return None
    if task.stage == 0:
        if default_input and isinstance(x, tuple):
            return (
                f"{where} was called as module(*microbatch) with microbatch {task.mb}, a"
                f" {type(x).__name__} of {len(x)} values. If only part of it is the model's"
                " input (e.g. (inputs, target)), pass TorchStageExecutor(input_fn=lambda mb:"
                " mb[0]) and read the rest in loss_fn(output, microbatch); return rr.Args(...)"
                " from input_fn for several arguments or keywords"
            )
        return (
            f"{where} failed on microbatch {task.mb} ({_shape_of(x)}), given as"
            " TorchStageExecutor's input_fn makes it (default: Microbatch.data or the"
            " microbatch; a tuple is unpacked into positional arguments)"
        )
    return (
        f"{where} failed on its input from virtual stage {task.stage - 1}, {_shape_of(x)}: the"
        f" output of stage {task.stage - 1} must fit this stage's forward (where the model is"
        " split, and what each stage returns)"
    )


def _in_place_hint(where: str, task: Task, x: Any) -> str:
    """The note on autograd's refusal of an in-place change of a leaf that requires grad:
    the stage's received input (on a stage after the first, when it needs grad) or one of
    its parameters."""
    received = task.stage > 0 and any(t.requires_grad for t in tensor_leaves(x))
    if not received:
        return (
            f"{where} changed a leaf tensor that requires grad in place (microbatch"
            f" {task.mb}): on this stage that is one of its parameters (its input needs no"
            " grad). Change parameters outside the forward (or under torch.no_grad()), and"
            " compute with out-of-place ops (x = x + y, not x.add_(y))"
        )
    return (
        f"{where} changed its input in place (microbatch {task.mb}, received from virtual"
        f" stage {task.stage - 1}: {_shape_of(x)}): at the stage boundary the input is a leaf"
        f" that requires grad (its gradient is what goes back to stage {task.stage - 1}), and"
        " autograd refuses to change such a leaf in place (a parameter is one too). Copy it"
        " first (x = x.clone(), then change the copy) or use the out-of-place op (x = x + y"
        " for x.add_(y), nn.ReLU() without inplace=True)"
    )
