"""Process layouts (pure parts)."""

from __future__ import annotations

import pytest

import rrfp_async as rr


def test_default_layout_is_megatron_order() -> None:
    lay = rr.ProcessLayout(pp=2, tp=2, dp=2, rank=5)
    # rank = (dp * pp + pp_rank) * tp + tp_rank: 5 = (1*2 + 0)*2 + 1
    assert (lay.dp_rank, lay.pp_rank, lay.tp_rank) == (1, 0, 1)
    assert lay.tp_ranks() == [4, 5]
    assert lay.dp_ranks() == [1, 5]
    assert lay.pipeline_peers() == {0: 5, 1: 7}
    assert lay.global_rank(1, tp_rank=0, dp_rank=0) == 2


def test_layout_errors() -> None:
    with pytest.raises(rr.PlanError, match="outside the world"):
        rr.ProcessLayout(pp=2, rank=2)
    with pytest.raises(rr.PlanError, match="pp must be"):
        rr.ProcessLayout(pp=0, rank=0)


def test_pipeline_neighbors() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=2)
    assert rr.distributed.pipeline_neighbors(plan, 0) == ([1], [1])
    assert rr.distributed.pipeline_neighbors(plan, 2) == ([1, 3], [1, 3])
    inter = rr.StepPlan(topology=rr.Topology(stages=2, chunks=2), microbatches=2)
    assert rr.distributed.pipeline_neighbors(inter, 0) == ([1], [1])
    single = rr.StepPlan(topology=rr.Topology(stages=1, chunks=3), microbatches=2)
    assert rr.distributed.pipeline_neighbors(single, 0) == ([], [])
