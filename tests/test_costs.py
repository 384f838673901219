"""Cost models, workloads and their validation."""

from __future__ import annotations

import pytest

import rrfp_async as rr


def test_invalid_values_are_refused() -> None:
    with pytest.raises(rr.PlanError, match="must be >= 0"):
        rr.Microbatch(index=0, tokens=-1)
    with pytest.raises(rr.PlanError, match="jitter must be a finite number"):
        rr.CostModel(jitter=-0.1)
    with pytest.raises(rr.PlanError, match="input_grad_share"):
        rr.CostModel(input_grad_share=2.0)
    with pytest.raises(rr.PlanError, match="straggler_factor"):
        rr.CostModel(straggler_factor=0.5)
    with pytest.raises(rr.PlanError, match="per_token"):
        rr.StageProfile(per_token=float("nan"))
    with pytest.raises(rr.PlanError, match="microbatches"):
        rr.StepPlan(topology=rr.Topology(stages=2), microbatches=0)
    with pytest.raises(rr.PlanError, match="ordered_weights needs split_backward"):
        rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2, ordered_weights=True)


def test_realized_noise_is_seeded_per_task() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4, split_backward=True)
    wl = rr.make_workload("multimodal", 4, virtual_stages=2, seed=1)
    cost = rr.CostModel(profiles=wl.cost.profiles, jitter=0.5, latency=1e-3, latency_jitter=0.3)
    a = cost.realize(plan, wl.microbatches, seed=3)
    b = cost.realize(plan, wl.microbatches, seed=3)
    t = rr.Task(1, "I", 2)
    assert a.of(t) == b.of(t) and a.latency(t) == b.latency(t) > 0
    assert cost.realize(plan, wl.microbatches, seed=4).of(t) != a.of(t)
    d = cost.declared(plan, wl.microbatches)
    # I and W split the backward; the backward is 2x the forward.
    f = d.of(rr.Task(1, "F", 2))
    assert d.of(rr.Task(1, "I", 2)) + d.of(rr.Task(1, "W", 2)) == pytest.approx(2 * f)


def test_multimodal_vision_stage_costs_by_patches() -> None:
    wl = rr.make_workload("multimodal", 16, virtual_stages=4, seed=0)
    text_only = next(m for m in wl.microbatches if m.patches == 0)
    with_images = max(wl.microbatches, key=lambda m: m.patches)
    assert wl.cost.forward(0, with_images) > 5 * wl.cost.forward(0, text_only)
    assert wl.cost.forward(1, with_images) == pytest.approx(wl.cost.default.forward(with_images))


def test_executor_errors() -> None:
    import torch

    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=1)
    ex = rr.TorchStageExecutor({0: torch.nn.Identity()}, lambda out, mb: out.sum())
    ctx = rr.TaskContext(0, 0, plan, [rr.Microbatch(index=0)])
    try:
        with pytest.raises(rr.PlanError, match="no module for virtual stage 1"):
            rr.run(ex.execute(rr.Task(1, "F", 0), None, ctx))
    finally:
        ex.close()
    emu = rr.EmulatedCost(cost=rr.CostModel())
    with pytest.raises(rr.PlanError, match=r"needs rrfp_async\.Microbatch"):
        emu.durations(plan, ["not a microbatch"], 0, 0)


def test_p2p_channel_refuses_to_send_before_start() -> None:
    from rrfp_async.channels import P2PChannel

    ch = P2PChannel(0, global_ranks={0: 0, 1: 1}, inbound=[], outbound=[1])
    with pytest.raises(rr.errors.ProtocolError, match="is the channel started"):
        ch.send(1, 0, rr.Task(1, "F", 0), None)
    with pytest.raises(ValueError, match="has no global rank"):
        P2PChannel(0, global_ranks={0: 0}, inbound=[1], outbound=[])
