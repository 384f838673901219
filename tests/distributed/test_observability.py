"""Traces and failure reports of real multi-process runs (gloo, 127.0.0.1)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from click.testing import CliRunner

import rrfp_async as rr
from rrfp_async.cli._main import main
from rrfp_async.observability import (
    TraceData,
    chrome_trace,
    summarize,
    validate_chrome_trace,
)
from rrfp_lab._demo_train import TrainConfig, image_text_cost, train_worker
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_real_run_trace_has_one_span_per_executed_task() -> None:
    cfg = TrainConfig(
        pp=3,
        microbatches=6,
        steps=2,
        policies=("readiness_first",),
        memory_factor=2.0,
        cost=image_text_cost(per_token=1e-5, jitter=0.3),
        trace_steps=(1,),
        return_params=False,
    )
    results = pooled_spawn(train_worker, 3, cfg, timeout=240)
    per_rank = [r[0] for r in results]
    data = TraceData.merge(r.trace for r in per_rank if r.trace is not None)
    tr = chrome_trace(data, clock="real", emulated=True, policy="readiness_first", hint="1f1b")
    assert validate_chrome_trace(tr) == []
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    for r in per_rank:
        executed = [x for x in r.stats[1].executed]  # the traced step
        lane = sorted((e for e in spans if e["pid"] == r.rank), key=lambda e: e["ts"])
        assert [e["name"] for e in lane] == [str(x.task) for x in executed]
        durs = [e["dur"] / 1e6 for e in lane]
        assert durs == pytest.approx([x.end - x.start for x in executed], abs=1e-6)
    assert len(spans) == 3 * 6 * 2
    flows = [e for e in tr["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * 2 * 6 * 2  # 2 edges x 6 mbs x (F, B), both ends
    assert summarize(tr)["makespan"] > 0


async def _explode(view: rr.ReadyView) -> rr.Task:
    # After rank 0's first two tasks (of 8): at most two forwards were sent, so rank 1 cannot
    # end its step before rank 0's ABORT reaches it (later, a byte budget may let rank 0 send
    # all four forwards first, rank 1 end well, and the agreement fail its step instead).
    if view.rank == 0 and view.remaining <= 6:
        raise RuntimeError("policy bug on purpose")
    return view.ready[0]


async def _hang(view: rr.ReadyView) -> rr.Task:
    if view.rank == 0 and view.remaining < 4:
        await asyncio.Event().wait()
    return view.ready[0]


def _worker(rank: int, world: int, cfg: TrainConfig) -> object:
    rr.register_policy("explode", _explode, replace=True)
    rr.register_policy("hang", _hang, replace=True)
    return train_worker(rank, world, cfg)


def test_a_failing_rank_takes_its_peers_down_with_reports() -> None:
    cfg = TrainConfig(
        pp=2, microbatches=4, steps=1, policies=("explode",), return_params=False, step_timeout=60
    )
    with pytest.raises(rr.errors.SpawnError) as ei:
        pooled_spawn(_worker, 2, cfg, timeout=120)
    f = ei.value.failures
    assert "PolicyError" in f[0] and "policy bug on purpose" in f[0]
    assert "state of rank 0 when the step failed" in f[0]
    # The peer does not hang: rank 0's ABORT fails its step with rank 0's cause, and its
    # state dump says what it waited for.
    assert "PeerStepError" in f[1], f[1]
    assert "step 0 failed on rank 0 (global 0): PolicyError: policy 'explode' raised" in f[1]
    assert "state of rank 1" in f[1]


def test_a_hung_rank_is_stopped_by_the_watchdog() -> None:
    cfg = TrainConfig(
        pp=2, microbatches=4, steps=1, policies=("hang",), return_params=False, step_timeout=5
    )
    with pytest.raises(rr.errors.SpawnError) as ei:
        pooled_spawn(_worker, 2, cfg, timeout=120)
    f = ei.value.failures
    assert "StepTimeoutError" in f[0]
    # The hung policy is the cause on its rank (the watchdog fired in its turn).
    assert "the policy 'hang' did not return a decision for 5.0 s" in f[0], f[0]
    assert "ready:" in f[0]
    # The peer fails with a peer's error (PeerError, or its PeerStepError when rank 0's
    # report of its failed step arrives first) or with its own watchdog.
    assert any(k in f[1] for k in ("PeerError", "PeerStepError", "StepTimeoutError")), f[1]


def test_demo_command_small(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main,
        ["demo", "--stages", "2", "--microbatches", "4", "--steps", "1", "--out", str(tmp_path)],
        env={"COLUMNS": "80"},
    )
    assert res.exit_code == 0, res.output
    for word in ("strict@1f1b", "readiness_first", "speedup", "bubble", "EMULATED", "bytes"):
        assert word in res.output
    # 80 columns, piped: nothing wider, no name cut short, each column says what it is over.
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80, res.output
    assert "…" not in res.output
    for p in ("strict@1f1b", "strict", "readiness_first"):
        assert any(line.startswith(f"│ {p} ") for line in lines), (p, res.output)
    for label in ("(median", "of 1)", "(total", "(max of 1)", "(step 1)", "traced step"):
        assert label in res.output, label
    # One timed step has no spread and cannot be judged: no verdict is claimed.
    rows = [line for line in lines if line.startswith(("│ strict ", "│ readiness_first "))]
    assert len(rows) == 4 and all("no spread" in r or "too few" in r for r in rows[:2])
    assert sum("too few" in r for r in rows) == 2, res.output
    assert not any("within noise" in r for r in rows), res.output
    assert (tmp_path / "timeline.png").exists()
    for p in ("strict@1f1b", "strict", "readiness_first"):
        tr = rr.observability.load_trace(tmp_path / f"trace_{p}.json")
        assert validate_chrome_trace(tr) == []


def test_pipeline_step_times_pairs_each_policy_with_the_first_step_by_step() -> None:
    from rrfp_lab._local_bench import pipeline_step_times

    res = pipeline_step_times(
        stages=2,
        microbatches=4,
        steps=3,
        policies=("strict", "readiness_first", "backfill"),
        memory_factor=2.0,
        timeout=240,
    )
    pols = res["policies"]
    base = pols["strict"]["step_s"]
    assert pols["strict"]["deviations"] == 0
    for name, r in pols.items():
        vs = r["vs_first"]
        assert vs.ratios == tuple(b / t for b, t in zip(base, r["step_s"], strict=True)), name
        # "same order" only for a policy that, like strict, never left the hint's order.
        assert vs.same_order == (r["deviations"] == 0), name
    assert pols["strict"]["vs_first"].ratios == (1.0, 1.0, 1.0)
