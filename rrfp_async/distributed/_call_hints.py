"""What a stage module's error about its input says to the user: the note
``TorchStageExecutor`` adds (``add_note``) to an error raised by a stage's module when the
error is about the input it was given (a signature or shape that does not fit), naming the
task and the fix; the stage sends the note with the step's ABORT, so every peer's
``PeerStepError`` carries it too. Any other error keeps its text as it is.
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


def call_hint(
    e: BaseException, task: Task, x: Any, ctx: TaskContext, *, default_input: bool
) -> str | None:
    """The note on ``e``, raised by a stage's module (see ``TorchStageExecutor._call``): the
    task, and how the input was made, when the error is about the input (None otherwise)."""
    text = str(e).lower()
    if not any(frag in text for frag in _INPUT_ERRORS):
        return None
    where = f"rank {ctx.rank} step {ctx.step} {task}: the module of virtual stage {task.stage}"
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
