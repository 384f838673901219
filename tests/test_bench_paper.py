"""The paper-scale benchmark at tiny sizes (its figures live in BENCHMARKS.md)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from rrfp_async._tasks import StepPlan, Topology
from rrfp_async._workloads import PAPER_IMAGE_TOKENS, make_workload
from rrfp_async.cli._main import main
from rrfp_async.policies._hints import make_hint
from rrfp_async.policies._listsched import strict_timeline
from rrfp_lab import _paper as bp

TINY = bp.Scenario(pp=2, tp=2, microbatches=4, workload="multimodal_paper")
CONFIGS = [
    bp.BASELINE,
    bp.Config(hint="1f1b", policy="readiness_first", memory=2.0),
    bp.Config(hint="zb_h1", policy="backfill", split=True),
    bp.Config(hint="bfw", policy="lateness_aware", memory=2.0, split=True),
    bp.Config(hint="interleaved_1f1b", policy="strict", chunks=2),
    bp.Config(hint="1f1b", policy="strict", order="sorted"),
    bp.Config(hint="bfw", policy=bp.CLAIRVOYANT, memory=math.inf, split=True),
]


def test_rows_baseline_is_one_and_efficiencies_are_bounded() -> None:
    rows = bp.run_scenario(TINY, CONFIGS, seeds=2)
    assert len(rows) == len(CONFIGS)
    base = rows[0]
    assert (base["schedule"], base["policy"]) == ("1f1b", "strict")
    assert base["ratio"] == base["ratio_min"] == base["ratio_max"] == 1.0
    assert base["efficiency"] == pytest.approx(base["strict_1f1b_efficiency"])
    for r in rows:
        # The lower bound holds for every schedule, the clairvoyant one included.
        assert 0 < r["efficiency"] <= 1.0 + 1e-9, r
        assert r["ratio"] <= r["ceiling"] * 1.5, r  # a split / V=2 moves the bound a little
    assert rows[-1]["memory"] is None  # unbounded, JSON-safe


def test_clairvoyant_sees_the_simulated_durations() -> None:
    """The reference rows must replay exactly the durations the simulation met: strict 1F1B
    on the realized durations, timed by the list-schedule model, equals the simulator's."""
    sc = bp.Scenario(pp=3, tp=1, microbatches=6, workload="text", noise=bp.NOISE["heavy"])
    for seed in (0, 1):
        plan = StepPlan(topology=Topology(stages=3), microbatches=6)
        real = bp.paper_cost(sc).realize(plan, bp.paper_microbatches(sc, seed), seed=seed)
        times = strict_timeline(plan, make_hint("1f1b", plan), real)
        makespan, _ = bp.simulate_config(sc, bp.BASELINE, seed)
        assert max(e for _, e in times.values()) == pytest.approx(makespan, rel=1e-9)


@pytest.mark.parametrize("workload", ["text", "multimodal_paper"])
def test_chunks_keep_each_ranks_work(workload: str) -> None:
    sc = bp.Scenario(pp=4, tp=8, microbatches=8, workload=workload)
    mbs = bp.paper_microbatches(sc, 3)
    one, two = bp.paper_cost(sc, 1), bp.paper_cost(sc, 2)
    for r in range(4):
        for mb in mbs:
            v1 = one.forward(r, mb)
            v2 = two.forward(r, mb) + two.forward(r + 4, mb)
            assert v2 == pytest.approx(v1), (r, mb)
    # TP divides compute: TP=8 is 1/8 of TP=1.
    tp1 = bp.paper_cost(bp.Scenario(pp=4, tp=1, microbatches=8, workload=workload))
    assert one.forward(1, mbs[0]) == pytest.approx(tp1.forward(1, mbs[0]) / 8)


def test_paper_workload_and_orders() -> None:
    wl = make_workload("multimodal_paper", 200, virtual_stages=4, seed=0)
    lo, hi = PAPER_IMAGE_TOKENS
    assert wl.cost.profiles and wl.cost.profiles[0].per_patch > 0  # a vision encoder
    assert {mb.images for mb in wl.microbatches} == {0, 1, 2, 3, 4}
    for mb in wl.microbatches:
        assert lo * mb.images <= mb.patches <= hi * mb.images
        assert mb.tokens > mb.patches
    sc = bp.Scenario(pp=4, microbatches=16, workload="multimodal_paper")
    cost = bp.paper_cost(sc)
    srt = bp.paper_microbatches(sc, 0, "sorted")
    costs = [sum(cost.forward(v, mb) for v in range(4)) for mb in srt]
    assert costs == sorted(costs) and [mb.index for mb in srt] == list(range(16))
    wide = bp.Scenario(pp=4, microbatches=64, workload="multimodal_paper", image_tokens=(4, 4096))
    assert any(mb.patches > hi * mb.images for mb in bp.paper_microbatches(wide, 0))
    # More in-flight microbatches, a larger lockstep penalty.
    assert bp.lockstep_ceiling(sc) < bp.lockstep_ceiling(
        bp.Scenario(pp=16, microbatches=16, workload="multimodal_paper")
    )


def test_tables_and_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bp, "default_scenarios", lambda full=False: [TINY])
    monkeypatch.setattr(
        bp,
        "condition_scenarios",
        lambda: [bp.Scenario(pp=2, microbatches=4, workload="text", label="t")],
    )
    monkeypatch.setattr(bp, "default_configs", lambda: CONFIGS[:3])
    res = CliRunner().invoke(main, ["bench", "paper", "--seeds", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["paper"] == {"text": 1.77, "multimodal": 2.77}
    assert len(doc["grid"]) == 3 and doc["conditions"][0]["scenario"] == "t"
    tables = bp.report_tables(doc["grid"], doc["conditions"])
    assert tables[0].rows[0][:4] == (
        "1f1b",
        "strict",
        "1x",
        "1.00x (" + f"{doc['grid'][0]['efficiency']:.2f})",
    )
    assert "| schedule | policy | memory |" in bp.to_markdown(tables[0])
    res = CliRunner().invoke(main, ["bench", "paper", "--seeds", "1", "--no-conditions"])
    assert res.exit_code == 0, res.output
    assert "strict 1F1B efficiency" in res.stdout
    assert "TP coordination at paper scale" in res.stdout


def test_coordination_rows_price_tp_against_free() -> None:
    from rrfp_async.sim._sim_tp import TP_DECISION_LATENCY

    rows = bp.coordination_rows([TINY], seeds=1)
    assert [r["schedule"] for r in rows] == [c.schedule for c in bp.TP_CONFIGS]
    for r in rows:
        assert r["tp"] == 2 and r["tp_latency"] == TP_DECISION_LATENCY(2) > 0
        assert r["makespan_tp"] > r["makespan_free"] > 0  # not assumed free any more
        assert r["cost"] == pytest.approx(r["makespan_tp"] / r["makespan_free"] - 1)
    assert rows[0]["ratio_free"] == rows[0]["ratio_tp"] == 1.0  # strict 1F1B vs itself
    free = bp.coordination_rows([TINY], seeds=1, tp_latency=0.0, tp_check=0.0)
    assert all(r["makespan_tp"] == r["makespan_free"] for r in free)
    table = bp.coordination_table(rows)
    assert len(table.rows) == 2 and table.rows[0][7] == f"{rows[0]['cost']:+.1%}"
