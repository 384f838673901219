"""A live view of a stuck job (issue 30 item 3): ``SIGUSR1`` makes every rank write its
state (the step, the running task, what each waiting task waits for and from which rank)
to ``trace_dir/state-rank{r}.txt`` and its log; ``rrfp-async trace DIR`` prints them
beside the merged trace. A step timeout writes them too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import rrfp_async as rr
from rrfp_async.cli import main as cli
from tests._pool import pooled_spawn

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here"),
]


class _Slow(nn.Module):
    """Rank 1's stage: its forward of microbatch 1 in step 1 takes 2 s."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.slow_at: tuple[int, int] | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.slow_at is not None and self.calls == 2:
            time.sleep(2.0)
        return self.lin(x)


def _worker(rank: int, world: int, trace_dir: str, timeout_case: bool) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    torch.manual_seed(rank)
    mod = _Slow()
    ex = rr.TorchStageExecutor({rank: mod}, lambda out, mb: out.pow(2).mean(), rank=rank)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    out: dict[str, Any] = {}
    timeout = 0.8 if timeout_case else 60.0
    stage = rr.DistributedStage(
        layout,
        rr.StepSchedule.build(plan, "1f1b"),
        ex,
        groups=groups,
        trace_dir=trace_dir,
        step_timeout=timeout,
    )

    async def go() -> None:
        async with stage:
            await stage.run_step([torch.randn(2, 3) for _ in range(4)])
            mod.calls = 0
            mod.slow_at = (1, 1) if rank == 1 else None
            if not timeout_case:  # someone sends SIGUSR1 to every rank 1 s into the step
                timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
                timer.start()
            try:
                await stage.run_step([torch.randn(2, 3) for _ in range(4)])
            except rr.RRFPError as e:
                out["error"] = type(e).__name__

    rr.run(go())
    ex.close()
    path = Path(trace_dir) / f"state-rank{rank}.txt"
    out["state"] = path.read_text() if path.exists() else None
    return out


def test_sigusr1_writes_every_ranks_state_and_trace_prints_it(tmp_path: Path) -> None:
    # Fails on the old code: SIGUSR1 killed the process (its default action).
    r0, r1 = pooled_spawn(_worker, 2, str(tmp_path), False, timeout=200)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    s0, s1 = r0["state"], r1["state"]
    assert s0 is not None and s1 is not None
    assert s0.startswith("rank 0 (global 0): state (SIGUSR1) at "), s0
    assert s1.startswith("rank 1 (global 1): state (SIGUSR1) at "), s1
    # Rank 1 is inside its slow forward 1F1; rank 0 waits for what rank 1 sends back.
    assert "rank 1 step 1 " in s1 and "1F1" in s1, s1
    assert "rank 0 step 1 " in s0 and "from rank 1" in s0, s0
    got = CliRunner().invoke(cli, ["trace", str(tmp_path)], env={"COLUMNS": "120"})
    assert got.exit_code == 0, got.output
    for rank in (0, 1):
        assert f"state dump {tmp_path / f'state-rank{rank}.txt'}:" in got.output, got.output
    assert "state (SIGUSR1)" in got.output


def test_a_step_timeout_writes_the_state_too(tmp_path: Path) -> None:
    r0, r1 = pooled_spawn(_worker, 2, str(tmp_path), True, timeout=200)
    assert r0.get("error") and r1.get("error"), (r0, r1)
    timed_out = [r for r in (r0, r1) if r["state"] is not None]
    assert timed_out, (r0, r1)
    assert any("timed out) at " in r["state"] for r in timed_out), timed_out
