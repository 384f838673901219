"""``rrfp-async bench megatron``: the drop-in and megatron-core's own schedules in one run, on
the same chunks and microbatches (small sizes: the rows exist, the losses agree, the ratios
are paired per step)."""

from __future__ import annotations

import math
import warnings

import pytest

from rrfp_lab._megatron import MegatronBenchConfig, bench_steps, megatron_benchmark


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex missing
        pytest.importorskip("megatron.core")


def test_uniform_steps_hold_the_variable_steps_mean_work() -> None:
    cfg = MegatronBenchConfig(microbatches=8, steps=2, warmup_steps=0)
    var, uni = bench_steps(cfg, "variable"), bench_steps(cfg, "uniform")
    for v, u in zip(var, uni, strict=True):
        assert len(set(u.tokens)) == 1 and abs(sum(u.tokens) - sum(v.tokens)) <= len(v.tokens)
        assert len({x for row in u.forward[2] for x in row}) == 1  # no jitter


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="vp must be 2"):
        MegatronBenchConfig(vp=3)
    with pytest.raises(ValueError, match="microbatches >= stages"):
        MegatronBenchConfig(stages=4, microbatches=2)
    with pytest.raises(ValueError, match="workloads"):
        MegatronBenchConfig(workloads=("nope",))


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_megatron_rows_and_drop_in_rows_side_by_side() -> None:
    cfg = MegatronBenchConfig(
        stages=2,
        microbatches=4,
        steps=1,
        warmup_steps=0,
        us_per_token=0.2,
        policies=("strict", "readiness_first"),
        memory_factors=(1.0,),
        cost_aware=False,
        timeout=500,
    )
    res = megatron_benchmark(cfg)
    rows = res["runs"]
    names = {(r["workload"], r["chunks"], r["system"], r["policy"]) for r in rows}
    for workload in ("uniform", "variable"):
        for chunks in (1, 2):
            for system, policy in (
                ("megatron", None),
                ("drop-in", "strict"),
                ("drop-in", "readiness_first"),
            ):
                assert (workload, chunks, system, policy) in names
    assert res["loss_max_diff"] <= 1e-6
    for r in rows:
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
        assert r["efficiency"] > 0 and r["peak_inflight"] >= 1
        if r["system"] == "megatron":  # paired with itself
            key = "vs_megatron_1f1b" if r["chunks"] == 1 else "vs_megatron_interleaved"
            assert r[key] == 1.0
