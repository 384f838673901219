"""Whether a drop-in's training forwards draw random numbers (``DrawWatch``).

Design note
-----------
The Megatron and DeepSpeed drop-ins keep the peer's randomness (``task_rng=False``): a
forward draws from the global generators as they stand, in the order the forwards run. The
peer's order runs each stage's forwards in microbatch order, and so does that order run
readiness-first (a stage's forwards wait for the previous stage's, which come in its
order). The learned, cost-aware plan does not: it may start a heavy microbatch first. A
forward that draws (dropout) would then take another microbatch's numbers, and the result
would differ from the peer's with no error. So the drop-ins watch their training forwards:
the generators' states before and after each (the CPU one, the current CUDA device's once
CUDA is in use, and any the peer keeps of its own: Megatron's CUDA RNG tracker's named
states), until one moves. ``StepLearning`` all-reduces the flag before the next step's
sizes (one small collective while it reads sizes) and, where any rank's forwards drew, stops
planning: every later step runs the peer's order, a ``RuntimeWarning`` says why once, and
the drop-in's ``learning_off`` names the reason. The first steps of a job run the peer's order
anyway (nothing is fitted yet), so a model that draws from its first forward never runs a
learned plan; one that starts drawing later runs learned plans until the step after.

Price: one copy of the CPU generator's state (5 KB) before and after each training forward
and the small all-reduce before each step whose sizes are read, while learning is on; a job
whose steps are of one size stops reading sizes, and watching, after its first two.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["DrawWatch", "megatron_tracker_states"]

States = Callable[[], list[object]]
"""More generator states to watch (the peer's own), each a tensor or a ``torch.Generator``."""


class DrawWatch:
    """Whether a watched forward drew from the global random generators.

    Args:
        extra: The peer's own generator states, read before and after each forward (each a
            tensor or a ``torch.Generator``), or None.
    """

    def __init__(self, extra: States | None = None) -> None:
        self._extra = extra
        self.drew = False
        """Whether a watched forward moved a generator's state (stays True)."""
        self.on = True
        """Whether forwards are watched (off once learning is: nothing depends on it then)."""

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Around one training forward: ``drew`` becomes True if the forward drew."""
        if self.drew or not self.on:
            yield
            return
        before = self._states()
        yield
        if not _same(before, self._states()):
            self.drew = True

    def _states(self) -> list[torch.Tensor]:
        states = [torch.random.get_rng_state()]
        # (a CPU job on a GPU machine starts no context)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            states.append(torch.cuda.get_rng_state())
        if self._extra is not None:
            for s in self._extra():
                if isinstance(s, torch.Generator):
                    states.append(s.get_state())
                elif isinstance(s, torch.Tensor):
                    states.append(s.detach().to("cpu", copy=True))
        return states


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def megatron_tracker_states() -> list[object]:
    """The named states of Megatron's CUDA RNG tracker (its dropout in tensor-parallel
    regions forks them), where Megatron has built it; none otherwise (reading it through
    ``get_cuda_rng_tracker()`` would build one)."""
    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    if mod is None or not getattr(mod, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return []
    tracker = getattr(mod, "_CUDA_RNG_STATE_TRACKER", None)
    get = getattr(tracker, "get_states", None)
    if get is None:
        return []
    states = get()
    return list(states.values()) if isinstance(states, dict) else []
