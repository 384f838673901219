"""``bench overhead``: the section functions at tiny sizes (figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rrfp_async.cli._main import main
from rrfp_lab import _overhead as ov


@pytest.mark.parametrize("k", [1, 3, 8])
def test_decision_schedule_holds_k_ready_tasks(k: int) -> None:
    s = ov.decision_schedule(k, microbatches=4 * k)
    assert s.bounds == (k,)
    assert len(s.hint[0]) == 2 * 4 * k


def test_decision_latency_rows() -> None:
    rows = ov.decision_latency(
        (1, 4), policies=("strict", "readiness_first"), loops=("asyncio", "uvloop"), repeats=2
    )
    assert len(rows) == 2 * 2 * 2
    assert {r["loop"] for r in rows} == {"asyncio", "uvloop"}
    for r in rows:
        for key in ("us_median", "us_min", "us_yield_median", "ready_mean"):
            assert r[key] > 0, (key, r)
        # Every task of the step is one decision and one executor call: a stage that
        # skipped, repeated or batched tasks would be timed per the wrong count.
        assert r["decisions"] == r["tasks"] == r["executed"]
        m = max(32, 8 * r["ready"])
        assert r["tasks"] == 2 * m
        # The ready set really has k tasks at every decision but the final k - 1 backwards.
        assert r["ready_at_k"] == pytest.approx((2 * m - (r["ready"] - 1)) / (2 * m))
        assert r["ready_mean"] <= r["ready"]


def test_split_backward_cost_rows() -> None:
    (row,) = ov.split_backward_cost(microbatches=2, repeats=1, stages=2, stage=1)
    for key in ("f_ms", "b_ms", "i_ms", "w_ms", "iw_ms", "ratio", "ratio_tasks", "b_clock_ms"):
        assert row[key] > 0, key
    assert row["iw_ms"] == pytest.approx(row["i_ms"] + row["w_ms"])  # one repeat: sums agree
    # The compute thread's CPU time cannot exceed the wall time of the awaits around it.
    assert row["b_ms"] <= row["b_wall_ms"] * 1.01 and row["iw_ms"] <= row["iw_wall_ms"] * 1.01
    assert row["stage"] == 1 and row["tokens"] > 0
    assert row["source"] in ("executor tasks", "measure_split_backward")
    assert "helper_error" not in row, row.get("helper_error")


def test_cli_decision_section_json() -> None:
    res = CliRunner().invoke(
        main,
        [
            "bench",
            "overhead",
            "--section",
            "decision",
            "--ready",
            "2",
            "--policy",
            "greedy",
            "--loop",
            "asyncio",
            "--repeats",
            "1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert list(out) == ["decision"]
    assert out["decision"][0]["policy"] == "greedy" and out["decision"][0]["ready"] == 2


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_message_cost_rows() -> None:
    rows = ov.message_cost((64, 4096), messages=10, batches=5, loops=("uvloop",), timeout=200)
    # Both receive modes of the channel, each size: one row per (bytes, io).
    assert [(r["bytes"], r["io"]) for r in rows] == [
        (64, "per_edge"),
        (64, "shared"),
        (4096, "per_edge"),
        (4096, "shared"),
    ]
    for r in rows:
        for key in ("raw_us", "channel_us", "ratio", "raw_median_us", "ratio_paired"):
            assert r[key] > 0, key
        # Warm-up round trip + batches: every echoed message came back through the sink.
        assert r["messages"] == 10
    for r in rows[-2:]:
        assert r["delivered"] == 2 * (2 + 10)
    # Shared I/O hands completions to the loop in batches of at least one; per-edge I/O
    # hands each off alone (no figure).
    assert [r["per_handoff"] is None for r in rows] == [True, False, True, False]
    assert all(r["per_handoff"] >= 1 for r in rows if r["io"] == "shared")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tp_coordination_rows() -> None:
    rows = ov.tp_coordination(
        (1, 2),
        decisions=10,
        batches=5,
        compute_ms=1.0,
        computes_ms=(1.0, 2.0),
        microbatches=2,
        steps=2,
    )
    one, r = rows
    assert (one["tp"], r["tp"]) == (1, 2)
    assert one["raw_us"] is None and one["decisions"] == 0 and one["met_ratio"] is None
    for key in ("raw_us", "channel_us", "ratio", "stage_coord_us", "share", "step_coord_ms"):
        assert r[key] > 0, key
    assert r["raw_us"] <= r["raw_median_us"]  # a lower decile never exceeds the median
    assert r["step_decisions"] == 4  # 2 microbatches x (F, B) on the one stage
    assert r["published"] == 10 + 2  # warm-up batch of 2 decisions + 5 batches of 2
    assert 0 < r["share"] < 1
    # The verdict is on the measured share of step time (the formula is a worst case).
    assert -1 < r["share_measured"] < 1
    assert r["met_share"] == (r["share_measured"] < ov.TP_SHARE_TARGET)
    for row in rows:  # one entry per task length, every variant's step timed
        assert [p["compute_ms"] for p in row["steps"]] == [1.0, 2.0]
        for p in row["steps"]:
            for v in ("off", "dec", "gather", "wait", "on"):
                assert p[f"step_{v}_ms"] >= 4 * p["compute_ms"], (v, p)
    model = ov.tp_model(rows, predict=(8,))
    terms = {t["key"]: t for t in model["terms"]}
    # Per-step terms are fitted on TP 1 and 2; per-decision ones need two TP sizes >= 2.
    assert "wait_first_us" in terms and "channel_us" not in terms
    assert set(terms["wait_first_us"]["measured"]) == {1, 2}
    assert terms["wait_first_us"]["loo"] == []  # leave-one-out needs three sizes
    assert {x["tp"] for x in model["share"]} == {1, 2, 8}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_task_section_counts_two_handoffs_per_task_and_agrees_with_torch() -> None:
    (row,) = ov.task_overhead_isolated(microbatches=4, repeats=3)
    assert row["microbatches"] == 4 and row["device"] == "cpu"
    for key in ("compute_ms", "ours_ms", "torch_ms"):
        assert row[key] > 0, key
    assert row["idle_ours_us"] >= 0 and row["idle_torch_us"] >= 0
    # On the CPU each task is one trip to the compute thread and back: no more hops (an
    # event wait, a second submit) hide in a task.
    assert row["handoffs_per_task"] == 2.0
    assert row["losses_agree"]  # the same module, the same microbatches: the same losses
