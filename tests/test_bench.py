"""The benchmark functions run (tiny sizes; their figures live in BENCHMARKS.md)."""

from __future__ import annotations

from rrfp_async.cli import _bench


def test_simulator_benchmarks_small() -> None:
    rows = _bench.simulator_wall_time(stages=2, microbatches=4, repeats=1)
    assert {r["policy"] for r in rows} == {
        "strict",
        "readiness_first",
        "lateness_aware",
        "backfill",
    }
    assert all(r["tasks"] == 16 and r["wall_median_s"] > 0 for r in rows)
    table = _bench.simulator_policy_table(
        stages=2, microbatches=4, seeds=1, workloads=("text",), hints=("1f1b",), memory=(1.0,)
    )
    strict = next(r for r in table if r["policy"] == "strict")
    assert strict["vs_1f1b_strict"] == 1.0 == strict["vs_same_hint_strict"]


def test_logging_overhead_small() -> None:
    rows = _bench.logging_overhead(stages=2, microbatches=2, repeats=1)
    assert rows[0]["variant"] == "no observer"
    assert rows[0]["overhead"] == 0.0
    assert len(rows) == 3
