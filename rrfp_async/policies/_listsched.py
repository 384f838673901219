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
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from .._costs import Durations
from .._errors import HintError
from .._tasks import StepPlan, Task

__all__ = ["list_schedule", "strict_sweep", "strict_timeline"]


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
    p = plan.stages
    topo = plan.topology
    first_stage = [topo.stages_of(r)[0] for r in range(p)]
    chunks = [len(topo.stages_of(r)) for r in range(p)]
    for r in range(p):
        if bounds[r] < chunks[r]:
            raise HintError(
                f"rank {r}: admission bound {bounds[r]} is below its {chunks[r]} chunks; a"
                " microbatch could not pass through all of them"
            )
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
    events: list[tuple[float, int, int, Task]] = []  # (time, seq, 0=done / 1=arrive, task)
    seq = 0
    now = 0.0
    remaining = plan.num_tasks

    def admissible(r: int, t: Task) -> bool:
        if t.kind != "F":
            return True
        if t.stage == first_stage[r]:
            return held[r] + reserved[r] + chunks[r] <= bounds[r]
        return True  # a later chunk uses the slot its first chunk reserved

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
        if not events:
            raise HintError(  # pragma: no cover - the reservation rule makes this unreachable
                "list scheduling stalled: "
                + ", ".join(f"rank {r} ready {ready[r]}" for r in range(p))
            )
        # Apply every event of this instant before anyone dispatches, so that a same-time
        # arrival competes with the others on priority, not on event order.
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


def strict_sweep(
    plan: StepPlan, hint: Any, durations: Durations | None = None
) -> tuple[dict[Task, tuple[float, float]], list[int]]:
    """Run every rank's hint strictly (each task as soon as it is next and its dependencies
    are done), on ``durations`` or on a unit clock.

    Returns:
        ``(times, heads)``: start and end of every task that could run, and for each rank
        the position of its first task that could not (its order's length when all ran).
        A rank stuck before its end means the hint's ranks wait for each other in a cycle.
    """
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
