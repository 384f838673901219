"""One CostModelExecutor shared by two pipelines: each step gets its own durations."""

from __future__ import annotations

from typing import Any

import rrfp_async as rr
from rrfp_async import CostModel, Microbatch, StageProfile, StepPlan, Topology
from rrfp_async.sim import CostModelExecutor
from tests._virtual import run_virtual


def _pipe(ex: CostModelExecutor, m: int) -> rr.LocalPipeline:
    plan = StepPlan(topology=Topology(stages=2), microbatches=m)
    return rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), ex)


def test_same_step_number_other_sizes_get_their_own_durations() -> None:
    """Before: cached by step number only, the second pipeline's step 0 ran with the first
    one's durations (a silent wrong result)."""
    cost = CostModel(default=StageProfile(per_token=0.001))
    ex = CostModelExecutor(cost)
    small = [Microbatch(index=i, tokens=10) for i in range(4)]
    big = [Microbatch(index=i, tokens=1000) for i in range(4)]
    a, b = _pipe(ex, 4), _pipe(ex, 4)

    def makespan(pipe: rr.LocalPipeline, mbs: list[Microbatch]) -> float:
        stats = run_virtual(pipe.run_step(mbs, step=0))
        return max(s.finished for s in stats) - min(s.started for s in stats)

    t_small = makespan(a, small)
    t_big = makespan(b, big)
    alone = makespan(_pipe(CostModelExecutor(cost), 4), big)
    assert t_big == alone and t_big > 50 * t_small


def test_same_step_number_other_microbatch_count() -> None:
    seen: list[int] = []

    def durations(step: int, mbs: Any) -> rr.Durations:
        seen.append(len(mbs))
        plan = StepPlan(topology=Topology(stages=2), microbatches=len(mbs))
        return rr.Durations.from_arrays(plan, [[0.01] * len(mbs)] * 2)

    ex = CostModelExecutor(durations)
    run_virtual(_pipe(ex, 4).run_step([None] * 4, step=0))
    run_virtual(_pipe(ex, 2).run_step([None] * 2, step=0))
    assert seen == [4, 2]
