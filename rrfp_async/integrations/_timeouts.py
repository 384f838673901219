"""The drop-ins' default watchdog: as long as the peer would wait.

torch's schedules and Megatron's have no per-step watchdog: a rank that waits for a peer
waits as long as the process group's own timeout (``init_process_group(timeout=...)`` /
``new_group(timeout=...)``; 30 minutes on gloo by default), then fails. A drop-in with a
shorter watchdog fails a step the peer would have finished — a legitimately slow one (a
large model on a CPU, a first step that compiles) — so the drop-ins default to
``step_timeout="group"``: the timeout of the process group their stages were built on.
``DistributedStage`` keeps its own 30 s default: code written for the runtime chose it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._errors import PlanError

__all__ = ["GROUP_TIMEOUT", "StepTimeout", "group_timeout", "resolve_step_timeout"]

GROUP_TIMEOUT: Literal["group"] = "group"
"""``step_timeout`` that waits as long as the stages' process group does (the default)."""

StepTimeout = float | None | Literal["group"]


def group_timeout(group: Any) -> float:
    """Seconds torch.distributed waits on ``group`` (None: the default group) before an
    operation fails: the timeout it was created with, else torch's default for gloo."""
    pg: Any = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or a torch without these names
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout.total_seconds()
    return float(dist.default_pg_timeout.total_seconds())


def resolve_step_timeout(step_timeout: StepTimeout, group: Any) -> float | None:
    """The watchdog in seconds (or None: none) for ``step_timeout`` as a drop-in takes it."""
    if isinstance(step_timeout, str):
        if step_timeout != GROUP_TIMEOUT:
            raise PlanError(
                f"step_timeout must be seconds (a number > 0), None (no watchdog) or"
                f" {GROUP_TIMEOUT!r} (the process group's own timeout), got {step_timeout!r}"
            )
        return group_timeout(group)
    return step_timeout
