"""A KeyboardInterrupt (any BaseException that is no Exception) raised by a stage's module on
the compute thread: the step fails, the stage stays usable, the caller gets the original.

Before: it reached the event loop as it was, ended it, and with it the synchronous face's
portal ("This portal is not running" at the next step and at exit).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn
from tests.distributed._linear import WIDTH, batches, loss

pytestmark = pytest.mark.timeout(240)


class Interruptible(nn.Module):
    """A linear stage whose forward raises ``KeyboardInterrupt`` once, when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.lin(x)


_ONE_PROCESS = textwrap.dedent(
    """
    import torch, rrfp_async as rr
    from tests.distributed.test_interrupted_step import Interruptible
    from tests.distributed._linear import batches, loss

    m = Interruptible()
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    ex = rr.TorchStageExecutor({0: m}, loss)
    stage = rr.DistributedStage(
        rr.ProcessLayout(pp=1, rank=0), rr.StepSchedule.build(plan, "1f1b"), ex,
        groups=rr.distributed.StageGroups(), verify_plan=False, check_ties=False,
    )
    mbs = batches(0, 1, 2)[0]
    out = []
    with stage:
        out.append(stage.run_step_sync(mbs).step)
        m.armed = True
        try:
            stage.run_step_sync(mbs)
        except KeyboardInterrupt:
            out.append("KeyboardInterrupt")
        out.append(stage.run_step_sync(mbs).step)
    print(out)
    """
)


def test_the_sync_face_survives_and_reraises_the_interrupt() -> None:
    got = subprocess.run(
        [sys.executable, "-c", _ONE_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.strip() == "[0, 'KeyboardInterrupt', 2]", got.stdout + got.stderr[-2000:]
    assert "portal is not running" not in got.stderr


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    m = Interruptible()
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    layout = rr.ProcessLayout.from_world(pp=world)
    ex = rr.TorchStageExecutor({rank: m}, loss if rank == world - 1 else None, rank=rank)
    stage = rr.DistributedStage(
        layout,
        rr.StepSchedule.build(plan, "1f1b"),
        ex,
        groups=rr.build_groups(layout),
        step_timeout=60,
    )
    out: dict[str, Any] = {"steps": [], "errors": []}
    with stage:
        for k, mbs in enumerate(batches(0, 3, 4)):
            m.armed = rank == 1 and k == 1
            try:
                out["steps"].append(stage.run_step_sync(mbs).step)
            except KeyboardInterrupt:
                out["errors"].append((k, "KeyboardInterrupt"))
            except rr.PeerStepError as e:
                out["errors"].append((k, f"PeerStepError: {e}"))
    ex.close()
    return out


@pytest.mark.distributed
def test_an_interrupt_on_one_rank_fails_the_step_everywhere_and_the_next_runs() -> None:
    res = pooled_spawn(_worker, 2, timeout=200)
    assert res[1]["errors"] == [(1, "KeyboardInterrupt")]
    ((k, text),) = res[0]["errors"]
    assert k == 1 and "KeyboardInterrupt" in text and "rank 1" in text, text
    for r in res:
        assert r["steps"] == [0, 2]
