"""A step fails everywhere or nowhere (ARCHITECTURE invariant 6), across processes.

One rank of a 2- or 3-rank pipeline (``TorchStageExecutor``, a small ``nn.Linear`` per
stage, SGD) fails step 1 of 5 — its executor raises, its caller cancels the step
(``asyncio.timeout``), or it makes a refused concurrent ``run_step``. Every rank must fail
that same step at once (the origin's ABORT, not the 20 s watchdog), naming the origin, and
then run steps 2-4 in lockstep; each rank's training loop discards the failed step's
gradients (``zero_grad``), so the final parameters must equal one process trained on the
other four steps' microbatches. A refused call changes nothing: all five steps run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn
from tests.distributed._linear import WIDTH, batches, check_params, loss, reference

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("p2p_io"),  # under both receive modes of the channel
]

STEPS, M, FAILED = 5, 4, 1
STEP_TIMEOUT = 20.0
VICTIM = {2: {"raise": 1, "cancel": 1, "refuse": 1}, 3: {"raise": 1, "cancel": 2, "refuse": 1}}
"""World size -> scenario -> the rank whose step 1 fails (a middle rank: the ABORT travels
both ways; the last rank: it travels two hops)."""


class _Stage(nn.Module):
    """A linear stage whose forward can be told to raise (on its second call) or to sleep."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(100 + rank)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.boom = False
        self.sleep = 0.0
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.boom and self.calls == 2:
            raise RuntimeError("boom")
        if self.sleep:
            time.sleep(self.sleep)
        return torch.tanh(self.lin(x))


def _batches() -> list[list[torch.Tensor]]:
    return batches(7, STEPS, M)


def _scenario(rank: int, world: int, which: str) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    victim = VICTIM[world][which]
    mod = _Stage(rank)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    ex = rr.TorchStageExecutor({rank: mod}, loss, rank=rank)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
    stage = rr.DistributedStage(
        layout, rr.StepSchedule.build(plan, "1f1b"), ex, groups=groups, step_timeout=STEP_TIMEOUT
    )
    out: dict[str, Any] = {"steps": [], "errors": {}}

    async def main() -> None:
        async with stage:
            for k, mbs in enumerate(_batches()):
                mod.calls = 0
                mod.boom = which == "raise" and rank == victim and k == FAILED
                # Rank 0 is slow in step 1: the cancelled (or refused) rank is then idle,
                # waiting for rank 0's first forward, when its caller cancels (or calls).
                mod.sleep = (
                    0.6 if which in ("cancel", "refuse") and rank == 0 and k == FAILED else 0.0
                )
                t0 = time.monotonic()
                try:
                    if k == FAILED and rank == victim and which == "cancel":
                        async with asyncio.timeout(0.2):
                            await stage.run_step(mbs)
                    elif k == FAILED and rank == victim and which == "refuse":
                        running = asyncio.ensure_future(stage.run_step(mbs))
                        await asyncio.sleep(0.1)
                        try:
                            await stage.run_step(mbs)
                        except rr.PlanError as e:
                            out["refused"] = str(e)
                        out["steps"].append((await running).step)
                    else:
                        out["steps"].append((await stage.run_step(mbs)).step)
                    opt.step()
                except Exception as e:
                    out["errors"][k] = (type(e).__name__, str(e), time.monotonic() - t0)
                    if isinstance(e, rr.PeerStepError):
                        out["errors"][k] += (e.step, e.origin, e.cause)
                finally:
                    opt.zero_grad()  # a failed step's gradients are discarded, as a user would
                mod.sleep = 0.0

    try:
        rr.run(main())
    finally:
        ex.close()
    out["params"] = {k: v.detach().clone() for k, v in mod.state_dict().items()}
    out["late"] = len(stage.stage.late_failures)
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    res = {}
    for which in ("raise", "cancel", "refuse"):
        res[which] = _scenario(rank, world, which)
        dist.barrier()
    return res


def _reference(world: int, skip: int | None) -> list[dict[str, torch.Tensor]]:
    """One process, every stage composed, trained on every step but ``skip``."""
    return reference([_Stage(r) for r in range(world)], _batches(), skip)


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_that_fails_on_one_rank_fails_on_every_rank_and_the_next_runs(world: int) -> None:
    res = pooled_spawn(_worker, world, timeout=240)
    skipped = _reference(world, FAILED)
    for which in ("raise", "cancel"):
        victim = VICTIM[world][which]
        runs = [r[which] for r in res]
        for rank, r in enumerate(runs):
            assert r["steps"] == [0, 2, 3, 4], (which, rank, r["errors"])
            assert set(r["errors"]) == {FAILED}, (which, rank, r["errors"])
            kind, msg, took = r["errors"][FAILED][:3]
            if rank == victim:
                assert kind == ("RuntimeError" if which == "raise" else "TimeoutError"), msg
                continue
            assert kind == "PeerStepError", (which, rank, msg)
            assert f"step 1 failed on rank {victim} (global {victim}): " in msg, msg
            step, origin, cause = r["errors"][FAILED][3:]
            assert (step, origin) == (FAILED, victim)
            if which == "raise":
                assert cause == "RuntimeError: boom", cause
            else:
                assert cause.startswith("the step was cancelled there"), cause
            # Told by the origin, not by the watchdog (20 s); rank 0 finishes the slow
            # forward it runs (0.6 s) before it sees the failure.
            assert took < 5.0, (which, rank, took)
            assert r["late"] == 0
        check_params(runs, skipped)
    # A refused concurrent call changes nothing: every step runs on every rank.
    victim = VICTIM[world]["refuse"]
    runs = [r["refuse"] for r in res]
    for rank, r in enumerate(runs):
        assert r["steps"] == list(range(STEPS)) and r["errors"] == {}, (rank, r)
    assert "run_step is already running step 1" in runs[victim]["refused"], runs[victim]
    assert "This call changed nothing" in runs[victim]["refused"]
    check_params(runs, _reference(world, None))
