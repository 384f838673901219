"""``rrfp-async bench megatron``: the drop-in and megatron-core's own schedules in one run, on
the same chunks and microbatches (small sizes: the rows exist, the losses agree, the ratios
are paired per step, the bytes are those the model and the order hold)."""

from __future__ import annotations

import math
import warnings
from typing import Any

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
    _check_bytes(cfg, res["runs"])
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


def _order_bytes(cfg: MegatronBenchConfig, workload: str, chunks: int, rank: int) -> int:
    """What megatron's order holds at most on ``rank`` over the timed steps, each forward of
    a microbatch of ``t`` tokens holding what ``PeerStage`` keeps: its ``[t, 1, hidden + 3]``
    input and output and its ``[t, 1, hidden]`` tanh output, float32 (its weights not)."""
    from rrfp_async.integrations import megatron_order

    order = megatron_order(
        cfg.stages, chunks, cfg.microbatches, cfg.stages, interleaved=chunks > 1
    )[rank]
    peak = 0
    for st in bench_steps(cfg, workload)[cfg.warmup_steps :]:
        held = 0
        for task in order:
            b = 4 * st.tokens[task.mb] * (3 * cfg.hidden + 6)
            held += b if task.kind == "F" else -b
            peak = max(peak, held)
    return peak


def _check_bytes(cfg: MegatronBenchConfig, rows: list[dict[str, Any]]) -> None:
    """Megatron's rows (metered inside their chunks) measure exactly what megatron's order
    holds of the known per-forward bytes, on every rank; the drop-in in megatron's order
    (metered by its executor) the same, plus the 4-byte loss megatron keeps per forward of
    the last stage; readiness-first within the same count holds no more on equal
    microbatches; ratios are to megatron 1F1B's row of the workload."""
    m = cfg.microbatches
    for r in rows:
        w, c = r["workload"], r["chunks"]
        want = [_order_bytes(cfg, w, c, rank) for rank in range(cfg.stages)]
        got = r["measured_peak_bytes_per_rank"]
        assert isinstance(got, list) and r["peak_bytes"] == max(got) // c, r
        if r["system"] == "megatron" or r["policy"] == "strict":
            assert got[0] == want[0], r  # rank 0 holds no last stage
            extra = 0 if r["system"] == "megatron" else 4 * m
            assert all(0 <= g - x <= extra for g, x in zip(got, want, strict=True)), (r, want)
        elif w == "uniform":
            assert all(g <= x + 4 * m for g, x in zip(got, want, strict=True)), (r, want)
        ref = next(
            x["peak_bytes"]
            for x in rows
            if x["workload"] == w and x["system"] == "megatron" and x["schedule"] == "1F1B"
        )
        assert r["bytes_vs_megatron_1f1b"] == pytest.approx(r["peak_bytes"] / ref, rel=1e-6)
