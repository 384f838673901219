"""The side-by-side benchmark against torch.distributed.pipelining (smoke sizes)."""

from __future__ import annotations

import math

import pytest

from rrfp_lab._peer import PeerConfig, peer_benchmark, peer_simulated
from rrfp_lab._peer_config import TORCH_SCHEDULES, resolve_torch_schedule


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown torch schedule"):
        PeerConfig(torch_schedules=("ScheduleNope",))
    with pytest.raises(ValueError, match="us_per_token"):
        PeerConfig(us_per_token=0.0)


def test_torch_short_names_resolve_as_torch_resolves_them() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    for cls in TORCH_SCHEDULES:
        short = cls.removeprefix("Schedule")
        assert get_schedule_class(short).__name__ == cls  # torch's own short name
        for name in (short, short.lower(), short.upper(), cls, cls.lower()):
            assert resolve_torch_schedule(name) == cls, name
    # torch also resolves its base classes; they are not schedules one can run.
    assert get_schedule_class("PipelineScheduleSingle").__name__ == "PipelineScheduleSingle"
    with pytest.raises(ValueError, match="choose from 1F1B, GPipe, Interleaved1F1B"):
        resolve_torch_schedule("PipelineScheduleSingle")
    with pytest.raises(ValueError, match="unknown torch schedule 'Schedule'"):
        resolve_torch_schedule("Schedule")


def test_simulated_rows_are_paired_against_strict_1f1b() -> None:
    cfg = PeerConfig(stages=2, microbatches=4, steps=2, warmup_steps=0)
    rows = peer_simulated(cfg, guided=False)
    by = {r["configuration"]: r for r in rows}
    assert by["1f1b strict 1x"]["vs_strict_1f1b"] == 1.0
    assert all(0 < r["efficiency"] <= 1.0 + 1e-9 for r in rows)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_peer_benchmark_runs_both_systems_on_the_same_work() -> None:
    cfg = PeerConfig(
        stages=2,
        microbatches=4,
        steps=2,
        warmup_steps=1,
        us_per_token=0.2,
        torch_schedules=("Schedule1F1B",),
        padded_cost=("Schedule1F1B",),
        hints=("breadth_first_weighted",),
        policies=("strict", "readiness_first"),
        memory_factors=(1.0,),
        timeout=240,
    )
    steps: list[object] = []
    out = peer_benchmark(cfg, on_progress=steps.append)
    assert steps == [0, 1, 2]  # rank 0 reports each step (warm-up included) as it ends
    runs = out["runs"]
    assert [(r["system"], r["schedule"] or r["hint"], r["policy"]) for r in runs] == [
        ("torch", "Schedule1F1B", None),
        ("torch", "Schedule1F1B", None),
        ("rrfp_async", "breadth_first_weighted", "strict"),
        ("rrfp_async", "breadth_first_weighted", "readiness_first"),
        ("drop-in", "breadth_first_weighted", "strict"),
        ("drop-in", "breadth_first_weighted", "readiness_first"),
    ]
    assert runs[0]["speedup_vs_torch_1f1b"] == 1.0 and runs[1]["note"] == "padded cost"
    # the drop-in rows (torch's own PipelineStage objects) are paired with the native ones
    assert all(r["note"].endswith("x native") for r in runs[4:]), [r["note"] for r in runs]
    for r in runs:
        assert len(r["steps_s"]) == 2 and r["step_s"] > 0
        assert 0 < r["efficiency"] <= 1.0 and not math.isnan(r["speedup_vs_torch_1f1b"])
    # Same modules, same data, no optimizer step: the losses agree across both systems.
    assert out["loss_max_diff"] < 1e-5 and out["losses_checked"] == len(runs)
    # The 1F1B bound on rank 0 of 2 is 2; torch's 1F1B holds as much.
    assert runs[0]["peak_inflight"] == 2 and runs[2]["peak_inflight"] <= 2
    assert runs[4]["peak_inflight"] <= 2
    assert 0 < out["comm_share"] < 10


def test_uniform_workload_and_torch_order_hints_are_validated() -> None:
    from rrfp_lab._peer_config import make_steps

    for st in make_steps(PeerConfig(workload="uniform", steps=3)):
        assert len(set(st.tokens)) == 1  # every microbatch the step's mean length
    multi = make_steps(PeerConfig(steps=3))
    uni = make_steps(PeerConfig(workload="uniform", steps=3))
    for a, b in zip(multi, uni, strict=True):
        assert len(set(a.tokens)) > 1 and abs(sum(a.tokens) - sum(b.tokens)) < len(a.tokens)
    with pytest.raises(ValueError, match="workload"):
        PeerConfig(workload="images")
    with pytest.raises(ValueError, match="unknown torch schedule"):
        PeerConfig(dropin_hints=("torch:Nope",))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dropin_rows_run_torchs_v_shape_order_and_pair_with_it() -> None:
    """A drop-in row with torch's ZB-V order as its hint runs on V-shape placement with the
    split backward, trains like torch's own ZB-V (same losses), and is paired with it."""
    cfg = PeerConfig(
        stages=2,
        microbatches=4,
        steps=2,
        warmup_steps=1,
        us_per_token=0.2,
        torch_schedules=("Schedule1F1B", "ScheduleZBVZeroBubble"),
        padded_cost=(),
        hints=("1f1b",),
        dropin_hints=("torch:ZBVZeroBubble",),
        policies=("strict",),
        memory_factors=(1.0,),
        timeout=240,
    )
    out = peer_benchmark(cfg)
    by = {(r["system"], r["schedule"] or r["hint"]): r for r in out["runs"]}
    row = by[("drop-in", "torch:ZBVZeroBubble")]
    assert not math.isnan(row["speedup_vs_same_torch"]) and row["speedup_vs_same_torch"] > 0
    assert math.isnan(by[("rrfp_async", "1f1b")]["speedup_vs_same_torch"])
    assert out["loss_max_diff"] < 1e-5 and out["losses_checked"] == len(out["runs"])


def test_torch_rows_meter_counts_what_the_executors_meter_counts() -> None:
    """torch's rows are metered inside their modules (``LiveBytes``), rrfp_async's by the
    executor: on the same microbatches the two count the same bytes per forward (the last
    stage's executor also holds the 4-byte loss), a first-stage input that is a view of
    torch's padded batch counts as its own tensor, and a forward no backward follows (torch's
    shape inference) is dropped."""
    import torch

    import rrfp_async as rr
    from rrfp_lab._peer import PeerStage
    from rrfp_lab._peer_stage import LiveBytes, make_inputs, peer_loss, replay_peak

    cfg = PeerConfig(stages=3, microbatches=3)
    tokens = [40, 100, 7]
    mods = {v: PeerStage(cfg.hidden, v, weight_sleep=False) for v in range(3)}
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, peer_loss, rank=v, measure_activations=True)
        for v in range(3)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=3)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "gpipe"), execs, policy="strict")
    try:
        stats = rr.run(pipe.run_step(make_inputs(cfg, 0, tokens, None)))
        theirs = [e.activation_bytes() for e in execs]
    finally:
        for e in execs:
            e.close()
    for chunks in (make_inputs(cfg, 0, tokens, None), None):
        if chunks is None:  # torch's way: views of one padded batch, the real rows first
            batch = torch.cat(make_inputs(cfg, 0, tokens, max(tokens)), dim=0)
            chunks = list(torch.tensor_split(batch, 3, dim=0))
        lives = [LiveBytes() for _ in range(3)]
        for v, live in enumerate(lives):
            mods[v].live = live
            live.begin()
        mods[0](chunks[0][:, :1].clone())  # shape inference: no backward follows
        outs = []
        for x in chunks:
            h = x
            for v in range(3):
                h = mods[v](h if v == 0 else h.detach().requires_grad_())
                outs.append(h)
        for o in reversed(outs):  # every forward's backward, the last stage's first
            o.backward(torch.ones_like(o))
        for live in lives:
            live.end()
        if chunks[0].shape[1] == tokens[0]:  # the real lengths: the executor's figures
            for v in range(3):
                loss = 4 if v == 2 else 0
                assert {k: b + loss for k, b in lives[v].bytes.items()} == theirs[v], v
                # GPipe's order: every forward held at once, as the executor's held_peak
                assert lives[v].peak + 3 * loss == stats[v].held_peak(theirs[v])
                assert replay_peak(lives[v].order, theirs[v]) == stats[v].held_peak(theirs[v])
        else:  # padded: every microbatch the longest's bytes
            assert len(set(lives[1].bytes.values())) == 1
            assert lives[0].bytes[(0, 1)] == theirs[0][(0, 1)]  # the longest: as its own
        assert [len(live.order) for live in lives] == [6, 6, 6]
    for m in mods.values():
        m.live = None
