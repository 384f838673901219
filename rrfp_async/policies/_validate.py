"""What a valid hint is: the ``Hint`` type and ``validate_hint``.

A hint is plain data, one task order per pipeline rank. A step may start on it only if every
rank's order holds exactly that rank's tasks, each after its same-rank dependencies, and the
ranks' orders do not wait for each other in a cycle: then the hint is a *safe sequence*, the
guarantee the admission ledger builds on (see ``_admission``). ``validate_hint`` checks all
of it and names the rank and the task that break it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from .._admission import hint_peak
from .._check import describe, is_int, is_sequence
from .._errors import HintError
from .._tasks import StepPlan, Task, format_tasks

__all__ = ["Hint", "validate_hint"]

Hint: TypeAlias = Mapping[int, Sequence[Task]]
"""A hint: for every pipeline rank, the order in which its tasks are ranked."""


def validate_hint(plan: StepPlan, hint: Hint, bounds: Sequence[int] | None = None) -> None:
    """Check a hint against the plan before a step starts.

    Checks: one order per rank; every task of the rank exactly once and no task of another
    rank; every same-rank dependency before its dependent; no waiting cycle across ranks
    (running every rank's order strictly finishes); and, when ``bounds`` are given, each
    rank's in-flight peak within its bound.

    Raises:
        HintError: What is wrong, naming the rank and the task (also a hint that is no
            ``{rank: [Task, ...]}`` mapping, or holds plain tuples or strings, not ``Task``).
    """
    p = plan.stages
    if not isinstance(hint, Mapping):
        raise HintError(
            f"a hint must be a mapping {{rank: [Task, ...]}} for ranks 0..{p - 1}, got"
            f" {describe(hint)}"
        )
    keys = list(hint)
    if not all(is_int(k) for k in keys) or sorted(keys) != list(range(p)):
        raise HintError(
            f"the hint must have one order per rank 0..{p - 1}, got ranks {keys[:16]!r}"
        )
    g = plan.graph  # tasks as numbers: one hash per task, then list lookups
    index, rank_of, producers = g.index, g.rank, g.producers
    seen = bytearray(len(g.tasks))
    numbered: list[list[int]] = []  # each rank's order as task numbers
    for r in range(p):
        raw: object = hint[r]
        if not is_sequence(raw):
            raise HintError(
                f"rank {r}: the order must be a sequence of Tasks, got {describe(raw)}"
                + (" (parse text with rrfp_async.parse_tasks)" if isinstance(raw, str) else "")
            )
        order: list[object] = list(hint[r])
        ids: list[int] = []
        numbered.append(ids)
        for i, x in enumerate(order):
            # The common case in one test: a Task of plain ints that is one of this rank's
            # (dict lookup compares as tuples, so 1.0 would pass for 1: hence the types).
            n = None
            if type(x) is Task and type(x.stage) is int and type(x.mb) is int:
                n = index.get(x)
            if n is None or rank_of[n] != r:
                n = index[_check_task(plan, r, i, x)]
            if seen[n]:
                raise HintError(
                    f"rank {r}: task {g.tasks[n]} appears twice (again at position {i})"
                )
            for dep in producers[n]:
                if rank_of[dep] == r and not seen[dep]:
                    raise HintError(
                        f"rank {r}: task {g.tasks[n]} at position {i} comes before its"
                        f" dependency {g.tasks[dep]}"
                    )
            seen[n] = 1
            ids.append(n)
        if len(ids) != len(g.by_rank[r]):
            missing = sorted(g.tasks[n] for n in g.by_rank[r] if not seen[n])
            raise HintError(
                f"rank {r}: the hint misses {len(missing)} task(s): {format_tasks(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        if bounds is not None and hint_peak(hint[r]) > bounds[r]:
            raise HintError(
                f"rank {r}: the hint holds {hint_peak(hint[r])} activations in flight, over the"
                f" admission bound {bounds[r]}"
            )
    _check_no_cycle(plan, hint, numbered)


def _check_task(plan: StepPlan, r: int, i: int, t: object) -> Task:
    """Raise the ``HintError`` that says why position ``i`` of rank ``r`` holds no task of
    the rank; return ``t`` if it is one after all (fields that are integers of another
    type, a subclass of ``Task``)."""
    if not isinstance(t, Task):
        raise HintError(
            f"rank {r}: position {i} is not a Task: {describe(t)}"
            + (
                f"; write Task({t[0]!r}, {t[1]!r}, {t[2]!r})"
                if isinstance(t, tuple) and len(t) == 3
                else ""
            )
        )
    if not (is_int(t.stage) and is_int(t.mb) and t.kind in ("F", "B", "I", "W")):
        raise HintError(
            f"rank {r}: position {i} is a Task with fields of the wrong type: {tuple(t)!r}"
            " (stage and mb must be ints, kind one of 'F', 'B', 'I', 'W')"
        )
    if not plan.contains(t):
        raise HintError(f"rank {r}: task {t} is not part of this step")
    if plan.rank_of(t) != r:
        raise HintError(f"rank {r}: task {t} belongs to rank {plan.rank_of(t)}")
    return t


def _check_no_cycle(plan: StepPlan, hint: Hint, orders: list[list[int]]) -> None:
    """Run every rank's order strictly (``orders``: the hint as task numbers); report the
    ranks that stall.

    Only whether each task can run matters here, not when: this is ``strict_sweep``
    without its clock (the same worklist, so the same heads), about half its cost.
    """
    g = plan.graph
    p = plan.stages
    producers = g.producers
    done = bytearray(len(g.tasks))
    heads = [0] * p
    waiting: dict[int, list[int]] = {}  # a task not run yet -> ranks whose next task needs it
    todo = list(range(p - 1, -1, -1))
    ran = 0
    while todo:
        r = todo.pop()
        order = orders[r]
        h = heads[r]
        end = len(order)
        while h < end:
            t = order[h]
            for pr in producers[t]:
                if not done[pr]:
                    waiting.setdefault(pr, []).append(r)
                    break
            else:
                done[t] = 1
                h += 1
                woken = waiting.pop(t, None)
                if woken is not None:
                    todo.extend(woken)
                continue
            break
        ran += h - heads[r]
        heads[r] = h
    if ran == len(g.tasks):
        return
    lines = []
    for r in range(p):
        order = orders[r]
        if heads[r] == len(order):
            lines.append(f"  rank {r}: done")
            continue
        t = order[heads[r]]
        waits = [g.tasks[d] for d in producers[t] if not done[d]]
        lines.append(
            f"  rank {r}: next {g.tasks[t]} waits for "
            + ", ".join(f"{d} (rank {plan.rank_of(d)})" for d in waits)
        )
    raise HintError("the hint's ranks wait for each other in a cycle:\n" + "\n".join(lines))
