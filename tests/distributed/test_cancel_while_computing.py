"""A rank's step cancelled while its task computes, across processes.

Rank 1 of 2 cancels step 1 (``asyncio.timeout``) while its forward blocks on its compute
thread; the forward is released only once rank 0 has seen the failure (a flag file rank 0
writes when its step raises ``PeerStepError``), or after 15 s. So:

* the peers are told *before* the cancelled rank waits for its running task (else rank 0 would
  learn it only once the forward ended: the 15 s fallback, recorded as such); and
* the cancelled rank's ``run_step`` raises only after its forward ended (it is waited for), so
  nothing of step 1 lands after that rank's ``zero_grad``: both ranks' parameters equal one
  process trained on steps 0, 2 and 3 (causality, not wall time).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn
from tests.distributed._linear import WIDTH, batches, check_params, loss, reference

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS, M, FAILED = 4, 2, 1
FALLBACK = 15.0


class _Stage(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(100 + rank)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.left = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(FALLBACK + 5)
            self.left.set()
        return torch.tanh(self.lin(x))


def _batches() -> list[list[torch.Tensor]]:
    return batches(11, STEPS, M)


def _worker(rank: int, world: int, flag: str) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    mod = _Stage(rank)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    ex = rr.TorchStageExecutor({rank: mod}, loss, rank=rank)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
    stage = rr.DistributedStage(
        layout, rr.StepSchedule.build(plan, "1f1b"), ex, groups=groups, step_timeout=60.0
    )
    out: dict[str, Any] = {"steps": [], "errors": {}}
    released = threading.Event()

    def release_on_flag() -> None:  # rank 1: open the gate once rank 0 saw the failure
        deadline = time.monotonic() + FALLBACK
        while time.monotonic() < deadline and not os.path.exists(flag):
            time.sleep(0.01)
        out["released_by_peer"] = os.path.exists(flag)
        released.set()

    async def main() -> None:
        async with stage:
            for k, mbs in enumerate(_batches()):
                try:
                    if k == FAILED and rank == 1:
                        mod.gate = released
                        threading.Thread(target=release_on_flag, daemon=True).start()
                        try:
                            async with asyncio.timeout(60) as cm:
                                t = asyncio.ensure_future(stage.run_step(mbs))
                                await asyncio.to_thread(mod.entered.wait, 30)
                                cm.reschedule(asyncio.get_running_loop().time())
                                await t
                        except TimeoutError:
                            out["forward_ended_before_raise"] = mod.left.is_set()
                            out["errors"][k] = "TimeoutError"
                        mod.gate = None
                    else:
                        out["steps"].append((await stage.run_step(mbs)).step)
                        opt.step()
                except rr.PeerStepError as e:
                    out["errors"][k] = type(e).__name__
                    await asyncio.to_thread(Path(flag).touch)  # rank 0: the failure reached it
                finally:
                    opt.zero_grad()  # a failed step's gradients are discarded

    try:
        rr.run(main())
    finally:
        ex.close()
    out["params"] = {k: v.detach().clone() for k, v in mod.state_dict().items()}
    return out


def test_a_rank_cancelled_while_computing_tells_first_then_waits_for_its_task(
    tmp_path: Path,
) -> None:
    res = pooled_spawn(_worker, 2, str(tmp_path / "rank0-saw-it"), timeout=150)
    for r in res:
        assert r["steps"] == [0, 2, 3], r["errors"]
    assert res[0]["errors"] == {FAILED: "PeerStepError"}
    assert res[1]["errors"] == {FAILED: "TimeoutError"}
    # Told before its task was waited for: rank 0 learnt it while the forward still blocked.
    assert res[1]["released_by_peer"], "rank 0 learnt of the failure only after the forward"
    assert res[1]["forward_ended_before_raise"], "run_step raised while the forward ran"
    check_params(res, reference([_Stage(r) for r in range(2)], _batches(), skip=FAILED))
