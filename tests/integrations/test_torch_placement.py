"""Placement read off a rank's torch stages, and the hint that decides where it could be
either (the middle rank of an odd number of ranks): pure, no processes. The same on three
gloo processes, against torch's own ``ScheduleZBVZeroBubble``, is in
``test_torch_call_styles.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed.pipelining as tp

import rrfp_async as rr
from rrfp_async.integrations._torch_schedule_hint import hint_source
from rrfp_async.integrations._torch_stages import (
    ambiguous_ranks,
    placement_note,
    stage_topologies,
)

pytestmark = pytest.mark.timeout(60)


def stages(grank: int, size: int, indices: list[int]) -> list[Any]:
    """What the drop-in reads off torch's stage objects, for ``indices`` on ``grank``."""
    group = object()
    n = size * len(indices)
    return [
        SimpleNamespace(group=group, group_size=size, group_rank=grank, num_stages=n, stage_index=i)
        for i in indices
    ]


def placements(grank: int, size: int, indices: list[int]) -> list[str]:
    return [t.placement for t in stage_topologies(stages(grank, size, indices))]


def test_the_middle_rank_of_an_odd_pipeline_fits_both_placements() -> None:
    # 3 ranks, 2 stages each: rank 1's stages 1 and 4 are 1 % 3 and 4 % 3 (interleaved),
    # and V-shape's 1 and 2 * 3 - 1 - 1.
    assert placements(1, 3, [1, 4]) == ["interleaved", "vshape"]
    assert placements(0, 3, [0, 5]) == ["vshape"]
    assert placements(0, 3, [0, 3]) == ["interleaved"]
    assert placements(2, 3, [2, 3]) == ["vshape"]
    assert placements(1, 2, [1, 2]) == ["vshape"]  # an even pipeline: never both
    assert placements(1, 2, [1, 3]) == ["interleaved"]
    with pytest.raises(rr.PlanError, match=r"neither interleaved placement .* nor V-shape"):
        stage_topologies(stages(1, 3, [1, 2]))
    assert ambiguous_ranks(3, 2) == [1] and ambiguous_ranks(5, 2) == [2]
    assert ambiguous_ranks(4, 2) == [] and ambiguous_ranks(3, 1) == []


def test_where_both_fit_the_hint_decides() -> None:
    both = stage_topologies(stages(1, 3, [1, 4]))
    # torch's V-shape order: V-shape (before, this rank was read as interleaved and refused it)
    topo, hint, split = hint_source(tp.ScheduleZBVZeroBubble, both, 4)
    assert topo.placement == "vshape" and split and hint.__name__ == "torch:ScheduleZBVZeroBubble"
    topo, _, split = hint_source("ZBVZeroBubble", both, 4)
    assert topo.placement == "vshape" and split
    # torch's interleaved order, one of ours, or none: interleaved (torch's stage mapping)
    assert hint_source(tp.ScheduleInterleaved1F1B, both, 4)[0].placement == "interleaved"
    assert hint_source("bfw", both, 4)[:2] == (both[0], "bfw")
    assert hint_source(None, both, 4) == (both[0], "breadth_first_weighted", False)
    # where only one fits, a hint of the other placement is still refused
    vee = stage_topologies(stages(0, 3, [0, 5]))
    assert hint_source(None, vee, 4)[0].placement == "vshape"  # torch's ZBV order by default
    with pytest.raises(rr.PlanError, match="places stages interleaved, but this rank's stages"):
        hint_source(tp.ScheduleInterleaved1F1B, vee, 4)
    with pytest.raises(rr.PlanError, match="orders interleaved placement"):
        hint_source("bfw", vee, 4)


def test_with_no_hint_ranks_that_may_disagree_carry_the_note() -> None:
    vee = stage_topologies(stages(0, 3, [0, 5]))[0]
    note = placement_note(vee, 0)
    assert note is not None
    assert "group rank(s) 1 [1, 4] fit both" in note and "hint=ScheduleZBVZeroBubble" in note
    middle = stage_topologies(stages(1, 3, [1, 4]))[0]  # taken as interleaved: it may be wrong
    assert placement_note(middle, 1) == note
    # an interleaved rank of the same pipeline agrees with the middle one; an even pipeline
    # has no middle rank
    assert placement_note(stage_topologies(stages(0, 3, [0, 3]))[0], 0) is None
    assert placement_note(stage_topologies(stages(0, 2, [0, 3]))[0], 0) is None
