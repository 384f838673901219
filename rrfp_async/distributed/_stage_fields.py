"""The state that the parts of ``DistributedStage`` share.

``DistributedStage`` (``_dist_stage``: the wiring, opening and closing, ``run_step``) is
assembled from parts, one concept per module, over the state declared here
(``StageFields``): the synchronous face (``_sync_face``), the plan and step checks
(``_plan_check``), the end-of-step agreement (``_step_agreement``), telling a failed step to
the peers (``_step_failure``), the tied and data-parallel gradient reductions
(``_stage_grads``) and the traces and state dumps (``_stage_trace``); the registry of p2p
groups in use is ``_p2p_registry``. Every part is a mixin of ``DistributedStage`` only: the
attributes are set by its ``__init__``, and a part calls another's methods through the
stubs below (each defined in ``DistributedStage`` or a part), so that every part type-checks
on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..channels import DecisionChannel, P2PChannel
from ..loop import StageLoop, StepStats, SyncPortal
from ..observability import TraceRecorder
from ..policies import StepSchedule
from ._layout import ProcessLayout, StageGroups

__all__ = ["StageFields"]


class StageFields:
    """What the parts of ``DistributedStage`` share (set by its ``__init__`` and
    ``__aenter__``), and the few methods each part calls on another."""

    layout: ProcessLayout
    groups: StageGroups
    stage: StageLoop
    channel: P2PChannel
    decisions: DecisionChannel | None
    step_timeout: float | None
    max_message_bytes: int
    verify_plan: bool
    check_ties: bool
    agree_steps: bool
    trace_dir: Path | None
    plan_checks: int
    plan_check_seconds: float
    _device: torch.device
    _has_peers: bool
    _emulated: bool
    _recorder: TraceRecorder | None
    _tie_spec: dict[str, tuple[tuple[int, str], ...]]
    _tie_groups: dict[str, tuple[Any, list[int]]] | None
    _ties_checked: bool
    _next_step: int
    _running: int | None  # the step run_step runs now
    _told: int | None  # the last step whose failure was told (_tell_failure)
    _agreed: tuple[object, ...] | None  # the plan key of the last plan check
    _control_broken: BaseException | None  # the control group can no longer be used
    _state: str  # "new" -> "open" (async with / with) -> "closed"
    _loop: asyncio.AbstractEventLoop | None  # the loop it was opened on
    _portal: SyncPortal | None  # the sync face's loop thread (with)
    _p2p_key: int | None

    def _who(self) -> str:
        return f"rank {self.layout.pp_rank} (global {self.layout.rank})"

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> StepStats:
        raise NotImplementedError

    def dump_state(self, reason: str = "requested") -> Path | None:
        raise NotImplementedError
