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
   strictly (``strict_timeline``), end first is the step's hint (the first on a tie). The
   run's own end is that time (see "The loop" below): no strict run is needed to compare.
4. The fixed order as a candidate: with several chunks per rank, interleaved 1F1B itself
   (the order the default budget is taken from), where it fits the budgets (or, counting
   activations, the bounds: ``bfw`` then plans alike on uniform bytes), run strictly
   on the same durations; it is the hint when it ends strictly sooner. Why: the list
   schedules, greedy per rank, plan later ends than interleaved 1F1B's round-robin over the
   chunks on most steps, and without this candidate the default ran slower than the fixed
   order it replaces (BENCHMARKS.md, "With two chunks per rank"); with one chunk the list
   schedules never planned a later end than 1F1B in ``scripts/bench_memory.py``'s steps,
   so the candidate (one more strict run) is left out there.

Why not more: a far stronger search over the same information gains little.
``scripts/planner_bound.py`` anneals over the list schedule's keys (thousands to tens of
thousands of schedules per step, minutes) on the declared durations: its plans, run in the
simulator with the seeded noise, beat these two candidates by a few percent, most of their
planned gain lost to the noise; the same search given the *realized* durations, a
clairvoyant planner, gains more but still stays short of 1.3x strict 1F1B at P = 8 x M = 32
multimodal (BENCHMARKS.md, "Speed at equal bytes"). What stops a faster step at the same
bytes is the budget and the noise the plan cannot see, not the search.

The loop: what a plan per step costs, and why it is what it is
--------------------------------------------------------------

A loop that learns a step's sizes only when the step is called (the drop-ins) plans on the
critical path, every step: ``StepSchedule.with_durations`` runs the two candidates above
and takes the budget from the reference order. The time is almost all in the two list
schedules (``_run``): pure Python, one event per task end and per message, a few heap
operations per task. What keeps it small:

* Nothing per step that a plan's shape decides: ``PlanTables`` (each task's rank, its
  consumers on its rank and off it, its producer count, which heap it waits in, what it
  reserves and frees when memory is a count) and the reference order's task numbers
  (``_schedule``) are built once per plan; a step brings only durations and bytes.
* Integers, not tuples, in the heaps: a task's priority is an int (``priorities``: the rank
  of its key; ``breadth_first_weighted`` ranks by declared work with one sort, and
  ``backward_first``'s depend on the plan alone), and a
  ready task is ``prio * (T + 1) + arrival``, ``arrival`` counting the tasks in the order
  they became ready (``ready[arrival]`` is the task), so equal keys go by readiness
  exactly as a heap of ``(key, arrival)`` did, on ints small enough for CPython's fast
  paths.
* Same-time events in the order they were made, without sorting: an event's stamp grows
  with each dispatch round and, within one, with the rank (the order a scan over ranks
  would make them); a zero-latency message is applied at once when its sender's end is
  the instant's last event, and after the instant's other events otherwise (where a
  heap of ``(time, seq)`` would have put it).
* The planned end without a strict run: in the list schedule each task starts as soon as
  its rank's previous task has ended and its inputs are there. A free rank with a ready,
  admitted task starts one at once, and it is the next of the rank's order; a ready next
  task is never refused by memory while its rank is free, since only the rank's own
  starts and ends change what it admits (refused, it would never start). That is how
  ``strict_timeline`` runs the orders, with the same sums: the run's last end is their
  strict makespan, float for float (``tests/policies/test_listsched.py`` holds it).
* No checks of what holds by construction: a list schedule's order is a valid hint (every
  task once, after its producers: the run ended), and within the bound or budget (the
  reservation rule), so ``StepSchedule`` neither validates it nor checks its budget.

All of it leaves the schedules as they were, bit for bit (``scripts/planner_equivalence.py``,
``tests/policies/test_plan_recorded.py``). What is left at P = 16 x M = 64 is the two runs
themselves, about 2 x 2 048 tasks (figures: BENCHMARKS.md, "Planning cost"); a loop that
knows the next step's sizes a step ahead builds it in a worker instead (``PlanAhead``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

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
    adm = admission(plan, bounds, nbytes)
    dur, lat = durations.by_number(plan)
    orders, _ = schedule_numbers(plan, priorities(keys), adm, dur, lat)
    tasks = plan.graph.tasks
    return {r: [tasks[t] for t in ids] for r, ids in enumerate(orders)}


def priorities(keys: Sequence[Any]) -> list[int]:
    """Each key's rank among ``keys`` (0 for the smallest; equal keys, equal ranks): the
    priorities ``schedule_numbers`` takes."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    prio = [0] * len(keys)
    k = 0
    prev = keys[order[0]] if order else None
    for t in order:
        key = keys[t]
        if prev < key:
            k += 1
        prio[t] = k
        prev = key
    return prio


class Admission(NamedTuple):
    """What memory admits on each rank, as ``schedule_numbers`` takes it (``admission``).

    A rank admits a first-chunk forward when its ``need`` fits the rank's ``cap`` less
    what the rank holds and has reserved; starting it reserves ``need`` (the slots, or the
    bytes, of the microbatch's every chunk there), a later chunk's forward uses what its
    first reserved, and a backward's end frees its forward's share (``freed``).

    Attributes:
        cap: Each rank's bound: activations, or bytes.
        need: What each task reserves when it starts (0 for all but first-chunk forwards).
        freed: What each task's end frees (0 for all but ``B`` / ``I``).
        least: Each rank's smallest ``need`` (below it, no first-chunk forward fits).
    """

    cap: Sequence[int]
    need: list[int]
    freed: list[int]
    least: list[int]


def admission(
    plan: StepPlan, bounds: Sequence[int], nbytes: ActivationBytes | None = None
) -> Admission:
    """The ``Admission`` of ``bounds`` (activations), or with ``nbytes`` of byte budgets.

    Raises:
        HintError: A bound is too small for the rank's chunks.
        PlanError: With ``nbytes``: a microbatch's bytes on a rank exceed its budget.
    """
    tb = plan_tables(plan)
    if nbytes is None:
        for r, c in enumerate(tb.chunks):
            if bounds[r] < c:
                raise HintError(
                    f"rank {r}: admission bound {bounds[r]} is below its {c} chunks; a"
                    " microbatch could not pass through all of them"
                )
        return Admission(bounds, tb.count_need, tb.count_freed, tb.chunks)
    nbytes.check_plan(plan)
    m = plan.microbatches
    rows = nbytes.rows()
    need = [0] * tb.num_tasks
    least = []
    for r, stages in enumerate(tb.stages):
        # What a microbatch holds on rank r once all its chunks there ran.
        total = (
            rows[stages[0]]
            if len(stages) == 1
            else [sum(col) for col in zip(*(rows[v] for v in stages), strict=True)]
        )
        i = max(range(m), key=total.__getitem__)
        if total[i] > bounds[r]:
            raise PlanError(
                f"rank {r}: microbatch {i} alone stashes {format_bytes(total[i])} of"
                f" activations on its stages there, more than the rank's byte budget"
                f" {format_bytes(bounds[r])}: raise memory_budget or split the microbatch"
            )
        first = stages[0] * m  # the number of the forward of microbatch 0 there
        need[first : first + m] = total
        least.append(min(total))
    freed = [0] * tb.num_tasks
    if tb.num_backward:  # a backward's number is its forward's plus num_forward
        freed[tb.num_forward : 2 * tb.num_forward] = [x for row in rows for x in row]
    return Admission(bounds, need, freed, least)


def schedule_numbers(
    plan: StepPlan,
    prio: Sequence[int],
    adm: Admission,
    dur: list[float],
    lat: list[float] | None,
) -> tuple[list[list[int]], float]:
    """The list schedule on task numbers (``plan.graph``): each rank's start order, and
    when the step ends as planned (the time ``strict_timeline`` gives these orders: see the
    module's design note).

    Args:
        plan: The step plan.
        prio: Each task's priority: the smallest ready, admitted one starts first; of
            equal ones, the one that became ready first.
        adm: What memory admits (``admission``).
        dur: Each task's declared duration (``Durations.by_number``).
        lat: Each task's input message latency, or None.
    """
    return _run(plan_tables(plan), dur, lat, prio, adm)


class PlanTables:
    """What a list schedule of a plan needs that does not depend on the step's sizes, as
    lists indexed by task number (``plan.graph``): built once per plan (``plan_tables``).

    Attributes:
        num_tasks: Tasks of the step.
        tasks: Each number's task.
        num_forward: Forwards (numbers ``0 .. num_forward - 1``).
        num_backward: ``B`` / ``I`` tasks (the numbers after the forwards).
        stages: Each rank's virtual stages, in chunk order.
        chunks: Each rank's number of chunks.
        rank: Each task's rank.
        local: Each task's consumers on its own rank.
        remote: Each task's consumers on other ranks (their input is a message).
        producers: How many producers each task waits for.
        initial: The tasks ready at the start, in ``plan.all_tasks()`` order.
        heap: Which ready heap holds the task: its rank (``free``), or the rank plus P for
            a first-chunk forward (``gated``: admitted against the bound).
        count_need: Counting activations, what each task's dispatch reserves: a
            first-chunk forward a slot for each of the rank's chunks, any other task 0.
        count_freed: Counting activations, what each task's end frees: 1 for a backward
            (``B`` / ``I``), 0 for any other task.
        delta: Each task's change of its rank's activations in flight (+1, -1, 0).
    """

    __slots__ = (
        "chunks",
        "count_freed",
        "count_need",
        "delta",
        "heap",
        "initial",
        "local",
        "num_backward",
        "num_forward",
        "num_tasks",
        "producers",
        "rank",
        "remote",
        "stages",
        "tasks",
    )

    def __init__(self, plan: StepPlan) -> None:
        g = plan.graph
        p, m = plan.stages, plan.microbatches
        n = len(g.tasks)
        nf = g.num_forward
        nb = nf + g.num_backward
        rank = g.rank
        self.tasks = g.tasks
        self.num_tasks = n
        self.num_forward = nf
        self.num_backward = g.num_backward
        self.stages = [plan.topology.stages_of(r) for r in range(p)]
        self.chunks = [len(s) for s in self.stages]
        self.rank = rank
        self.local = [tuple(c for c in g.consumers[t] if rank[c] == rank[t]) for t in range(n)]
        self.remote = [tuple(c for c in g.consumers[t] if rank[c] != rank[t]) for t in range(n)]
        self.producers = [len(x) for x in g.producers]
        self.initial = [t for ids in g.by_rank for t in ids if not self.producers[t]]
        gated = [t < nf and t // m == self.stages[rank[t]][0] for t in range(n)]
        self.heap = [rank[t] + p * gated[t] for t in range(n)]
        self.count_need = [self.chunks[rank[t]] if gated[t] else 0 for t in range(n)]
        self.count_freed = [int(nf <= t < nb) for t in range(n)]
        self.delta = [1 if t < nf else -1 if t < nb else 0 for t in range(n)]


@lru_cache(maxsize=16)
def plan_tables(plan: StepPlan) -> PlanTables:
    """``PlanTables`` of ``plan`` (cached: steps of one shape plan on the same tables)."""
    return PlanTables(plan)


def _run(
    tb: PlanTables,
    dur: list[float],
    lat: list[float] | None,
    prio: Sequence[int],
    adm: Admission,
) -> tuple[list[list[int]], float]:
    """``schedule_numbers`` (see the module's design note, "The loop")."""
    cap, need, freed, least = adm
    p, n = len(cap), tb.num_tasks
    rank_of, local, remote = tb.rank, tb.local, tb.remote
    heappush, heappop, heapify = heapq.heappush, heapq.heappop, heapq.heapify
    # Each rank's ready tasks in two heaps of ints (first-chunk forwards, the rest):
    # prio * (n + 1) + arrival, arrival counting the tasks in the order they became ready
    # (``ready[arrival]`` is the task).
    big = n + 1
    ready = [0] * big
    heaps: list[list[int]] = [[] for _ in range(2 * p)]
    home = list(map(heaps.__getitem__, tb.heap))
    free, gated = heaps[:p], heaps[p:]
    missing = tb.producers.copy()
    arrival = 0
    for t in tb.initial:
        arrival += 1
        ready[arrival] = t
        heappush(home[t], prio[t] * big + arrival)
    room = list(cap)  # each rank's bound less what it holds and has reserved
    busy = [False] * p
    orders: list[list[int]] = [[] for _ in range(p)]
    start = [o.append for o in orders]
    # Events: (time, stamp + x), x a task that ends or n + a task whose input message
    # arrives; stamps (multiples of 2n) grow in the order events are made, ranks in rank
    # order within one dispatch round.
    two_n = 2 * n
    round_stamps = p * two_n
    rank_stamp = [r * two_n for r in range(p)]
    inf = float("inf")
    events: list[tuple[float, int]] = [(inf, 0)]  # a sentinel: never empty
    seq = 0
    now = 0.0
    todo = list(range(p))  # the ranks an event touched: only they can start a task
    fifo: list[int] = []  # messages that arrive now, after this instant's other events
    while True:
        stamp = seq
        seq += round_stamps
        for r in todo:
            if busy[r]:
                continue
            fh = free[r]
            gh = gated[r]
            t = -1
            if gh:
                e = gh[0]
                if need[ready[e % big]] <= room[r]:
                    if not fh or e < fh[0]:
                        t = ready[heappop(gh) % big]
                elif least[r] <= room[r]:
                    # The head does not fit: the best one that does (a smaller microbatch
                    # may start while a larger one waits for room), if any.
                    for e in sorted(gh):
                        if need[ready[e % big]] <= room[r]:
                            if not fh or e < fh[0]:
                                gh.remove(e)
                                heapify(gh)
                                t = ready[e % big]
                            break
            if t < 0:
                if not fh:
                    continue
                t = ready[heappop(fh) % big]
            room[r] -= need[t]
            busy[r] = True
            start[r](t)
            heappush(events, (now + dur[t], stamp + rank_stamp[r] + t))
        todo.clear()
        at, code = heappop(events)
        if at == inf:
            break
        now = at
        while True:  # every event of this instant, in the order they were made
            x = code % two_n
            more = events[0][0] <= now
            if x < n:  # a task ended
                r = rank_of[x]
                busy[r] = False
                todo.append(r)
                room[r] += freed[x]
                for c in local[x]:
                    left = missing[c] - 1
                    missing[c] = left
                    if not left:
                        arrival += 1
                        ready[arrival] = c
                        heappush(home[c], prio[c] * big + arrival)
                if lat is None:
                    if more or fifo:
                        fifo += remote[x]
                    else:  # the instant's last event: its messages are next anyway
                        for c in remote[x]:
                            left = missing[c] - 1
                            missing[c] = left
                            if not left:
                                arrival += 1
                                ready[arrival] = c
                                heappush(home[c], prio[c] * big + arrival)
                                todo.append(rank_of[c])
                else:
                    for c in remote[x]:
                        at = now + lat[c]
                        if at == now:
                            fifo.append(c)
                        else:
                            heappush(events, (at, seq + n + c))
                            seq += two_n
            else:  # a message arrived: its task waits for one input less
                c = x - n
                left = missing[c] - 1
                missing[c] = left
                if not left:
                    arrival += 1
                    ready[arrival] = c
                    heappush(home[c], prio[c] * big + arrival)
                    todo.append(rank_of[c])
            if not more:
                break
            code = heappop(events)[1]
        if fifo:  # messages of this instant, in the order they were sent
            for c in fifo:
                left = missing[c] - 1
                missing[c] = left
                if not left:
                    arrival += 1
                    ready[arrival] = c
                    heappush(home[c], prio[c] * big + arrival)
                    todo.append(rank_of[c])
            fifo.clear()
    if sum(map(len, orders)) != n:
        tasks = tb.tasks
        raise HintError(  # pragma: no cover - the reservation rule makes this unreachable
            "list scheduling stalled: "
            + ", ".join(
                f"rank {r} ready {[tasks[ready[e % big]] for e in free[r] + gated[r]]}"
                for r in range(p)
            )
        )
    return orders, now


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
