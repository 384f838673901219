"""The hint of the torch drop-in: an rrfp_async hint name, or a torch schedule's own order.

A torch schedule given as the hint (a class or a name: ``Schedule1F1B``,
``"Interleaved1F1B"``, ``ScheduleZBVZeroBubble``) brings its own order, task for task
(``policies._torch_hints.hint_from_torch``, which asks torch for it at each step's size), its
own input/weight split of the backward (``I``/``W``) and, for V-shape, its placement, which
must match the placement of the stages this rank holds (where those fit both placements, the
hint's is taken). Without a hint: the project's default (``breadth_first_weighted``), or
torch's ``ZBVZeroBubble`` order for V-shape stages (the generated hints are interleaved-only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import PlanError
from .._tasks import StepPlan, Task, Topology
from ..policies import hint_from_torch

__all__ = ["hint_source"]


def hint_source(
    hint: Any, topologies: Sequence[Topology], microbatches: int
) -> tuple[Topology, Any, bool]:
    """``(topology, hint, split)``: of ``topologies`` (what this rank's stages fit,
    ``_torch_stages.stage_topologies``: interleaved first, and V-shape too where the stages
    fit both), the one the hint places stages in; the hint, a name or a generator that asks
    torch for its order at each step's size; and whether that order splits the backward
    (I/W). Checked now (at ``microbatches``), so that a bad schedule fails at construction,
    not at the first step.

    Raises:
        PlanError: The hint places stages otherwise than this rank's stages are placed.
        HintError: torch's schedule refuses the size (from ``hint_from_torch``).
    """
    by_placement = {t.placement: t for t in topologies}
    interleaved = by_placement.get("interleaved")
    if hint is None:
        if interleaved is None:  # our generated hints are interleaved-only
            hint = "ZBVZeroBubble"
        else:
            return interleaved, "breadth_first_weighted", False
    if isinstance(hint, str):
        from ..policies import canonical_hint_name

        try:
            canonical_hint_name(hint)
        except Exception:
            pass  # not one of ours: a torch schedule name
        else:
            if interleaved is None:
                raise PlanError(
                    f"hint {hint!r} orders interleaved placement; this rank's stages are"
                    " V-shape: give a V-shape torch schedule as the hint"
                    " (ScheduleZBVZeroBubble, ScheduleDualPipeV)"
                )
            return interleaved, hint, False
    topo = topologies[0]
    plan, _ = hint_from_torch(
        hint, stages=topo.stages, microbatches=microbatches, chunks=topo.chunks
    )
    # Where the stages fit both placements (the middle rank of an odd number of ranks),
    # torch's schedule decides, as its constructor remaps torch's stages.
    chosen = by_placement.get(plan.topology.placement)
    if chosen is None:
        raise PlanError(
            f"hint {hint!r} places stages {plan.topology.placement}, but this rank's"
            f" stages are placed {topo.placement}"
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
    return chosen, from_torch, plan.split_backward
