"""The public simulation API and its errors."""

from __future__ import annotations

import pytest

import rrfp_async as rr


def test_result_fields() -> None:
    r = rr.simulate(stages=4, microbatches=8)
    # The default hint is the cost-aware breadth_first_weighted; on uniform sizes it is 1F1B:
    # (M + P - 1) * (f + b), f = 10.44 ms for 1024 tokens, b = 2f.
    f = 1024 * 1e-5 + 2e-4
    assert r.makespan == pytest.approx((8 + 4 - 1) * 3 * f)
    assert r.lower_bound == pytest.approx(r.makespan)
    assert r.efficiency == pytest.approx(1.0)
    assert r.peak_inflight == (4, 3, 2, 1) == r.max_inflight
    assert [len(e) for e in r.executed] == [16] * 4
    assert r.executed[0][0].task == rr.Task(0, "F", 0) and r.executed[0][0].start == 0.0
    assert r.to_dict()["hint"] == "breadth_first_weighted"
    assert r.schedule is not None
    assert r.schedule.hint == rr.StepSchedule.build(r.schedule.plan, "1f1b").hint


def test_explicit_durations_replay() -> None:
    r = rr.simulate(
        stages=2, microbatches=2, forward=[[1, 2], [1, 1]], hint="gpipe", policy="strict"
    )
    # Stage 0: F0 [0,1] F1 [1,3]; stage 1: F0 [1,2] F1 [3,4] B0 [4,6] B1 [6,8];
    # stage 0: B0 [6,8] B1 [8,12].
    assert r.makespan == pytest.approx(12.0)
    r2 = rr.simulate(stages=2, microbatches=2, forward=[[1, 2], [1, 1]], backward=[[1, 1], [1, 1]])
    assert r2.makespan < r.makespan


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"forward": [[1, 1]]}, rr.PlanError, "one row per virtual stage"),
        ({"forward": [[1], [1]]}, rr.PlanError, "one duration per microbatch"),
        ({"forward": [[1, -1], [1, 1]]}, rr.PlanError, "finite and >= 0"),
        ({"backward": [[1, 1], [1, 1]]}, rr.PlanError, "need forward durations"),
        ({"workload": "video"}, rr.PlanError, "unknown workload"),
        ({"hint": "zzz"}, rr.errors.HintError, "unknown hint"),
        ({"max_inflight": 1}, rr.errors.HintError, "holds 2 activations"),
        ({"chunks": 0}, rr.PlanError, "chunks must be"),
        ({"policy": "nope"}, rr.errors.PolicyError, "unknown policy"),
    ],
)
def test_bad_input_is_refused_clearly(kwargs: dict, err: type, match: str) -> None:
    args = {"stages": 2, "microbatches": 2, **kwargs}
    with pytest.raises(err, match=match):
        rr.simulate(**args)


def test_jitter_is_seeded_and_shared_by_policies() -> None:
    a = rr.compare(stages=4, microbatches=8, workload="multimodal", jitter=0.3, seed=7)
    b = rr.compare(stages=4, microbatches=8, workload="multimodal", jitter=0.3, seed=7)
    assert a["strict"].makespan == b["strict"].makespan
    assert a["readiness_first"].lower_bound == a["strict"].lower_bound
    c = rr.simulate(stages=4, microbatches=8, workload="multimodal", jitter=0.3, seed=8)
    assert c.makespan != a["strict"].makespan


def test_latency_delays_messages() -> None:
    base = rr.simulate(stages=4, microbatches=4)
    slow = rr.simulate(stages=4, microbatches=4, latency=0.01)
    assert slow.makespan > base.makespan
    assert slow.makespan >= slow.lower_bound > base.lower_bound


def test_vshape_and_split_backward() -> None:
    r = rr.simulate(
        stages=4,
        microbatches=8,
        chunks=2,
        placement="vshape",
        hint="backward_first",
        split_backward=True,
    )
    kinds = {e.task.kind for ex in r.executed for e in ex}
    assert kinds == {"F", "I", "W"}
    # V-shape: the last virtual stage (7) lives on rank 0.
    assert any(e.task.stage == 7 for e in r.executed[0])


def test_16x128_step_is_fast() -> None:
    r = rr.simulate(stages=16, microbatches=128, workload="multimodal", jitter=0.2)
    assert sum(len(e) for e in r.executed) == 16 * 128 * 2
    assert r.wall_time < 10.0  # the benchmark figure (< 1 s) is in BENCHMARKS.md
