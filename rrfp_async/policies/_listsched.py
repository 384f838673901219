"""Greedy list scheduling on declared durations: how cost-aware hints are computed.

A pure discrete-event model of one step (no asyncio, no processes): each rank runs one task
at a time; when a rank is free it starts, among its ready tasks that memory admits, the one
with the smallest ``key``. The order in which each rank started its tasks is the hint.

Memory: a rank may hold at most ``bounds[rank]`` activations. With several chunks per rank,
a plain "count below the bound" test can deadlock (the rank fills up with first-chunk
forwards while their later-chunk forwards wait for a slot), so a microbatch's first forward
on a rank *reserves* a slot for each of its later chunks on that rank, and is admitted only
if the slots it needs are all free. Every admitted microbatch can then always progress, so
the schedule always completes, and its in-flight peak never exceeds the bound.

Bytes: with ``nbytes`` (``ActivationBytes``) the bounds are byte budgets and the same rule
holds in bytes: a microbatch's first forward on a rank is admitted only when the rank's
held bytes, its reserved bytes and the microbatch's bytes on all of its chunks there fit
the budget. The admission test then depends on the microbatch: the ready first-chunk
forwards are scanned in priority order for the best one that fits (a smaller microbatch may
start while a larger one waits for room). The resulting order, run strictly, never holds
more than the budget (bytes are held from a forward's dispatch until its backward ends, in
the order the hint records), so it is a valid hint for the byte ledger.

The planner of a step within a byte budget (design note)
--------------------------------------------------------

What the default hint under a byte budget (``breadth_first_weighted`` with ``nbytes=`` and
``budgets=``, what ``simulate`` and the drop-ins with bytes build every step) optimises:
the step's makespan, *as planned*: each rank's order run strictly on the declared
durations of the step's own microbatches, subject to every rank holding at most its budget
(by default the peak bytes strict 1F1B holds on these microbatches) at every point of its
order. Nothing else: not the realized durations (unknown), not the bytes below the budget.

How: a list schedule per candidate key set, and the candidate that ends sooner.

1. ``key``: the most declared work left on the task's microbatch first (its own time, every
   later forward, every backward): forwards while memory admits them, heavier microbatches
   first, a backward as soon as its chain is the longest left.
2. The same keys behind one more: a ready backward first. Under a tight budget the first
   rule can fill a rank with forwards while the backward that would free room waits; this
   one is 1F1B's rule with the microbatches weighted.
3. Each is simulated on the declared durations (this module: events in a heap, each rank's
   ready tasks in two heaps, admission by reservation as above: ``O(T log T)`` for ``T``
   tasks), and each rank's start order is the hint; the candidate whose orders, run
   strictly (``strict_timeline``), end first is the step's hint.

Why not more: a far stronger search over the same information gains little.
``scripts/planner_bound.py`` anneals over the list schedule's keys (thousands to tens of
thousands of schedules per step, minutes) on the declared durations: its plans, run in the
simulator with the seeded noise, beat these two candidates by a few percent, most of their
planned gain lost to the noise; the same search given the *realized* durations, a
clairvoyant planner, gains more but still stays short of 1.3x strict 1F1B at P = 8 x M = 32
multimodal (BENCHMARKS.md, "Speed at equal bytes"). What stops a faster step at the same
bytes is the budget and the noise the plan cannot see, not the search. Planning cost: see
``_ahead`` (``PlanAhead`` builds the next step's hint while this one runs).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from .._costs import Durations
from .._errors import HintError, PlanError
from .._memory import ActivationBytes, format_bytes
from .._tasks import StepPlan, Task

__all__ = ["list_schedule", "list_schedule_keys", "strict_sweep", "strict_timeline"]


def list_schedule(
    plan: StepPlan,
    durations: Durations,
    *,
    key: Callable[[Task], tuple[float | int, ...]],
    bounds: Sequence[int],
) -> dict[int, list[Task]]:
    """Greedy list schedule of one step; returns each rank's start order.

    Args:
        plan: The step plan.
        durations: Declared task durations (and message latencies).
        key: Priority of a task; the smallest ready, admitted task runs first.
        bounds: Most activations in flight per rank.

    Raises:
        HintError: A bound is too small for the rank's chunks.
    """
    return list_schedule_keys(plan, durations, [key(t) for t in plan.graph.tasks], bounds)


def list_schedule_keys(
    plan: StepPlan,
    durations: Durations,
    keys: Sequence[Any],
    bounds: Sequence[int],
    nbytes: ActivationBytes | None = None,
) -> dict[int, list[Task]]:
    """``list_schedule`` with every task's key given by its number in ``plan.graph``;
    with ``nbytes``, ``bounds`` are each rank's byte budget.

    Raises:
        HintError: A bound is too small for the rank's chunks.
        PlanError: With ``nbytes``: a microbatch's bytes on a rank exceed its budget.
    """
    p = plan.stages
    topo = plan.topology
    first_stage = [topo.stages_of(r)[0] for r in range(p)]
    chunks = [len(topo.stages_of(r)) for r in range(p)]
    if nbytes is not None:
        return _list_schedule_bytes(plan, durations, keys, bounds, nbytes, first_stage)
    for r in range(p):
        if bounds[r] < chunks[r]:
            raise HintError(
                f"rank {r}: admission bound {bounds[r]} is below its {chunks[r]} chunks; a"
                " microbatch could not pass through all of them"
            )
    # Tasks are numbers here (``plan.graph``): lists indexed by them, not dicts of Tasks.
    # Each rank's ready tasks, in two heaps of (key, arrival, task): the first-chunk
    # forwards (``gated``), which memory admits all together or none (the test does not
    # depend on the task), and the rest (``free``), always admitted. ``arrival`` counts
    # the tasks in the order they became ready, so the smaller of the two admitted heads
    # is exactly the first task with the smallest key in arrival order: what ``min`` over
    # an arrival-ordered ready list would pick (the O(ready) scan this replaces, kept as
    # the oracle in tests/policies/test_listsched.py).
    g = plan.graph
    rank_of, consumers, tasks = g.rank, g.consumers, g.tasks
    m = plan.microbatches
    nf = g.num_forward  # numbers below are forwards
    nb = nf + g.num_backward  # numbers from nf below nb are B / I
    dur, lat = durations.by_number(plan)
    free: list[list[tuple[Any, int, int]]] = [[] for _ in range(p)]
    gated: list[list[tuple[Any, int, int]]] = [[] for _ in range(p)]
    heappush, heappop = heapq.heappush, heapq.heappop
    arrival = 0

    def make_ready(t: int) -> None:
        nonlocal arrival
        r = rank_of[t]
        arrival += 1
        heap = gated[r] if t < nf and t // m == first_stage[r] else free[r]
        heappush(heap, (keys[t], arrival, t))

    missing = [len(x) for x in g.producers]
    for ids in g.by_rank:  # every task in ``plan.all_tasks()`` order: the arrival order
        for t in ids:
            if not missing[t]:
                make_ready(t)
    held = [0] * p
    reserved = [0] * p
    busy = [False] * p
    order: dict[int, list[int]] = {r: [] for r in range(p)}
    events: list[tuple[float, int, int, int]] = []  # (time, seq, 0=done / 1=arrive, task)
    seq = 0
    now = 0.0
    remaining = plan.num_tasks

    def dispatch(r: int) -> None:
        nonlocal seq
        fh = free[r]
        gh = gated[r] if held[r] + reserved[r] + chunks[r] <= bounds[r] else None
        if gh and (not fh or gh[0] < fh[0]):
            t = heappop(gh)[2]
        elif fh:
            t = heappop(fh)[2]
        else:
            return
        if t < nf:
            held[r] += 1
            if t // m == first_stage[r]:
                reserved[r] += chunks[r] - 1
            else:
                reserved[r] -= 1  # a later chunk uses the slot its first chunk reserved
        busy[r] = True
        order[r].append(t)
        seq += 1
        heappush(events, (now + dur[t], seq, 0, t))

    # Only a rank that an event touched (a task of its own ended, or one became ready) can
    # dispatch something it could not before; they dispatch in rank order, as all would.
    touched = set(range(p))
    while remaining:
        for r in sorted(touched):
            if not busy[r] and (free[r] or gated[r]):
                dispatch(r)
        touched.clear()
        if not events:
            raise HintError(  # pragma: no cover - the reservation rule makes this unreachable
                "list scheduling stalled: "
                + ", ".join(
                    f"rank {r} ready {[tasks[e[2]] for e in free[r] + gated[r]]}" for r in range(p)
                )
            )
        # Apply every event of this instant before anyone dispatches, so that a same-time
        # arrival competes with the others on priority, not on event order.
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, what, t = heappop(events)
            if what == 1:  # a message arrived: its task has one input less
                n = missing[t] - 1
                missing[t] = n
                if n == 0:
                    make_ready(t)
                    touched.add(rank_of[t])
                continue
            r = rank_of[t]
            busy[r] = False
            touched.add(r)
            remaining -= 1
            if nf <= t < nb:
                held[r] -= 1
            for c in consumers[t]:
                if rank_of[c] == r:
                    n = missing[c] - 1
                    missing[c] = n
                    if n == 0:
                        make_ready(c)
                        touched.add(r)
                else:
                    seq += 1
                    heappush(events, (now + (lat[c] if lat is not None else 0.0), seq, 1, c))
    return {r: [tasks[t] for t in ts] for r, ts in order.items()}


def _list_schedule_bytes(
    plan: StepPlan,
    durations: Durations,
    keys: Sequence[Any],
    budgets: Sequence[int],
    nbytes: ActivationBytes,
    first_stage: list[int],
) -> dict[int, list[Task]]:
    """``list_schedule_keys`` under byte budgets (see the module's design note)."""
    nbytes.check_plan(plan)
    p = plan.stages
    topo = plan.topology
    g = plan.graph
    rank_of, consumers, tasks = g.rank, g.consumers, g.tasks
    m = plan.microbatches
    nf = g.num_forward
    nb = nf + g.num_backward
    rows = nbytes.rows()
    w = [x for row in rows for x in row]  # forward number -> bytes
    # need[r][mb]: the bytes a microbatch holds on rank r once all its chunks there ran.
    need = [[sum(rows[v][i] for v in topo.stages_of(r)) for i in range(m)] for r in range(p)]
    for r in range(p):
        i = max(range(m), key=need[r].__getitem__)
        if need[r][i] > budgets[r]:
            raise PlanError(
                f"rank {r}: microbatch {i} alone stashes {format_bytes(need[r][i])} of"
                f" activations on its stages there, more than the rank's byte budget"
                f" {format_bytes(budgets[r])}: raise memory_budget or split the microbatch"
            )
    dur, lat = durations.by_number(plan)
    free: list[list[tuple[Any, int, int]]] = [[] for _ in range(p)]
    gated: list[list[tuple[Any, int, int]]] = [[] for _ in range(p)]
    heappush, heappop = heapq.heappush, heapq.heappop
    arrival = 0

    def make_ready(t: int) -> None:
        nonlocal arrival
        r = rank_of[t]
        arrival += 1
        heap = gated[r] if t < nf and t // m == first_stage[r] else free[r]
        heappush(heap, (keys[t], arrival, t))

    missing = [len(x) for x in g.producers]
    for ids in g.by_rank:
        for t in ids:
            if not missing[t]:
                make_ready(t)
    held = [0] * p
    reserved = [0] * p
    busy = [False] * p
    order: dict[int, list[int]] = {r: [] for r in range(p)}
    events: list[tuple[float, int, int, int]] = []
    seq = 0
    now = 0.0
    remaining = plan.num_tasks

    def pick_gated(r: int) -> tuple[Any, int, int] | None:
        """The best ready first-chunk forward of rank ``r`` that fits its budget now."""
        gh = gated[r]
        if not gh:
            return None
        room = budgets[r] - held[r] - reserved[r]
        needs = need[r]
        head = gh[0]
        if needs[head[2] % m] <= room:
            return head
        for e in sorted(gh):
            if needs[e[2] % m] <= room:
                return e
        return None

    def dispatch(r: int) -> None:
        nonlocal seq
        fh = free[r]
        ge = pick_gated(r)
        if ge is not None and (not fh or ge < fh[0]):
            gh = gated[r]
            if ge is gh[0]:
                heappop(gh)
            else:
                gh.remove(ge)
                heapq.heapify(gh)
            t = ge[2]
        elif fh:
            t = heappop(fh)[2]
        else:
            return
        if t < nf:
            held[r] += w[t]
            if t // m == first_stage[r]:
                reserved[r] += need[r][t % m] - w[t]
            else:
                reserved[r] -= w[t]  # a later chunk uses the room its first chunk reserved
        busy[r] = True
        order[r].append(t)
        seq += 1
        heappush(events, (now + dur[t], seq, 0, t))

    touched = set(range(p))
    while remaining:
        for r in sorted(touched):
            if not busy[r] and (free[r] or gated[r]):
                dispatch(r)
        touched.clear()
        if not events:
            raise HintError(  # pragma: no cover - the reservation rule makes this unreachable
                "list scheduling under byte budgets stalled: "
                + ", ".join(
                    f"rank {r} ready {[tasks[e[2]] for e in free[r] + gated[r]]}" for r in range(p)
                )
            )
        now = events[0][0]
        while events and events[0][0] <= now:
            _, _, what, t = heappop(events)
            if what == 1:
                n = missing[t] - 1
                missing[t] = n
                if n == 0:
                    make_ready(t)
                    touched.add(rank_of[t])
                continue
            r = rank_of[t]
            busy[r] = False
            touched.add(r)
            remaining -= 1
            if nf <= t < nb:
                held[r] -= w[t - nf]
            for c in consumers[t]:
                if rank_of[c] == r:
                    n = missing[c] - 1
                    missing[c] = n
                    if n == 0:
                        make_ready(c)
                        touched.add(r)
                else:
                    seq += 1
                    heappush(events, (now + (lat[c] if lat is not None else 0.0), seq, 1, c))
    return {r: [tasks[t] for t in ts] for r, ts in order.items()}


def strict_sweep(
    plan: StepPlan, hint: Any, durations: Durations | None = None
) -> tuple[dict[Task, tuple[float, float]], list[int]]:
    """Run every rank's hint strictly (each task as soon as it is next and its dependencies
    are done), on ``durations`` or on a unit clock.

    Every task of ``hint`` must be one of the plan's (``validate_hint`` checks that first).

    Returns:
        ``(times, heads)``: start and end of every task that could run, and for each rank
        the position of its first task that could not (its order's length when all ran).
        A rank stuck before its end means the hint's ranks wait for each other in a cycle.
    """
    p = plan.stages
    g = plan.graph
    index = g.index
    orders = [[index[t] for t in hint[r]] for r in range(p)]
    heads = [0] * p
    free = [0.0] * p
    n = len(g.tasks)
    start = [0.0] * n
    end = [0.0] * n
    done = bytearray(n)
    ran: list[int] = []
    # A worklist, not repeated sweeps over every rank: a rank advances until its next task
    # waits for a producer that has not run, and is woken once that producer runs. Each
    # task's times depend only on its producers' and its rank's previous task's, so the
    # result does not depend on the order ranks advance in (the fixpoint is unique), and
    # the work is linear in the tasks (sweeping every rank until nothing moved was not).
    waiting: dict[int, list[int]] = {}  # a task not run yet -> ranks whose next task needs it
    todo = list(range(p - 1, -1, -1))
    producers, rank_of = g.producers, g.rank
    if durations is not None:
        dur, lat = durations.by_number(plan)
    else:
        dur, lat = None, None
    while todo:
        r = todo.pop()
        order = orders[r]
        h = heads[r]
        while h < len(order):
            t = order[h]
            ready = 0.0
            for pr in producers[t]:
                if not done[pr]:
                    waiting.setdefault(pr, []).append(r)
                    break
                x = end[pr] + (lat[t] if lat is not None and rank_of[pr] != r else 0.0)
                if x > ready:
                    ready = x
            else:
                s = free[r]
                if ready > s:
                    s = ready
                start[t] = s
                free[r] = end[t] = s + (dur[t] if dur is not None else 1.0)
                done[t] = 1
                ran.append(t)
                h += 1
                woken = waiting.pop(t, None)
                if woken is not None:
                    todo.extend(woken)
                continue
            break
        heads[r] = h
    tasks = g.tasks
    return {tasks[t]: (start[t], end[t]) for t in ran}, heads


def strict_timeline(
    plan: StepPlan, hint: dict[int, Sequence[Task]] | Any, durations: Durations
) -> dict[Task, tuple[float, float]]:
    """Start and end of every task when each rank runs its hint strictly on ``durations``.

    This is the *plan* a hint stands for: ``StepSchedule.planned`` takes each task's planned
    start and the idle gap before it from here, and ``ReadyView.hinted_deadline`` (what
    ``lateness_aware`` and ``backfill`` compare the rank's clock against) from those.

    Raises:
        HintError: The hint's ranks wait for each other in a cycle.
    """
    times, _ = strict_sweep(plan, hint, durations)
    if len(times) != plan.num_tasks:
        raise HintError("the hint's ranks wait for each other in a cycle")
    return times
