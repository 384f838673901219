"""The list scheduler and the strict sweep against their first, plainly quadratic versions.

``list_schedule`` once scanned each rank's whole ready list per dispatch and every rank per
event instant; ``strict_sweep`` swept every rank until nothing moved. Both were replaced
(heaps and a worklist) for the simulator's sake; the originals are kept here, verbatim, as
oracles: on random plans, durations, latencies, bounds and priority keys (ties included)
the new versions must give exactly the same orders, times and heads.

And what the planner relies on instead of checking each step (``_listsched``'s design note,
"The loop"): a list schedule, under a count bound or a byte budget, is a valid hint within
it whose strict run ends exactly when the list schedule's run does; the work priorities of
``breadth_first_weighted`` (all different) give the schedule its tied keys give.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rrfp_async import ActivationBytes, Kind, StepPlan, Task, Topology
from rrfp_async._costs import Durations
from rrfp_async._errors import HintError
from rrfp_async._memory import weighted_peak
from rrfp_async.policies import hint_peak, make_hint, validate_hint
from rrfp_async.policies._bounds import default_bounds
from rrfp_async.policies._hints import (
    _work_priorities,
    breadth_first_weighted,
    remaining_work,
)
from rrfp_async.policies._listsched import (
    admission,
    list_schedule,
    list_schedule_keys,
    priorities,
    schedule_numbers,
    strict_sweep,
    strict_timeline,
)

pytestmark = pytest.mark.timeout(120)


def oracle_list_schedule(
    plan: StepPlan,
    durations: Durations,
    *,
    key: Callable[[Task], Any],
    bounds: Sequence[int],
) -> dict[int, list[Task]]:
    """``list_schedule`` as it was before the heaps (O(ready) per dispatch)."""
    p = plan.stages
    topo = plan.topology
    first_stage = [topo.stages_of(r)[0] for r in range(p)]
    chunks = [len(topo.stages_of(r)) for r in range(p)]
    for r in range(p):
        if bounds[r] < chunks[r]:
            raise HintError("bound below chunks")
    missing: dict[Task, int] = {}
    for t in plan.all_tasks():
        missing[t] = len(plan.producers(t))
    ready: list[list[Task]] = [[] for _ in range(p)]
    for t, n in missing.items():
        if n == 0:
            ready[plan.rank_of(t)].append(t)
    held = [0] * p
    reserved = [0] * p
    busy = [False] * p
    order: dict[int, list[Task]] = {r: [] for r in range(p)}
    events: list[tuple[float, int, int, Task]] = []
    seq = 0
    now = 0.0
    remaining = plan.num_tasks

    def admissible(r: int, t: Task) -> bool:
        if t.kind != "F":
            return True
        if t.stage == first_stage[r]:
            return held[r] + reserved[r] + chunks[r] <= bounds[r]
        return True

    def dispatch(r: int) -> None:
        nonlocal seq
        cands = [t for t in ready[r] if admissible(r, t)]
        if not cands:
            return
        t = min(cands, key=key)
        ready[r].remove(t)
        if t.kind == "F":
            held[r] += 1
            if t.stage == first_stage[r]:
                reserved[r] += chunks[r] - 1
            else:
                reserved[r] -= 1
        busy[r] = True
        order[r].append(t)
        seq += 1
        heapq.heappush(events, (now + durations.of(t), seq, 0, t))

    def satisfy(t: Task) -> None:
        missing[t] -= 1
        if missing[t] == 0:
            ready[plan.rank_of(t)].append(t)

    while remaining:
        for r in range(p):
            if not busy[r] and ready[r]:
                dispatch(r)
        assert events
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, what, t = heapq.heappop(events)
            if what == 1:
                satisfy(t)
                continue
            r = plan.rank_of(t)
            busy[r] = False
            remaining -= 1
            if t.kind in ("B", "I"):
                held[r] -= 1
            for c in plan.consumers(t):
                if plan.rank_of(c) == r:
                    satisfy(c)
                else:
                    seq += 1
                    heapq.heappush(events, (now + durations.latency(c), seq, 1, c))
    return order


def oracle_strict_sweep(
    plan: StepPlan, hint: Any, durations: Durations | None = None
) -> tuple[dict[Task, tuple[float, float]], list[int]]:
    """``strict_sweep`` as it was before the worklist (sweeps until nothing moves)."""
    p = plan.stages
    orders = [list(hint[r]) for r in range(p)]
    heads = [0] * p
    free = [0.0] * p
    times: dict[Task, tuple[float, float]] = {}
    progress = True
    while progress:
        progress = False
        for r in range(p):
            order = orders[r]
            h = heads[r]
            while h < len(order):
                t = order[h]
                ready = 0.0
                for pr in plan.producers(t):
                    te = times.get(pr)
                    if te is None:
                        break
                    lat = durations.latency(t) if durations and plan.rank_of(pr) != r else 0.0
                    ready = max(ready, te[1] + lat)
                else:
                    start = max(free[r], ready)
                    free[r] = start + (durations.of(t) if durations is not None else 1.0)
                    times[t] = (start, free[r])
                    h += 1
                    continue
                break
            if h != heads[r]:
                heads[r] = h
                progress = True
    return times, heads


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    v = draw(st.integers(1, 3))
    split = draw(st.booleans())
    return StepPlan(
        topology=Topology(
            stages=draw(st.integers(1, 6)),
            chunks=v,
            placement=draw(st.sampled_from(["interleaved", "vshape"])) if v == 2 else "interleaved",
        ),
        microbatches=draw(st.integers(1, 12)),
        split_backward=split,
        ordered_weights=split and draw(st.booleans()),
    )


def durations_for(
    draw: Callable[[st.SearchStrategy[Any]], Any], plan: StepPlan, coarse: bool
) -> Durations:
    # Coarse values (a few small integers) make many ties: same-time events and equal keys.
    val = st.integers(0, 3).map(float) if coarse else st.floats(0.0, 5.0)
    shape = (plan.num_virtual, plan.microbatches)

    def table() -> list[list[float]]:
        return [[draw(val) for _ in range(shape[1])] for _ in range(shape[0])]

    kinds: tuple[Kind, ...] = ("F", "B", "I", "W")
    lat = {k: table() for k in kinds} if draw(st.booleans()) else None
    return Durations({k: table() for k in kinds}, lat)


KEYS = ["bfw", "backward_first", "random", "constant"]


@given(data=st.data())
def test_list_schedule_matches_the_quadratic_original(data: st.DataObject) -> None:
    plan = data.draw(plans())
    d = durations_for(data.draw, plan, coarse=data.draw(st.booleans()))
    which = data.draw(st.sampled_from(KEYS))
    if which == "bfw":
        work = remaining_work(plan, d)

        def key(t: Task) -> Any:
            return (-work[t], t.mb, t.stage)

    elif which == "backward_first":
        first = {"B": 0, "I": 0, "F": 1, "W": 2}

        def key(t: Task) -> Any:
            return (first[t.kind], t.mb, -t.stage if t.kind == "F" else t.stage)

    elif which == "random":
        prio = {t: data.draw(st.integers(0, 3)) for t in plan.all_tasks()}

        def key(t: Task) -> Any:
            return (prio[t],)

    else:

        def key(t: Task) -> Any:
            return (0,)

    base = default_bounds(plan)
    extra = data.draw(st.integers(0, 3))
    bounds = [b + extra for b in base]
    assert list_schedule(plan, d, key=key, bounds=bounds) == oracle_list_schedule(
        plan, d, key=key, bounds=bounds
    )


@given(data=st.data())
def test_strict_sweep_matches_the_sweeping_original(data: st.DataObject) -> None:
    plan = data.draw(plans())
    d = durations_for(data.draw, plan, coarse=data.draw(st.booleans()))
    hint = make_hint(
        "breadth_first_weighted" if data.draw(st.booleans()) else "backward_first", plan, d
    )
    if data.draw(st.booleans()):
        # A hint whose ranks wait for each other in a cycle: some rank's order reversed
        # (dependencies broken too), so the sweeps stop early with the same heads.
        r = data.draw(st.integers(0, plan.stages - 1))
        hint = dict(hint)
        hint[r] = list(reversed(hint[r]))
    dur = d if data.draw(st.booleans()) else None
    times, heads = strict_sweep(plan, hint, dur)
    want_times, want_heads = oracle_strict_sweep(plan, hint, dur)
    assert heads == want_heads
    assert times == want_times


@st.composite
def locally_ordered_hints(draw: st.DrawFn, plan: StepPlan) -> dict[int, list[Task]]:
    """Each rank's tasks in a random order that keeps its same-rank dependencies (cross-rank
    ones ignored, so that many of these hints wait in a cycle)."""
    hint: dict[int, list[Task]] = {}
    for r in range(plan.stages):
        left = list(plan.tasks_of(r))
        done: set[Task] = set()
        order: list[Task] = []
        while left:
            ok = [
                t for t in left if all(d in done for d in plan.producers(t) if plan.rank_of(d) == r)
            ]
            t = ok[draw(st.integers(0, len(ok) - 1))]
            left.remove(t)
            done.add(t)
            order.append(t)
        hint[r] = order
    return hint


@given(data=st.data())
def test_validate_finds_a_cycle_exactly_when_the_strict_sweep_stalls(
    data: st.DataObject,
) -> None:
    # validate_hint's cycle check runs without a clock; the sweeping original is the oracle
    # of which hints stall and where each rank stops.
    plan = data.draw(plans())
    hint = data.draw(locally_ordered_hints(plan))
    times, heads = oracle_strict_sweep(plan, hint, None)
    if len(times) == plan.num_tasks:
        validate_hint(plan, hint)
        return
    with pytest.raises(HintError, match="cycle") as ei:
        validate_hint(plan, hint)
    for r in range(plan.stages):
        if heads[r] == len(hint[r]):
            assert f"rank {r}: done" in str(ei.value)
        else:
            assert f"rank {r}: next {hint[r][heads[r]]} waits for" in str(ei.value)


@given(data=st.data())
def test_a_list_schedule_is_its_own_strict_run(data: st.DataObject) -> None:
    # What the planner relies on instead of checking (the design note, "The loop"): the
    # orders are a valid hint within the bound or budget, and the run's end is, float for
    # float, when those orders end run strictly. Ties in keys and times included.
    plan = data.draw(plans())
    d = durations_for(data.draw, plan, coarse=data.draw(st.booleans()))
    keys = [(data.draw(st.integers(0, 3)),) for _ in plan.graph.tasks]
    nbytes = None
    if data.draw(st.booleans()):
        bounds = [b + data.draw(st.integers(0, 3)) for b in default_bounds(plan)]
    else:
        table = [
            [data.draw(st.integers(0, 9)) for _ in range(plan.microbatches)]
            for _ in range(plan.num_virtual)
        ]
        nbytes = ActivationBytes(table)
        need = [
            max(
                sum(table[v][i] for v in plan.topology.stages_of(r))
                for i in range(plan.microbatches)
            )
            for r in range(plan.stages)
        ]
        bounds = [x + data.draw(st.integers(0, 12)) for x in need]
    adm = admission(plan, bounds, nbytes)
    dur, lat = d.by_number(plan)
    orders, end = schedule_numbers(plan, priorities(keys), adm, dur, lat)
    tasks = plan.graph.tasks
    hint = {r: [tasks[t] for t in ids] for r, ids in enumerate(orders)}
    assert hint == list_schedule_keys(plan, d, keys, bounds, nbytes)
    validate_hint(plan, hint)
    assert end == max(e for _, e in strict_timeline(plan, hint, d).values())
    for r in range(plan.stages):
        if nbytes is None:
            assert hint_peak(hint[r]) <= bounds[r]
        else:
            assert weighted_peak(hint[r], nbytes) <= bounds[r]


@given(data=st.data())
def test_work_priorities_refine_the_keys_without_changing_the_schedule(
    data: st.DataObject,
) -> None:
    # ``breadth_first_weighted`` ranks tasks by work with all ranks different; the keys it
    # stands for, (-work, microbatch, stage), tie only between a task and its own
    # descendant (never ready together), so the schedule is the one the tied keys give.
    plan = data.draw(plans())
    d = durations_for(data.draw, plan, coarse=True)
    work = remaining_work(plan, d)
    keys = [(-work[t], t.mb, t.stage) for t in plan.graph.tasks]
    prio = _work_priorities(plan, d)
    assert len(set(prio)) == len(prio)
    adm = admission(plan, default_bounds(plan))
    dur, lat = d.by_number(plan)
    assert schedule_numbers(plan, prio, adm, dur, lat) == schedule_numbers(
        plan, priorities(keys), adm, dur, lat
    )


@given(data=st.data())
def test_with_chunks_the_byte_aware_bfw_never_plans_a_later_end_than_interleaved_1f1b(
    data: st.DataObject,
) -> None:
    """With several chunks, the default hint under a byte budget (the default budget: what
    interleaved 1F1B holds) plans an end no later than interleaved 1F1B's own, run strictly
    on the same durations (the fixed order is one of its candidates); it stays within the
    budget. Red before the candidate: the list schedules alone planned later ends."""
    stages = data.draw(st.integers(2, 5))
    plan = StepPlan(
        topology=Topology(stages=stages, chunks=2),
        microbatches=stages * data.draw(st.integers(1, 3)),
    )
    fw = [[data.draw(st.floats(0.1, 5.0)) for _ in range(plan.microbatches)]] * plan.num_virtual
    durations = Durations.from_arrays(plan, fw)
    sizes = [data.draw(st.integers(1, 1000)) for _ in range(plan.microbatches)]
    nbytes = ActivationBytes.from_sizes(plan, sizes)
    fixed = make_hint("interleaved_1f1b", plan)
    budgets = [weighted_peak(fixed[r], nbytes) for r in range(plan.stages)]
    hint = breadth_first_weighted(plan, durations, nbytes=nbytes, budgets=budgets)

    def end(h: Any) -> float:
        return max(e for _, e in strict_timeline(plan, h, durations).values())

    assert end(hint) <= end(fixed)
    assert all(weighted_peak(hint[r], nbytes) <= budgets[r] for r in range(plan.stages))
