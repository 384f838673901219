"""Memory in bytes: the weighted admission ledger, byte budgets and byte-aware hints (pure)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async._memory import (
    ActivationBytes,
    parse_memory_budget,
    position_weights,
    weighted_peak,
)
from rrfp_async._tasks import parse_tasks
from rrfp_async.policies import AdmissionLedger, StepSchedule


def _plan(p: int, m: int, v: int = 1, placement: str = "interleaved") -> rr.StepPlan:
    return rr.StepPlan(
        topology=rr.Topology(stages=p, chunks=v, placement=placement),  # type: ignore[arg-type]
        microbatches=m,
    )


def test_a_large_forward_waits_where_small_ones_fit() -> None:
    # Rank 0 of 1F1B, P=2, M=3, bytes 10, 10, 30: the hint's peak is 40 (F1 + F2).
    order = parse_tasks("0F0 0F1 0B0 0F2 0B1 0B2")
    plan = _plan(2, 3)
    nb = ActivationBytes([[10, 10, 30], [10, 10, 30]])
    w = position_weights(order, nb)
    assert w == [10, 10, -10, 30, -10, -30]
    assert weighted_peak(order, nb) == 40
    led = AdmissionLedger(order, 40, weights=w)
    assert led.bytes and led.admissible_at(0)
    # F2 first (30) leaves F0 + F1 of the hint (20) to come: 50 > 40, refused.
    assert not led.admissible_at(3)
    led.start_at(0)
    led.start_at(1)
    assert (led.inflight, led.count, led.peak_count) == (20, 2, 2)
    assert led.filter_admissible([2, 3]) == [2]  # 20 + 30 > 40: only the backward
    led.start_at(2)
    led.finish_at(2)
    assert led.inflight == 10 and led.admissible_at(3)
    assert plan.stages == 2


@given(
    kinds=st.lists(st.sampled_from("FBW"), min_size=1, max_size=40),
    sizes=st.lists(st.integers(0, 50), min_size=40, max_size=40),
    bound=st.integers(1, 200),
    started=st.lists(st.integers(0, 39), max_size=20),
    inflight=st.integers(0, 200),
)
def test_weighted_filter_is_the_bankers_test(
    kinds: list[str], sizes: list[int], bound: int, started: list[int], inflight: int
) -> None:
    # Against the definition: a forward at k (w bytes) is admitted iff inflight + w + the
    # largest prefix sum of the not-started weights strictly before k is within the bound.
    order = [rr.Task(0, k, i) for i, k in enumerate(kinds)]  # type: ignore[arg-type]
    weights = [sizes[i] if k == "F" else -sizes[i] if k == "B" else 0 for i, k in enumerate(kinds)]
    led = AdmissionLedger(order, bound, weights=weights)
    for k in sorted({s for s in started if s < len(order)}):
        led.start_at(k)
    led.inflight = inflight
    ready = [k for k in range(len(order)) if not led._started[k]]

    def reference(k: int) -> bool:
        if weights[k] <= 0:
            return True
        s = m = 0
        for j in range(led.head, k):
            if not led._started[j]:
                s += weights[j]
                m = max(m, s)
        return inflight + weights[k] + m <= bound

    assert led.filter_admissible(ready) == [k for k in ready if reference(k)]


def _run_readiness_first(
    plan: rr.StepPlan, sched: StepSchedule, rng: random.Random
) -> tuple[list[int], int]:
    """Every rank dispatches a random admitted ready task whenever it is free; tasks end in
    a random order. Returns each rank's largest held bytes and the tasks run (all of them
    unless the step deadlocked)."""
    g = plan.graph
    p = plan.stages
    progs = [sched.program(r) for r in range(p)]
    assert sched.budgets is not None
    ledgers = [
        AdmissionLedger(progs[r].order, sched.budgets[r], progs[r].pos, sched.position_bytes(r))
        for r in range(p)
    ]
    missing = {t: len(g.producers[g.index[t]]) for t in g.tasks}
    done: set[rr.Task] = set()
    running: dict[int, rr.Task] = {}
    started: set[rr.Task] = set()
    peak = [0] * p
    while True:
        moves: list[tuple[str, int, rr.Task]] = []
        for r in range(p):
            if r in running:
                moves.append(("end", r, running[r]))
                continue
            ready = [
                k for k, t in enumerate(progs[r].order) if t not in started and missing[t] == 0
            ]
            for k in ledgers[r].filter_admissible(ready):
                moves.append(("start", r, progs[r].order[k]))
        if not moves:
            break
        what, r, t = rng.choice(moves)
        k = progs[r].pos[t]
        if what == "start":
            ledgers[r].start_at(k)
            started.add(t)
            running[r] = t
            peak[r] = max(peak[r], ledgers[r].inflight)
        else:
            ledgers[r].finish_at(k)
            del running[r]
            done.add(t)
            for c in g.consumers[g.index[t]]:
                missing[g.tasks[c]] -= 1
    return peak, len(done)


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(2, 4),
    m=st.integers(1, 8),
    v=st.integers(1, 2),
    hint=st.sampled_from(["1f1b", "gpipe", "bfw", "backward_first", "breadth_first"]),
    seed=st.integers(0, 2**16),
    factor=st.sampled_from([None, 1.0, 1.3, 2.0]),
)
def test_readiness_first_on_a_byte_budget_never_deadlocks_nor_overruns(
    p: int, m: int, v: int, hint: str, seed: int, factor: float | None
) -> None:
    plan = _plan(p, m, v)
    rng = random.Random(seed)
    sizes = [[rng.choice([0, rng.randint(1, 9), rng.randint(50, 400)]) for _ in range(m)]]
    nb = ActivationBytes([sizes[0]] * plan.num_virtual)
    try:
        sched = StepSchedule.build(plan, hint, activation_bytes=nb, memory_budget=factor)
    except rr.errors.HintError:
        return  # a hint that does not apply to this plan (gpipe / 1f1b with chunks)
    assert sched.budgets is not None
    for r in range(p):  # the hint itself fits its budget
        assert weighted_peak(sched.hint[r], nb) <= sched.budgets[r]
    peak, ran = _run_readiness_first(plan, sched, rng)
    assert ran == plan.num_tasks, "the step deadlocked"
    assert all(pk <= b for pk, b in zip(peak, sched.budgets, strict=True)), (peak, sched.budgets)


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(2, 5),
    m=st.integers(1, 10),
    v=st.integers(1, 3),
    placement=st.sampled_from(["interleaved", "vshape"]),
    seed=st.integers(0, 2**16),
)
def test_the_cost_aware_hint_is_built_within_the_fixed_orders_bytes(
    p: int, m: int, v: int, placement: str, seed: int
) -> None:
    if placement == "vshape" and v != 2:
        v = 2
    plan = _plan(p, m, v, placement)
    rng = random.Random(seed)
    nb = ActivationBytes([[rng.randint(1, 1000) for _ in range(m)]] * plan.num_virtual)
    durations = rr.Durations.from_arrays(
        plan, [[rng.uniform(0.1, 3.0) for _ in range(m)] for _ in range(plan.num_virtual)]
    )
    sched = StepSchedule.build(plan, "bfw", durations=durations, activation_bytes=nb)
    ref = rr.policies.reference_orders(plan)
    assert sched.budgets is not None and sched.reference_bytes is not None
    for r in range(p):
        assert sched.budgets[r] == weighted_peak(ref[r], nb) == sched.reference_bytes[r]
        assert sched.peak_bytes(r) is not None
        assert weighted_peak(sched.hint[r], nb) <= sched.budgets[r]


def test_uniform_bytes_are_the_count_bound() -> None:
    plan = _plan(4, 8)
    durations = rr.Durations.from_arrays(
        plan, [[1.0 + (i % 3) for i in range(8)] for _ in range(4)]
    )
    counted = StepSchedule.build(plan, "bfw", durations=durations)
    nbytes = StepSchedule.build(
        plan, "bfw", durations=durations, activation_bytes=ActivationBytes.uniform(plan, 7)
    )
    assert counted.hint == nbytes.hint
    assert nbytes.budgets == tuple(7 * b for b in counted.bounds)


def test_memory_budget_scales_or_sets_bytes() -> None:
    plan = _plan(2, 4)
    nb = ActivationBytes([[100, 200, 300, 400]] * 2)
    base = StepSchedule.build(plan, "1f1b", activation_bytes=nb)
    assert base.budgets == (700, 400)  # F2 + F3 on rank 0; one microbatch on rank 1
    assert StepSchedule.build(plan, "1f1b", activation_bytes=nb, memory_budget=1.5).budgets == (
        1050,
        600,
    )
    assert StepSchedule.build(plan, "1f1b", activation_bytes=nb, memory_budget="1KiB").budgets == (
        1024,
        1024,
    )
    assert StepSchedule.build(
        plan, "1f1b", activation_bytes=nb, memory_budget=[800, 500]
    ).budgets == (800, 500)
    # GPipe holds every microbatch: its own peak is its default budget.
    assert StepSchedule.build(plan, "gpipe", activation_bytes=nb).budgets == (1000, 1000)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (math.nan, "finite number > 0"),
        (-1.0, "finite number > 0"),
        (0, "finite number > 0"),
        ("lots", "is no size"),
        ("12 parsecs", "is no size"),
        (True, "got True"),
        ([1.0], "one value per rank (2)"),
        (1e308, "overflows a float"),
    ],
)
def test_bad_budgets_are_refused_with_what_is_valid(value: object, words: str) -> None:
    plan = _plan(2, 4)
    nb = ActivationBytes([[100, 200, 300, 400]] * 2)
    with pytest.raises(rr.PlanError, match="memory_budget") as e:
        StepSchedule.build(plan, "1f1b", activation_bytes=nb, memory_budget=value)  # type: ignore[arg-type]
    assert words in str(e.value)


def test_a_budget_below_the_hints_own_peak_names_rank_microbatch_and_numbers() -> None:
    plan = _plan(2, 4)
    nb = ActivationBytes([[100, 200, 300, 400]] * 2)
    with pytest.raises(rr.PlanError) as e:
        StepSchedule.build(plan, "1f1b", activation_bytes=nb, memory_budget=600)
    msg = str(e.value)
    assert "rank 0" in msg and "microbatch 3" in msg and "700 B" in msg and "600 B" in msg
    # A small int was probably meant as a factor: the message says how to pass one.
    with pytest.raises(rr.PlanError, match=r"pass memory_budget=2\.0"):
        StepSchedule.build(plan, "1f1b", activation_bytes=nb, memory_budget=2)


def test_a_microbatch_larger_than_the_whole_budget_is_named() -> None:
    plan = _plan(2, 4)
    nb = ActivationBytes([[100, 200, 300, 400]] * 2)
    with pytest.raises(rr.PlanError, match=r"rank 0: microbatch 3 alone stashes 400 B"):
        StepSchedule.build(plan, "bfw", activation_bytes=nb, memory_budget=350)


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ([[1.0, math.nan]], "virtual stage 0, microbatch 1"),
        ([[1.0, -3]], "virtual stage 0, microbatch 1: got -3"),
        ([[1.0, "2"]], "virtual stage 0, microbatch 1"),
        ([[1.0, 2.0], [1.0]], "virtual stage 1 has 1 microbatches"),
        ([], "table of numbers"),
    ],
)
def test_bad_activation_bytes_are_refused(table: object, words: str) -> None:
    with pytest.raises(rr.PlanError) as e:
        ActivationBytes(table)  # type: ignore[arg-type]
    assert words in str(e.value)


def test_bytes_of_another_shape_and_a_budget_without_bytes_are_refused() -> None:
    plan = _plan(2, 4)
    with pytest.raises(rr.PlanError, match="x 3 microbatches, the step has 2 x 4"):
        StepSchedule.build(plan, "bfw", activation_bytes=ActivationBytes([[1, 2, 3]] * 2))
    with pytest.raises(rr.PlanError, match="needs each forward's activation bytes"):
        StepSchedule.build(plan, "bfw", memory_budget=1.5)
    with pytest.raises(rr.PlanError, match="not both"):
        StepSchedule.build(
            plan,
            "bfw",
            activation_bytes=ActivationBytes.uniform(plan),
            memory_budget=1.5,
            memory_factor=2.0,
        )


def test_parse_memory_budget_units() -> None:
    assert parse_memory_budget("24GiB") == 24 * 2**30
    assert parse_memory_budget("1.5 MB") == 1_500_000
    assert parse_memory_budget(1.25) == 1.25
    assert parse_memory_budget(4096) == 4096
