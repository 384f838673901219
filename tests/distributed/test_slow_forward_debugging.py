"""Issue 17's scenario: one slow forward in a 4-process run, found from what the job wrote.

4 ranks (gloo), a tanh(Linear) stage each, 8 microbatches, the strict policy (a fixed order)
under the 1F1B hint; every forward takes 20 ms (a sleep: emulated GPU time) except rank 1's
forward of microbatch 3 (1F3), which takes 400 ms. The microbatch index travels with the
activations (a ``(tensor, int)`` pytree), so the slow task is injected by name. Each rank
writes debug JSON logs to its own file and its trace with ``trace_dir=`` (one argument);
the test then reads only those files, as a user would (step 1: step 0 warms up):

* the merged trace (``rr.merge_traces``) and its stall analysis (``rr.stalls``, what
  ``rrfp-async trace DIR`` prints) name 1F3 on rank 1 as the one slow task, and the tasks
  that waited for it include its consumers 2F3 and 3F3, each waiting for its producer's
  message; every wait's root is 1F3 or nothing (the pipeline's fill and drain);
* the logs' stall reasons on ranks 2 and 3 say what they wait for, by message and rank
  (``... for 2F3 <- message 1F3 from rank 1``), and no stall reason is false (an
  "admission bound reached" line always has its in-flight count at the bound).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

P, M, WIDTH = 4, 8, 8
BASE, SLOW = 0.02, 0.4
SLOW_RANK, SLOW_MB = 1, 3
STEPS = 2
"""Step 0 warms up (a rank's first backward costs ~0.3 s here: autograd's start-up); the
slow forward is in every step, the trace and the checked log lines are step 1's."""


class _Stage(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.rank = rank
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, idx: int) -> tuple[torch.Tensor, int]:
        time.sleep(SLOW if (self.rank, idx) == (SLOW_RANK, SLOW_MB) else BASE)
        return torch.tanh(self.lin(x)), idx


def _loss(out: tuple[torch.Tensor, int], mb: Any) -> torch.Tensor:
    return out[0].pow(2).mean()


def _worker(rank: int, world: int, out_dir: str) -> int:
    d = Path(out_dir)
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    with open(d / f"rank{rank}.log", "w") as log:
        rr.configure_logging(format="json", level="debug", stream=log)
        ex = rr.TorchStageExecutor({rank: _Stage(rank)}, _loss, rank=rank)
        plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
        stage = rr.DistributedStage(
            layout,
            rr.StepSchedule.build(plan, "1f1b"),
            ex,
            groups=groups,
            policy="strict",
            observer=rr.LogObserver(rank=rank),
            trace_dir=d / "traces",
            step_timeout=60.0,
        )
        g = torch.Generator().manual_seed(0)
        mbs = [(torch.randn(2, WIDTH, generator=g), i) for i in range(M)]

        async def main() -> None:
            async with stage:
                for _ in range(STEPS):  # the trace file holds the last step
                    await stage.run_step(mbs)

        try:
            rr.run(main())
        finally:
            ex.close()
    return rank


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_slow_forward_is_found_from_the_logs_and_the_merged_trace(tmp_path: Path) -> None:
    assert rr.spawn(_worker, P, str(tmp_path), timeout=200) == list(range(P))
    slow = f"{SLOW_RANK}:{SLOW_RANK}F{SLOW_MB}"

    # The merged trace: one timeline from the 4 per-rank files.
    merged = rr.merge_traces([str(tmp_path / "traces")])
    assert sorted({s.lane for s in merged.spans}) == list(range(P))
    found = rr.stalls(merged)
    assert [f"{s['rank']}:{s['task']}" for s in found["slow"]] == [slow]
    waited = set(found["slow"][0]["waited_by"])
    assert {"2:2F3", "3:3F3"} <= waited, found["slow"][0]
    waits = {(w["rank"], w["task"]): w for w in found["waits"]}
    for consumer, producer, src in (("2F3", "1F3", 1), ("3F3", "2F3", 2)):
        w = waits[(int(consumer[0]), consumer)]
        assert (w["reason"], w["waited_for"], w["from_rank"], w["root"]) == (
            "input",
            producer,
            src,
            slow,
        ), w
    assert {w["root"] for w in found["waits"]} <= {slow, None}
    assert waited == {f"{w['rank']}:{w['task']}" for w in found["waits"] if w["root"] == slow}

    # The logs: each rank's own file, one JSON record per line.
    stalls: dict[int, list[str]] = {}
    for r in range(P):
        recs = _records(tmp_path / f"rank{r}.log")
        assert recs and all(rec.get("rank") == r for rec in recs if "rank" in rec)
        stalls[r] = [
            rec["reason"]
            for rec in recs
            if rec.get("event") == "stall" and rec.get("step") == STEPS - 1
        ]
    assert any("for 2F3 <- message 1F3 from rank 1" in reason for reason in stalls[2]), stalls[2]
    assert any("for 3F3 <- message 2F3 from rank 2" in reason for reason in stalls[3]), stalls[3]
    for r, reasons in stalls.items():
        for reason in reasons:
            m = re.search(r"admission bound reached \((\d+)/(\d+)", reason)
            assert m is None or m.group(1) == m.group(2), (r, reason)
            assert reason.strip(), r
