"""The hint of the torch drop-in: an rrfp_async hint name, or a torch schedule's own order.

A torch schedule given as the hint (a class or a name: ``Schedule1F1B``,
``"Interleaved1F1B"``, ``ScheduleZBVZeroBubble``) brings its own order, task for task
(``policies._torch_hints.hint_from_torch``, which asks torch for it at each step's size), its
own input/weight split of the backward (``I``/``W``) and, for V-shape, its placement, which
must match the placement of the stages this rank holds. Without a hint: the project's
default (``breadth_first_weighted``), or torch's ``ZBVZeroBubble`` order for V-shape stages
(the generated hints are interleaved-only).
"""

from __future__ import annotations

from typing import Any

from .._errors import PlanError
from .._tasks import Placement, StepPlan, Task, Topology
from ..policies import hint_from_torch

__all__ = ["hint_source"]


def hint_source(
    hint: Any, placement: Placement, topo: Topology, microbatches: int
) -> tuple[Any, bool]:
    """``(hint, split)``: a hint name, or a generator that asks torch for its order at
    each step's size; ``split`` is whether that order splits the backward (I/W). Checked now
    (at ``microbatches``), so that a bad schedule fails at construction, not at the first
    step."""
    if hint is None:
        if placement == "vshape":  # our generated hints are interleaved-only
            hint = "ZBVZeroBubble"
        else:
            return "breadth_first_weighted", False
    if isinstance(hint, str):
        from ..policies import canonical_hint_name

        try:
            canonical_hint_name(hint)
        except Exception:
            pass  # not one of ours: a torch schedule name
        else:
            if placement == "vshape":
                raise PlanError(
                    f"hint {hint!r} orders interleaved placement; this rank's stages are"
                    " V-shape: give a V-shape torch schedule as the hint"
                    " (ScheduleZBVZeroBubble, ScheduleDualPipeV)"
                )
            return hint, False
    plan, _ = hint_from_torch(
        hint, stages=topo.stages, microbatches=microbatches, chunks=topo.chunks
    )
    if plan.topology.placement != placement:
        raise PlanError(
            f"hint {hint!r} places stages {plan.topology.placement}, but this rank's"
            f" stages are placed {placement}"
        )

    def from_torch(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
        _, order = hint_from_torch(
            hint,
            stages=topo.stages,
            microbatches=plan.microbatches,
            chunks=topo.chunks,
            split_backward=plan.split_backward,
        )
        return order

    name = hint if isinstance(hint, str) else getattr(hint, "__name__", "torch")
    from_torch.__name__ = f"torch:{name}"
    return from_torch, plan.split_backward
