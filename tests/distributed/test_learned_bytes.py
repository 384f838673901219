"""``LearnedBytes``: each rank measures its own stages' bytes; after the exchange every rank
predicts every stage's bytes, and all ranks predict the same (2 gloo processes)."""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

STEPS = [[12, 40, 7, 33], [25, 3, 18, 60], [9, 44, 27, 5]]  # tokens of each microbatch
HELD_OUT = [100, 1, 57, 16]


def true_bytes(stage: int, tokens: int) -> int:
    # Stage 0 linear in tokens, stage 1 with attention's square term.
    return 4096 * tokens + 512 if stage == 0 else 96 * tokens * tokens + 2048 * tokens


def worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from rrfp_async.distributed import LearnedBytes

    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    learner = LearnedBytes(dist.new_group(backend="gloo"))
    ready = []
    for tokens in STEPS:
        mbs = [rr.Microbatch(index=i, tokens=t) for i, t in enumerate(tokens)]
        ready.append(learner.ready(plan))
        # This rank measured only its own stage (stage == rank: one chunk per rank).
        measured = {(rank, i): true_bytes(rank, t) for i, t in enumerate(tokens)}
        learner.observe(plan, mbs, measured)
    ready.append(learner.ready(plan))
    held = [rr.Microbatch(index=i, tokens=t) for i, t in enumerate(HELD_OUT)]
    predicted = learner.predict(plan, held)
    assert predicted is not None
    return {"ready": ready, "rows": predicted.rows(), "steps": learner.steps}


def test_every_rank_predicts_every_stage_alike_from_what_each_measured() -> None:
    res = pooled_spawn(worker, 2, timeout=100)
    assert res[0]["rows"] == res[1]["rows"]  # the same plan on every rank
    want = [[true_bytes(v, t) for t in HELD_OUT] for v in range(2)]
    assert res[0]["rows"] == want  # the fit is exact on sizes it never saw
    # Not ready before any step (nothing measured); ready once each stage saw enough sizes.
    assert res[0]["ready"][0] is False and res[0]["ready"][-1] is True
    assert res[0]["steps"] == len(STEPS)


def duration_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from rrfp_async.distributed import LearnedDurations
    from rrfp_async.loop import ExecutedTask

    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=4)
    costs = LearnedDurations(dist.new_group(backend="gloo"))
    for tokens in STEPS:
        mbs = [rr.Microbatch(index=i, tokens=t) for i, t in enumerate(tokens)]
        # This rank's own tasks, one after the other: F takes 10 us/token (+ 5 us on stage
        # 1), B twice that.
        ran, t0 = [], 0.0
        for i, t in enumerate(tokens):
            f = (10 * t + 5 * rank) * 1e-6
            ran.append(ExecutedTask(rr.Task(rank, "F", i), t0, t0 + f))
            ran.append(ExecutedTask(rr.Task(rank, "B", i), t0 + f, t0 + 3 * f))
            t0 += 3 * f
        costs.observe(plan, mbs, ran)
    held = [rr.Microbatch(index=i, tokens=t) for i, t in enumerate(HELD_OUT)]
    got = costs.predict(plan, held)
    assert got is not None
    return {
        "f": [[got.of(rr.Task(v, "F", i)) for i in range(4)] for v in range(2)],
        "b": [[got.of(rr.Task(v, "B", i)) for i in range(4)] for v in range(2)],
    }


def test_task_times_are_learned_alike_on_every_rank() -> None:
    res = pooled_spawn(duration_worker, 2, timeout=100)
    assert res[0] == res[1]
    for v in range(2):
        for i, t in enumerate(HELD_OUT):
            assert res[0]["f"][v][i] == pytest.approx((10 * t + 5 * v) * 1e-6, abs=1e-6)
            assert res[0]["b"][v][i] == pytest.approx(2 * (10 * t + 5 * v) * 1e-6, abs=1e-6)
