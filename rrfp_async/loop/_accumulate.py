"""Gradient accumulation over tied parameters: each step adds its own contribution, once.

Design note
-----------
A tied parameter (an embedding and an LM head on two stages) lives as one copy per place,
and each copy's ``.grad`` only sees its own use; at the end of a training step the copies'
gradients are summed and the sum written into every copy. Summing the *whole* ``.grad``
is right only when it held nothing before the step: a training loop that accumulates over
steps (several ``run_step`` calls, then one ``optimizer.step()`` and ``zero_grad()``) would
sum the earlier steps' gradient again on every step (``2 G1 + G2`` after two steps, where
one parameter holds ``G1 + G2``), silently. So a training step first takes each tied copy's
accumulated ``.grad`` out (``stash_grads``: ``.grad`` becomes None, so the step's backward
leaves exactly this step's contribution), the reduction sums the contributions, and at the
end ``restore_grads`` adds the stash back, in the stashed tensor (as autograd accumulates
in place). After every step each copy holds what the one parameter of a single process
would hold, equal up to floating-point summation order.

This is the per-step rule (each step's contribution is reduced at that step), not DDP's
``no_sync()`` (reduce once, on the step that ends an accumulation window): a tied gradient
is then right after every step, whatever the caller does next (an optimizer step, a
gradient norm, a checkpoint), and nothing has to be told where a window ends. Its cost is
one reduction of the tied gradients per step, as without accumulation.

A step that fails or is cancelled restores the stash too (``restore_grads`` runs in a
``finally``): every copy then holds its accumulated gradient plus whatever the failed step's
own backwards had added on this rank, unreduced, exactly as autograd leaves every untied
parameter; the documented recovery (``zero_grad()`` and the next step) is unchanged. A
frozen copy (``requires_grad=False``) keeps ``.grad`` None throughout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["GradStash", "restore_grads", "stash_grads"]

GradStash = list[tuple[nn.Parameter, torch.Tensor | None]]
"""What ``stash_grads`` took out: each parameter with the ``.grad`` it held."""


def stash_grads(params: Iterable[nn.Parameter]) -> GradStash:
    """Take each parameter's ``.grad`` out (set it to None) and return them, each parameter
    once (see the design note)."""
    stash: GradStash = []
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        stash.append((p, p.grad))
        p.grad = None
    return stash


def restore_grads(stash: GradStash) -> None:
    """Add what ``stash_grads`` took out back: ``.grad = stashed + .grad`` (this step's
    contribution, or nothing), accumulated into the stashed tensor."""
    for p, g in stash:
        if g is None:
            continue
        now = p.grad
        if now is not None:
            with torch.no_grad():
                g.add_(now)
        p.grad = g
