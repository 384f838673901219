"""One call of the megatron drop-in: its arguments and Megatron's gradient-sync moves.

Design note
-----------
Gradient synchronisation follows Megatron's schedules, with "the last backward" read as the
last one this rank *runs* (under strict, Megatron's): ``no_sync_func`` (one, or one per
chunk) is entered for the step. Without interleaving it is left right before the last
backward (with a ``grad_sync_func``, only on pipeline rank 0; the others call
``grad_sync_func(model.parameters())`` after their last backward). Interleaved, it is left
around each chunk's last backward (without a ``grad_sync_func``), or each chunk's
``grad_sync_func`` runs right after that chunk's last backward; then it is left for good and
the chunks not yet synchronised are. A chunk's last backward depends on every other backward
of the chunk and on the next chunk's, so on every rank the chunks complete in the order
``V-1 .. 0`` whatever the dispatch: the data-parallel collectives these launch match across
replicas. Interleaved training steps first call every chunk's ``param_sync_func`` in chunk
order (Megatron calls chunks 0 and 1 there and later chunks just before their first
forward). Then ``finalize_model_grads_func(model chunks, num_tokens or None,
pg_collection=..., force_all_reduce=...)`` (``MegatronForwardBackward.__call__``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MegatronCall", "per_chunk"]


def per_chunk(fn: Any, chunks: int) -> list[Any]:
    """A config hook given once or once per chunk (megatron accepts both)."""
    return list(fn) if isinstance(fn, (list, tuple)) else [fn] * chunks


class MegatronCall:
    """One call's arguments and gradient-sync state, read by the executor's tasks."""

    def __init__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        config: Any,
        models: list[Any],
        microbatches: int,
        forward_only: bool,
        collect_non_loss_data: bool,
        first_val_step: bool | None,
        cp_size: int,
        pp_rank: int,
        pp: int,
        interleaved: bool,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.config = config
        self.models = models
        self.microbatches = microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.grad_enabled = torch.is_grad_enabled() or not forward_only
        self.cp_size = cp_size
        self.pp_rank = pp_rank
        self.pp = pp
        self.interleaved = interleaved
        self.store: dict[int, list[Any]] = {}
        self.num_tokens: dict[tuple[int, int], torch.Tensor] = {}
        self.backwards = [0] * len(models)  # per chunk
        self.synced: set[int] = set()
        self.grad_sync = (
            None if config.grad_sync_func is None else per_chunk(config.grad_sync_func, len(models))
        )
        # As megatron: no no_sync_func is a null context (so "sync disabled" is tracked).
        self._no_sync_func = config.no_sync_func or contextlib.nullcontext
        self.no_sync: contextlib.AbstractContextManager[Any] | None = None

    def disable_grad_sync(self) -> None:
        f = self._no_sync_func
        if self.no_sync is None:
            if isinstance(f, (list, tuple)):  # one per chunk: megatron's multi_no_sync
                stack = contextlib.ExitStack()
                for g in f:
                    stack.enter_context(g())
                self.no_sync = stack
            else:
                self.no_sync = f()
                self.no_sync.__enter__()

    def enable_grad_sync(self) -> None:
        ctx, self.no_sync = self.no_sync, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def backward(self, chunk: int, run: Callable[[], Any]) -> Any:
        """Run one backward of ``chunk`` with megatron's gradient-sync moves around it."""
        self.backwards[chunk] += 1
        last = self.backwards[chunk] == self.microbatches
        if not self.interleaved:
            if last and (self.grad_sync is None or self.pp_rank == 0):
                self.enable_grad_sync()  # the last backward launches the grad reduction
            return run()
        if last and self.grad_sync is None:
            self.enable_grad_sync()
            self.synced.add(chunk)
        out = run()
        if last and self.grad_sync is not None:
            self.enable_grad_sync()
            self.grad_sync[chunk](self.models[chunk].parameters())
            self.synced.add(chunk)
        self.disable_grad_sync()
        return out

    def finish_grad_sync(self) -> None:
        """After the step's last backward: megatron's final moves."""
        if not self.interleaved:
            was_disabled = self.no_sync is not None
            self.enable_grad_sync()
            if was_disabled and self.grad_sync is not None:
                self.grad_sync[0](self.models[0].parameters())
            return
        self.enable_grad_sync()
        if self.grad_sync is not None:
            for c in range(len(self.models)):
                if c not in self.synced:
                    self.grad_sync[c](self.models[c].parameters())
                    self.synced.add(c)
