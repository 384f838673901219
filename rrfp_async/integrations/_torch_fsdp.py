"""FSDP-wrapped stages under the torch drop-in: what ``ScheduleReadinessFirst`` refuses.

Two refusals, both named in a ``PlanError``: the split backward (``I``/``W`` as separate
tasks) on a stage with FSDP-managed parts, and torch 2.15's ``step(finalize_gradients=False)``
on FSDP stages (FSDP stages are not supported by the drop-in at all; the split backward is
where a silent loss would otherwise be possible, see ``refuse_fsdp_split``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import PlanError

__all__ = ["check_finalize", "fsdp_parts", "refuse_fsdp_split"]


def fsdp_parts(module: Any) -> list[str]:
    """The submodules of ``module`` that FSDP manages (FSDP2's ``fully_shard`` or FSDP1).
    Looked up in ``sys.modules``: a module is wrapped only once FSDP is imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, torch.nn.Module):
        return []
    kinds = tuple(
        c
        for c in (
            # FSDP2's FSDPModule and FSDP1's class: either may be missing from a torch version.
            getattr(fsdp, "FSDPModule", None),
            getattr(fsdp, "FullyShardedDataParallel", None),
        )
        if isinstance(c, type)
    )
    return [n or "(the stage)" for n, m in module.named_modules() if kinds and isinstance(m, kinds)]


def refuse_fsdp_split(stages: Sequence[Any], hint: Any) -> None:
    """The split backward's W calls the autograd nodes of the weight gradients itself
    (``_split_backward``), outside the engine, so FSDP's hooks never run for it: its
    parameters are not unsharded for W (resharded storage: "data is not allocated yet") and
    the gradients would bypass its reduce-scatter (silently lost where the storage is kept).
    Refused, naming the wrapped parts."""
    for s in stages:
        parts = fsdp_parts(s.submod)
        if parts:
            raise PlanError(
                f"stage {s.stage_index}: the split backward (input and weight gradients as"
                f" separate tasks, which hint {hint!r} or split_backward=True asks for) is not"
                f" supported on FSDP-wrapped modules ({', '.join(parts[:3])}): W would run past"
                " FSDP's unshard and reduce-scatter. Use an order without the split (1F1B,"
                " Interleaved1F1B, LoopedBFS, an rrfp_async hint other than zb_h1) or a stage"
                " without FSDP"
            )


def check_finalize(finalize_gradients: bool, stages: Sequence[Any]) -> None:
    """torch 2.15's ``step(finalize_gradients=...)``: a bool; ``False`` (defer FSDP's
    gradient reduction) has no effect without FSDP, as in torch, and is refused on FSDP
    stages."""
    if not isinstance(finalize_gradients, bool):
        raise TypeError(f"finalize_gradients must be a bool, got {finalize_gradients!r}")
    if finalize_gradients:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    fsdp = [s.stage_index for s in stages if isinstance(s.submod, FSDPModule)]
    if fsdp:
        raise PlanError(
            f"finalize_gradients=False with FSDP stages {fsdp}: FSDP stages are not"
            " supported by ScheduleReadinessFirst"
        )
