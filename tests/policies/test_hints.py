"""Hints pinned against hand-written orders (Megatron 1F1B, torch's interleaved and looped
BFS) and the validator's error paths."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

import rrfp_async as rr
from rrfp_async import StepPlan, Task, Topology
from rrfp_async._admission import hint_peak
from rrfp_async._tasks import format_tasks, parse_tasks
from rrfp_async.errors import HintError
from rrfp_async.policies import HINTS, default_bound, make_hint, resolve_bounds, validate_hint


def plan(
    p: int, m: int, v: int = 1, split: bool = False, placement: str = "interleaved"
) -> StepPlan:
    return StepPlan(
        topology=Topology(stages=p, chunks=v, placement=placement),  # type: ignore[arg-type]
        microbatches=m,
        split_backward=split,
    )


def orders(h: dict[int, list[Task]]) -> dict[int, str]:
    return {r: format_tasks(o) for r, o in h.items()}


def test_1f1b_p4_m8_matches_megatron() -> None:
    # Megatron forward_backward_pipelining_without_interleaving: warm-up P-s-1 forwards,
    # steady (F, B) pairs, cool-down backwards.
    assert orders(make_hint("1f1b", plan(4, 8))) == {
        0: "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    }


def test_interleaved_p2_v2_m4_matches_torch() -> None:
    # torch ScheduleInterleaved1F1B._calculate_single_rank_operations (no-ops dropped).
    assert orders(make_hint("interleaved_1f1b", plan(2, 4, v=2))) == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    }


def test_interleaved_p4_v2_m8_rank0_matches_torch() -> None:
    h = make_hint("interleaved", plan(4, 8, v=2))
    assert format_tasks(h[0]) == (
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0"
        " 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7"
    )


def test_looped_bfs_matches_torch() -> None:
    assert orders(make_hint("looped_bfs", plan(2, 2, v=2))) == {
        0: "0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0",
        1: "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0",
    }


def test_gpipe_and_breadth_first() -> None:
    assert format_tasks(make_hint("gpipe", plan(2, 3))[1]) == "1F0 1F1 1F2 1B0 1B1 1B2"
    assert format_tasks(make_hint("bf", plan(2, 2, v=2))[0]) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"


def test_zb_h1_defers_w_by_p_minus_1_minus_s() -> None:
    h = make_hint("zb_h1", plan(3, 4, split=True))
    assert format_tasks(h[0]) == "0F0 0F1 0F2 0I0 0F3 0I1 0I2 0W0 0I3 0W1 0W2 0W3"
    assert format_tasks(h[2]) == "2F0 2I0 2W0 2F1 2I1 2W1 2F2 2I2 2W2 2F3 2I3 2W3"
    assert [hint_peak(h[r]) for r in range(3)] == [3, 2, 1]


def test_split_backward_expands_b_into_i_then_w() -> None:
    h = make_hint("1f1b", plan(2, 2, split=True))
    assert format_tasks(h[1]) == "1F0 1I0 1W0 1F1 1I1 1W1"


def test_backward_first_with_equal_costs_is_1f1b() -> None:
    for p, m in [(1, 1), (2, 5), (4, 8), (5, 3), (8, 32)]:
        assert make_hint("backward_first", plan(p, m)) == make_hint("1f1b", plan(p, m))


def test_backward_forward_warmup_is_1f1b_and_interleaved() -> None:
    assert make_hint("backward_forward_warmup", plan(4, 8)) == make_hint("1f1b", plan(4, 8))
    assert make_hint("backward_forward_warmup", plan(2, 4, v=2)) == make_hint(
        "interleaved", plan(2, 4, v=2)
    )


@pytest.mark.parametrize("name", sorted(HINTS))
@pytest.mark.parametrize(("p", "v", "m"), [(1, 1, 1), (3, 1, 5), (4, 2, 8), (2, 3, 4), (3, 2, 7)])
def test_every_hint_is_valid_or_refused_clearly(name: str, p: int, v: int, m: int) -> None:
    pl = plan(p, m, v=v, split=(name == "zb_h1"))
    rounds = max(1, m // p)
    refused = (v > 1 and name in ("gpipe", "1f1b", "zb_h1")) or (
        m % rounds != 0
        and (name == "interleaved_1f1b" or (name == "backward_forward_warmup" and v > 1))
    )
    if refused:
        with pytest.raises(HintError, match=r"needs (one chunk|the number of microbatches)"):
            make_hint(name, pl)
        return
    h = make_hint(name, pl)
    validate_hint(pl, h)
    bounds = resolve_bounds(pl, h)
    assert all(hint_peak(h[r]) <= bounds[r] for r in range(p))


def test_default_bound_is_1f1b_count() -> None:
    assert [default_bound(plan(4, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert [default_bound(plan(4, 2), r) for r in range(4)] == [2, 2, 2, 1]
    # Megatron interleaved: warm-up (P-r-1)*2 + (V-1)*P, plus the one in steady state.
    assert [default_bound(plan(4, 8, v=2), r) for r in range(4)] == [11, 9, 7, 5]
    for r in range(4):
        assert default_bound(plan(4, 8, v=2), r) == hint_peak(
            make_hint("interleaved", plan(4, 8, v=2))[r]
        )


def test_cost_aware_hint_depends_on_declared_durations() -> None:
    from rrfp_async import Durations

    pl = plan(2, 3)
    heavy_last = Durations.from_arrays(pl, [[1, 1, 5], [1, 1, 5]])
    h = make_hint("bfw", pl, heavy_last)
    # The heaviest microbatch (2) has the most remaining work: it enters first.
    assert h[0][0] == Task(0, "F", 2)
    assert make_hint("bfw", pl)[0][0] == Task(0, "F", 0)


def test_aliases_and_unknown_names() -> None:
    p = plan(2, 4)
    assert make_hint("BFW", p) == make_hint("breadth_first_weighted", p)
    assert make_hint("one-f-one-b", p) == make_hint("1f1b", p)
    with pytest.raises(HintError, match="unknown hint 'nope'"):
        make_hint("nope", p)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 0B0 0F1", "misses 1 task"),
        ("0F0 0F1 0B0 0B1 0B1", "appears twice"),
        ("0B0 0F0 0F1 0B1", "comes before its dependency 0F0"),
        ("0F0 0F1 0B0 1B1", "belongs to rank 1"),
        ("0F0 0F1 0B0 0B9", "not part of this step"),
    ],
)
def test_validator_errors_name_rank_and_task(text: str, message: str) -> None:
    p = plan(2, 2)
    h = make_hint("1f1b", p)
    h[0] = parse_tasks(text)
    with pytest.raises(HintError, match=message) as ei:
        validate_hint(p, h)
    assert "rank 0" in str(ei.value)


def test_validator_detects_cross_rank_cycle() -> None:
    p = plan(2, 2)
    h = {0: parse_tasks("0F0 0B0 0F1 0B1"), 1: parse_tasks("1F1 1B1 1F0 1B0")}
    with pytest.raises(HintError, match="cycle") as ei:
        validate_hint(p, h)
    assert "rank 0: next 0B0 waits for 1B0 (rank 1)" in str(ei.value)


def test_bound_below_hint_peak_is_refused() -> None:
    p = plan(4, 8)
    with pytest.raises(HintError, match=r"holds 4 activations .* bound is 2"):
        resolve_bounds(p, make_hint("1f1b", p), max_inflight=2)
    with pytest.raises(HintError, match="not both"):
        resolve_bounds(p, make_hint("1f1b", p), max_inflight=4, memory_factor=2)
    assert resolve_bounds(p, make_hint("1f1b", p), memory_factor=2.0) == [8, 6, 4, 2]


def test_interleaved_needs_divisible_rounds() -> None:
    with pytest.raises(HintError, match="multiple of the number of rounds"):
        make_hint("interleaved", plan(4, 9, v=2))


def test_interleaved_matches_torch_implementation_exhaustively() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, "ScheduleInterleaved1F1B", None)
    ct = getattr(schedules, "_ComputationType", None)
    if cls is None or ct is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip("torch's private schedule API changed")
    kind: dict[object, rr.Kind] = {ct.FORWARD: "F", ct.FULL_BACKWARD: "B"}
    for p, v, m in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 4, 6, 8, 12]):
        rounds = max(1, m // p)
        if m % rounds:
            continue
        ns = SimpleNamespace(
            n_local_stages=v,
            pp_group_size=p,
            _n_microbatches=m,
            number_of_rounds=rounds,
            microbatches_per_round=m // rounds,
        )
        ours = make_hint("interleaved", plan(p, m, v=v))
        for r in range(p):
            ops = cls._calculate_single_rank_operations(ns, r)
            theirs = [
                Task(a.stage_index, kind[a.computation_type], a.microbatch_index)
                for a in ops
                if a is not None
            ]
            assert theirs == ours[r], (p, v, m, r)


def test_with_durations_regenerates_a_cost_aware_hint_and_keeps_bounds() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    light_first = rr.Durations.from_arrays(plan, [[1.0, 1.0, 1.0, 9.0]] * 2)
    heavy_first = rr.Durations.from_arrays(plan, [[9.0, 1.0, 1.0, 1.0]] * 2)
    s = rr.StepSchedule.build(plan, "bfw", durations=light_first, memory_factor=2.0)
    t = s.with_durations(heavy_first)
    assert t.bounds == s.bounds and t.hint_name == s.hint_name and t.declared is heavy_first
    # The heaviest microbatch enters first under each sizing.
    assert s.hint[0][0] == rr.Task(0, "F", 3) and t.hint[0][0] == rr.Task(0, "F", 0)
    fixed = rr.StepSchedule.build(plan, {r: list(s.hint[r]) for r in range(2)})
    assert fixed.with_durations(heavy_first).hint == fixed.hint
