"""Hints: per-rank task orders. A hint ranks tasks; a policy decides how strictly to obey it.

A hint is plain data (``Hint``: one task order per pipeline rank), produced by a pure
generator from the step plan and (for cost-aware hints) the declared durations of the step's
microbatches, so a hint may be recomputed every step from microbatch metadata. ``make_hint``
generates one by name and checks it with ``validate_hint`` (``_validate``); the cost-aware
generators schedule under the default admission bounds (``_bounds``).

Built-in generators (``HINTS``; names are case-insensitive, ``-`` and ``_`` are equal):

=========================  ==============================================================
``gpipe``                  all forwards, then all backwards, microbatch order (V = 1)
``1f1b``                   Megatron's one-forward-one-backward order (V = 1)
``interleaved_1f1b``       torch's ``ScheduleInterleaved1F1B`` order (interleaved placement)
``looped_bfs``             torch's ``ScheduleLoopedBFS`` order
``zb_h1``                  zero-bubble ZB-H1 (split backward: ``W`` deferred into bubbles)
``breadth_first``          "BF", reading 1: all forwards before any backward, chunk by chunk
``breadth_first_weighted`` "BFW", reading 1: cost-aware list schedule, highest remaining
                           work first, under the 1F1B admission bound
``backward_first``         "BF", reading 2: cost-aware list schedule, backwards before
                           forwards, under the 1F1B admission bound
``backward_forward_warmup`` "BFW", reading 2: warm-up forwards, then alternate one backward
                           and one forward; this *is* 1F1B (V = 1) / interleaved 1F1B
=========================  ==============================================================

Aliases: ``interleaved`` -> ``interleaved_1f1b``, ``zbh1`` -> ``zb_h1``, and, until the
benchmarks settle what the RRFP preprint means, ``bf`` -> ``breadth_first`` and ``bfw`` ->
``breadth_first_weighted``.

A split-backward plan (``I``/``W``) gets ``W`` right after its ``I`` from every generator
except ``zb_h1`` (which defers it) and the list-scheduled ones (which place it by cost).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from itertools import accumulate, chain
from operator import add
from typing import NamedTuple, Protocol, TypeAlias

from .._admission import hint_peak
from .._check import check_type, describe
from .._costs import Durations
from .._errors import HintError, PlanError, RRFPError
from .._memory import ActivationBytes, weighted_peak
from .._tasks import StepPlan, Task
from ._bounds import default_bounds, microbatches_per_round
from ._listsched import admission, priorities, schedule_numbers, strict_timeline
from ._validate import validate_hint

__all__ = [
    "HINTS",
    "HintFn",
    "backward_first",
    "backward_forward_warmup",
    "breadth_first",
    "breadth_first_weighted",
    "canonical_hint_name",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "make_hint",
    "one_f_one_b",
    "remaining_work",
    "zb_h1",
]

HintFn: TypeAlias = Callable[[StepPlan, Durations | None], dict[int, list[Task]]]
"""A hint generator: ``(plan, declared durations or None) -> {rank: [Task, ...]}``."""


def _expand(plan: StepPlan, order: list[Task]) -> list[Task]:
    """Replace each full backward by ``I`` then ``W`` when the plan splits the backward."""
    if not plan.split_backward:
        return order
    out: list[Task] = []
    for t in order:
        if t.kind == "B":
            out.append(Task(t.stage, "I", t.mb))
            out.append(Task(t.stage, "W", t.mb))
        else:
            out.append(t)
    return out


def _need_single_chunk(plan: StepPlan, name: str) -> None:
    if plan.topology.chunks != 1:
        raise HintError(
            f"hint {name!r} needs one chunk per rank (chunks=1), got chunks="
            f"{plan.topology.chunks}; use 'interleaved_1f1b', 'looped_bfs' or a list-scheduled"
            " hint ('backward_first', 'breadth_first_weighted')"
        )


def gpipe(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """GPipe: every forward in microbatch order, then every backward in microbatch order."""
    _need_single_chunk(plan, "gpipe")
    m = plan.microbatches
    return {
        r: _expand(plan, [Task(r, "F", i) for i in range(m)] + [Task(r, "B", i) for i in range(m)])
        for r in range(plan.stages)
    }


def one_f_one_b(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """Megatron's 1F1B: on rank ``r``, ``P-r-1`` warm-up forwards, then (F, B) pairs, then the
    cool-down Bs."""
    _need_single_chunk(plan, "1f1b")
    p, m = plan.stages, plan.microbatches
    out = {}
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [Task(s, "F", i) for i in range(warm)]
        for i in range(m - warm):
            order.append(Task(s, "F", warm + i))
            order.append(Task(s, "B", i))
        order += [Task(s, "B", i) for i in range(m - warm, m)]
        out[s] = _expand(plan, order)
    return out


def _rounds(plan: StepPlan, name: str) -> int:
    """Microbatches per round; ``HintError`` naming ``name`` when there is no such number."""
    per_round = microbatches_per_round(plan)
    if per_round is None:
        m = plan.microbatches
        rounds = max(1, m // plan.stages)
        raise HintError(
            f"hint {name!r} needs the number of microbatches ({m}) to be a multiple of the"
            f" number of rounds max(1, M // P) = {rounds}"
        )
    return per_round


def interleaved_warmup(plan: StepPlan, rank: int, multiply: int = 2) -> int:
    """Warm-up forwards of torch's interleaved 1F1B on ``rank`` (Megatron's with M % P == 0)."""
    v, p, m = plan.topology.chunks, plan.stages, plan.microbatches
    per_round = _rounds(plan, "interleaved_1f1b")
    return min((v - 1) * per_round + multiply * (p - 1 - rank), m * v)


def interleaved_1f1b(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """torch's ``ScheduleInterleaved1F1B`` order ("depth first": the earlier microbatch first).

    Warm-up ``(V-1)*R + 2*(P-1-r)`` forwards (``R`` microbatches per round, ``R = P`` when
    ``M % P == 0``, which is Megatron's count), then (F, B) pairs, then the cool-down.
    """
    if plan.topology.placement != "interleaved":
        raise HintError("hint 'interleaved_1f1b' needs placement='interleaved'")
    v, p, m = plan.topology.chunks, plan.stages, plan.microbatches
    per_round = _rounds(plan, "interleaved_1f1b")
    out = {}
    for r in range(p):
        warm = interleaved_warmup(plan, r)
        ops = v * m
        fwd_next = [0] * v
        bwd_next = [0] * v
        order: list[Task] = []
        for op in range(ops + warm):
            if op < ops:  # a forward in the warm-up and in every (F, B) pair
                local = (op // per_round) % v
                order.append(Task(local * p + r, "F", fwd_next[local]))
                fwd_next[local] += 1
            if op >= warm:  # a backward in every pair and in the cool-down
                local = v - 1 - ((op - warm) // per_round) % v
                order.append(Task(local * p + r, "B", bwd_next[local]))
                bwd_next[local] += 1
        out[r] = _expand(plan, order)
    return out


def looped_bfs(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """torch's ``ScheduleLoopedBFS``: the forwards of each of the rank's virtual stages in
    turn, then the backwards virtual stage by virtual stage in reverse, each in reverse
    microbatch order."""
    m = plan.microbatches
    out = {}
    for r in range(plan.stages):
        stages = plan.topology.stages_of(r)
        order = [Task(s, "F", i) for s in stages for i in range(m)]
        order += [Task(s, "B", i) for s in reversed(stages) for i in reversed(range(m))]
        out[r] = _expand(plan, order)
    return out


def zb_h1(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B's F/I order with each W deferred.

    Rank ``r`` runs the 1F1B order with the backward split into ``I`` and ``W``, and runs
    ``W(i)`` only after ``I(i + P-1-r)``: the first ranks keep ``P-1-r`` weight gradients
    back to fill the cool-down bubbles. Peak activations equal 1F1B's.
    """
    _need_single_chunk(plan, "zb_h1")
    if not plan.split_backward:
        raise HintError("hint 'zb_h1' needs a split backward (split_backward=True)")
    p, m = plan.stages, plan.microbatches
    out = {}
    for s in range(p):
        warm = min(p - s - 1, m)
        lag = p - 1 - s
        order = [Task(s, "F", i) for i in range(warm)]
        w_next = 0
        for i in range(m):
            if i < m - warm:
                order.append(Task(s, "F", warm + i))
            order.append(Task(s, "I", i))
            if i - lag >= w_next:
                order.append(Task(s, "W", w_next))
                w_next += 1
        order += [Task(s, "W", i) for i in range(w_next, m)]
        out[s] = order
    return out


def breadth_first(plan: StepPlan, durations: Durations | None = None) -> dict[int, list[Task]]:
    """ "BF" read as *breadth-first*: all forwards before any backward.

    Forwards chunk by chunk in microbatch order, then backwards chunk by chunk in reverse
    chunk order, microbatch order within a chunk (Lamy-Poirier's breadth-first pipeline;
    GPipe when V = 1; torch's looped BFS differs only in running backwards in reverse
    microbatch order). As a readiness-first hint under a bound it means "prefer forwards".
    """
    m = plan.microbatches
    out = {}
    for r in range(plan.stages):
        stages = plan.topology.stages_of(r)
        order = [Task(s, "F", i) for s in stages for i in range(m)]
        order += [Task(s, "B", i) for s in reversed(stages) for i in range(m)]
        out[r] = _expand(plan, order)
    return out


def _declared(plan: StepPlan, durations: Durations | None) -> Durations:
    if durations is not None:
        return durations
    fw = [[1.0] * plan.microbatches for _ in range(plan.num_virtual)]
    return Durations.from_arrays(plan, fw)


def remaining_work(plan: StepPlan, durations: Durations) -> dict[Task, float]:
    """For each task, the declared work left on its microbatch's path once it starts:
    its own duration plus every later forward and every backward still to come."""
    return dict(zip(plan.graph.tasks, _remaining_work(plan, durations), strict=True))


def _remaining_work(plan: StepPlan, durations: Durations) -> list[float]:
    """``remaining_work`` indexed by task number (``plan.graph``)."""
    nv, m = plan.num_virtual, plan.microbatches
    dur, _ = durations.by_number(plan)
    cell = nv * m
    out = [0.0] * len(dur)
    split = plan.split_backward
    # Numbers of virtual stage v, microbatch mb: forward v*m + mb, backward cell + v*m + mb,
    # W 2*cell + v*m + mb: a microbatch's tasks of one kind are the slice [base + mb :: m].
    # Each sum adds in the order of the chain (backwards from stage 0 up, forwards from the
    # last stage down), so a key is the same float however it is computed.
    if split:
        out[2 * cell :] = dur[2 * cell :]  # a W task's own time: nothing follows it
    for mb in range(m):
        # Backward chain from stage 0 upwards: work from B(v) to the end = sum_{u<=v} B(u)
        # (with W(u) after each I(u)).
        total = 0.0
        if not plan.forward_only:  # a forward-only step: no backward
            back = dur[cell + mb : 2 * cell : m]
            if split:
                pairs = zip(back, dur[2 * cell + mb :: m], strict=True)  # I(v), then W(v)
                acc = list(accumulate(chain.from_iterable(pairs), initial=0.0))[2::2]
            else:
                acc = list(accumulate(back, initial=0.0))[1:]
            out[cell + mb : 2 * cell : m] = acc
            total = acc[-1]
        fwd = list(accumulate(reversed(dur[mb:cell:m]), initial=total))[1:]
        fwd.reverse()
        out[mb:cell:m] = fwd
    return out


def _work_priorities(plan: StepPlan, durations: Durations) -> list[int]:
    """Each task's priority (``_listsched.schedule_numbers``) by the key ``(-remaining work,
    microbatch, stage)``.

    Equal keys belong to the tasks of one stage and microbatch (``F`` and its ``B``, or
    ``F``, ``I`` and ``W``), which wait for each other and are never ready together: so the
    ranks may as well be all different (in number order), and a sort by work alone over
    the tasks in (microbatch, stage) order gives them.
    """
    work = _remaining_work(plan, durations)
    order = sorted(_hint_tables(plan).by_mb_stage, key=work.__getitem__, reverse=True)
    prio = [0] * len(order)
    for i, t in enumerate(order):
        prio[t] = i
    return prio


class _HintTables(NamedTuple):
    """What the list-scheduled hints need of a plan beyond its sizes (``_hint_tables``)."""

    by_mb_stage: list[int]
    """Task numbers in (microbatch, stage) order (number order within)."""
    forward_later: list[int]
    """Added to a priority, puts every ``F`` / ``W`` after every ``B`` / ``I``."""
    backward_first: list[int]
    """``backward_first``'s priorities (they depend on the plan alone)."""
    bounds: list[int]
    """``default_bounds``."""


@lru_cache(maxsize=16)
def _hint_tables(plan: StepPlan) -> _HintTables:
    """``_HintTables`` of ``plan`` (cached, as ``_listsched.plan_tables``)."""
    tasks = plan.graph.tasks
    n = len(tasks)
    keys = [(_KIND_FIRST[t.kind], t.mb, -t.stage if t.kind == "F" else t.stage) for t in tasks]
    return _HintTables(
        by_mb_stage=sorted(range(n), key=lambda t: (tasks[t].mb, tasks[t].stage)),
        forward_later=[0 if t.kind in ("B", "I") else n for t in tasks],
        backward_first=priorities(keys),
        bounds=default_bounds(plan),
    )


def breadth_first_weighted(
    plan: StepPlan,
    durations: Durations | None = None,
    *,
    nbytes: ActivationBytes | None = None,
    budgets: Sequence[int] | None = None,
) -> dict[int, list[Task]]:
    """ "BFW" read as *breadth-first weighted*: a cost-aware list schedule.

    Simulates the step on the declared durations (no jitter); whenever a rank is free it
    runs, among its ready tasks that the 1F1B admission bound admits, the one with the most
    *remaining work* (its own declared time plus all forward and backward work still ahead
    of its microbatch). Forwards therefore go first while memory allows (breadth first),
    and among microbatches the heavier ones go first (weighted). Each rank's resulting
    order is the hint.

    With ``nbytes`` (each forward's activation bytes) and ``budgets`` (each rank's byte
    budget) memory is bytes: a forward starts only when its microbatch's bytes fit the
    rank's budget (``_listsched``), so the hint never holds more bytes than the budget.
    """
    return _as_tasks(plan, _bfw_numbers(plan, durations, nbytes=nbytes, budgets=budgets))


def _bfw_numbers(
    plan: StepPlan,
    durations: Durations | None,
    *,
    nbytes: ActivationBytes | None = None,
    budgets: Sequence[int] | None = None,
) -> list[list[int]]:
    """``breadth_first_weighted`` as task numbers."""
    d = _declared(plan, durations)
    prio = _work_priorities(plan, d)
    dur, lat = d.by_number(plan)
    if nbytes is not None and budgets is not None:
        # Under a byte budget the heaviest-first rule can hold the room a backward's chain
        # needs; a second candidate runs ready backwards first (then forwards by remaining
        # work), and the plan that ends sooner on the declared durations is the hint (the
        # first on a tie).
        adm = admission(plan, budgets, nbytes)
        first, end = schedule_numbers(plan, prio, adm, dur, lat)
        prio2 = list(map(add, prio, _hint_tables(plan).forward_later))
        second, end2 = schedule_numbers(plan, prio2, adm, dur, lat)
        best, best_end = (second, end2) if end2 < end else (first, end)
        return _or_fixed(
            plan,
            d,
            best,
            best_end,
            lambda r, order: weighted_peak(order, nbytes) <= budgets[r],
        )
    adm = admission(plan, _hint_tables(plan).bounds)
    best, best_end = schedule_numbers(plan, prio, adm, dur, lat)
    bounds = _hint_tables(plan).bounds
    return _or_fixed(plan, d, best, best_end, lambda r, order: hint_peak(order) <= bounds[r])


def _or_fixed(
    plan: StepPlan,
    d: Durations,
    best: list[list[int]],
    best_end: float,
    fits: Callable[[int, list[Task]], bool],
) -> list[list[int]]:
    """``best``, or, with several chunks per rank, the fixed order the default budget is
    taken from (interleaved 1F1B) where it fits (``fits(rank, order)``) and, run strictly on
    ``d``, ends sooner: the list schedules often plan a later end than it does (the design
    note of ``_listsched``: "The fixed order as a candidate")."""
    fixed = _fixed_numbers(plan) if plan.topology.chunks > 1 else None
    if fixed is None:
        return best
    hint = _as_tasks(plan, fixed)
    if not all(fits(r, hint[r]) for r in range(plan.stages)):
        return best
    fixed_end = max(e for _, e in strict_timeline(plan, hint, d).values())
    return [list(o) for o in fixed] if fixed_end < best_end else best


@lru_cache(maxsize=16)
def _fixed_numbers(plan: StepPlan) -> list[list[int]] | None:
    """The fixed order a byte budget is taken from (``backward_forward_warmup``: 1F1B, or
    interleaved 1F1B with chunks) as task numbers; None where it does not apply (V-shape,
    a split backward, a microbatch count the interleaved order does not take)."""
    try:
        orders = backward_forward_warmup(plan)
    except HintError:
        return None
    index = plan.graph.index
    return [[index[t] for t in orders[r]] for r in range(plan.stages)]


def _as_tasks(plan: StepPlan, orders: list[list[int]]) -> dict[int, list[Task]]:
    """Each rank's order of task numbers as ``Task`` s."""
    tasks = plan.graph.tasks
    return {r: list(map(tasks.__getitem__, ids)) for r, ids in enumerate(orders)}


_KIND_FIRST = {"B": 0, "I": 0, "F": 1, "W": 2}


def backward_first(
    plan: StepPlan,
    durations: Durations | None = None,
    *,
    nbytes: ActivationBytes | None = None,
    budgets: Sequence[int] | None = None,
) -> dict[int, list[Task]]:
    """ "BF" read as *backward-first*: a cost-aware list schedule preferring backwards.

    Simulates the step on the declared durations; a free rank runs a ready backward
    (``B``/``I``) before a ready forward, a forward before a ``W``, the earlier microbatch
    first, the deeper virtual stage first, within the 1F1B admission bound. With equal costs and
    V = 1 this reproduces 1F1B exactly; with unequal costs it adapts 1F1B to them. With
    ``nbytes`` and ``budgets``, within byte budgets (see ``breadth_first_weighted``).
    """
    return _as_tasks(plan, _backward_first_numbers(plan, durations, nbytes=nbytes, budgets=budgets))


def _backward_first_numbers(
    plan: StepPlan,
    durations: Durations | None,
    *,
    nbytes: ActivationBytes | None = None,
    budgets: Sequence[int] | None = None,
) -> list[list[int]]:
    """``backward_first`` as task numbers."""
    d = _declared(plan, durations)
    dur, lat = d.by_number(plan)
    tables = _hint_tables(plan)
    if nbytes is not None and budgets is not None:
        adm = admission(plan, budgets, nbytes)
    else:
        adm = admission(plan, tables.bounds)
    return schedule_numbers(plan, tables.backward_first, adm, dur, lat)[0]


def backward_forward_warmup(
    plan: StepPlan, durations: Durations | None = None
) -> dict[int, list[Task]]:
    """ "BFW" read as *backward-forward with warm-up*: warm-up forwards, then alternate one
    backward and one forward. That is exactly 1F1B (on rank ``r``, ``P-r`` warm-up forwards
    then (B, F) pairs is the same sequence as ``P-r-1`` warm-ups then (F, B) pairs), and
    interleaved 1F1B with chunks; it resolves to those orders."""
    if plan.topology.chunks == 1:
        return one_f_one_b(plan, durations)
    return interleaved_1f1b(plan, durations)


class _NumberedHint(Protocol):
    """A list-scheduled hint generator that returns each rank's order as task numbers."""

    def __call__(
        self,
        plan: StepPlan,
        durations: Durations | None,
        *,
        nbytes: ActivationBytes | None = None,
        budgets: Sequence[int] | None = None,
    ) -> list[list[int]]: ...


LIST_SCHEDULED: dict[str, _NumberedHint] = {
    "breadth_first_weighted": _bfw_numbers,
    "backward_first": _backward_first_numbers,
}
"""The list-scheduled hints by canonical name, as generators of task numbers (the orders
``HINTS`` gives as tasks). Their hints are valid by construction (each rank's order is the
order its tasks started in a run that ended), and within their bounds or byte budgets (the
reservation rule of ``_listsched``): ``StepSchedule`` builds them without checking."""

BYTE_AWARE = frozenset(LIST_SCHEDULED)
"""The built-in hints that are built under byte budgets when the step's activation bytes
are known (``StepSchedule.build(activation_bytes=...)``); the others are fixed orders."""

HINTS: dict[str, HintFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "breadth_first": breadth_first,
    "breadth_first_weighted": breadth_first_weighted,
    "backward_first": backward_first,
    "backward_forward_warmup": backward_forward_warmup,
}
"""The built-in hint generators by canonical name."""

_ALIASES = {
    "interleaved": "interleaved_1f1b",
    "zbh1": "zb_h1",
    "bf": "breadth_first",
    "bfw": "breadth_first_weighted",
    "one_f_one_b": "1f1b",
}


def canonical_hint_name(name: str) -> str:
    """The canonical name of a hint (case-insensitive, ``-`` = ``_``, aliases resolved).

    Raises:
        HintError: Unknown hint, or ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise HintError(f"a hint name must be a string, got {describe(name)}")
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in HINTS:
        raise HintError(
            f"unknown hint {name!r}; choose one of {sorted(HINTS)} or an alias {sorted(_ALIASES)}"
        )
    return key


def make_hint(
    name: str | HintFn, plan: StepPlan, durations: Durations | None = None
) -> dict[int, list[Task]]:
    """Generate a hint by name (or with a generator function) and validate it.

    Args:
        name: A name from ``HINTS`` (or an alias), or a generator function.
        plan: The step plan.
        durations: Declared durations for cost-aware hints (uniform when None).

    Raises:
        HintError: Unknown name, a hint not applicable to the plan, an invalid order, or a
            generator that raised (chained) or returned no ``{rank: [Task, ...]}`` mapping.
        PlanError: ``plan`` is not a ``StepPlan`` or ``durations`` do not fit it.
    """
    check_type("plan", plan, StepPlan, "a StepPlan")
    check_durations(plan, durations)
    if isinstance(name, str):
        fn = HINTS[canonical_hint_name(name)]
    elif callable(name):
        fn = name
    else:
        raise HintError(
            f"a hint generator must be a hint name or a callable (plan, durations) ->"
            f" {{rank: [Task, ...]}}, got {describe(name)}"
        )
    gen = getattr(fn, "__name__", type(fn).__name__)
    try:
        hint = fn(plan, durations)
    except RRFPError:
        raise
    except Exception as e:
        raise HintError(f"hint generator {gen!r} raised {e!r}") from e
    if not isinstance(hint, Mapping):
        raise HintError(
            f"hint generator {gen!r} returned {describe(hint)}; it must return"
            " {rank: [Task, ...]} with one order per rank"
        )
    validate_hint(plan, hint)
    return {r: list(hint[r]) for r in range(plan.stages)}


def check_durations(plan: StepPlan, durations: Durations | None) -> None:
    """``durations`` None or ``Durations`` of ``plan``'s shape (virtual stages x microbatches).

    Raises:
        PlanError: Anything else.
    """
    if durations is None:
        return
    check_type("durations", durations, Durations, "Durations or None")
    want = (plan.num_virtual, plan.microbatches)
    if durations.shape != want:
        raise PlanError(
            f"durations are for {durations.shape[0]} virtual stages x {durations.shape[1]}"
            f" microbatches, the plan has {want[0]} x {want[1]}"
        )
