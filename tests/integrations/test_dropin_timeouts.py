"""The drop-ins wait as long as the peer would: their default watchdog is the process group's
own timeout (``step_timeout="group"``), not ``DistributedStage``'s 30 s.

torch's pipelining tutorial (a 2 x 4-layer transformer, 4 microbatches of 8 x 500 tokens)
takes minutes a step on a loaded 2-core CPU with torch's own ``ScheduleGPipe``; under a 30 s
watchdog the drop-in failed it with a ``StepTimeoutError`` where torch finished.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rrfp_async import PlanError
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.integrations._timeouts import group_timeout
    from rrfp_async.pipelining import ScheduleReadinessFirst

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def build(group: Any = None, **kw: Any) -> ScheduleReadinessFirst:
        stage = PipelineStage(nn.Linear(4, 4), rank, world, torch.device("cpu"), group=group)
        return ScheduleReadinessFirst(stage, 2, loss_fn=loss_fn, **kw)

    slow = dist.new_group(timeout=timedelta(seconds=41))
    got: dict[str, Any] = {
        "world": group_timeout(None),
        "new_group": group_timeout(slow),
        "default": build()._step_timeout,
        "on_new_group": build(slow)._step_timeout,
        "seconds": build(step_timeout=5.0)._step_timeout,
        "none": build(step_timeout=None)._step_timeout,
    }
    try:
        build(step_timeout="forever")  # type: ignore[arg-type]
    except PlanError as e:
        got["refused"] = str(e)
    sched = build()  # and it steps
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    sched.step(x) if rank == 0 else sched.step(target=y)
    return got


def test_the_default_watchdog_is_the_process_groups_timeout() -> None:
    for got in pooled_spawn(_worker, 2, pg_timeout=77.0, timeout=150):
        assert got["world"] == 77.0 and got["new_group"] == 41.0
        assert got["default"] == 77.0  # the stage's group: the default group here
        assert got["on_new_group"] == 41.0
        assert got["seconds"] == 5.0 and got["none"] is None
        assert "'group'" in got["refused"] and "'forever'" in got["refused"]
