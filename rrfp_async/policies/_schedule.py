"""A validated step schedule: plan + hint + admission bounds, and each rank's program."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import accumulate

from .._admission import AdmissionLedger, hint_peak
from .._check import check_count, check_type, describe
from .._costs import Durations
from .._errors import HintError, PlanError
from .._memory import (
    ActivationBytes,
    MemoryBudget,
    check_budgets,
    position_weights,
    resolve_budgets,
    weighted_peak,
)
from .._tasks import StepPlan, Task
from ._bounds import default_bound, resolve_bounds
from ._hints import LIST_SCHEDULED, HintFn, canonical_hint_name, check_durations, make_hint
from ._listsched import plan_tables, strict_timeline
from ._validate import Hint, validate_hint

__all__ = ["RankProgram", "StepSchedule", "reference_orders"]


@dataclass(frozen=True, eq=False)
class RankProgram:
    """One rank's tasks as flat arrays indexed by hint position (what the stage loop runs).

    Attributes:
        rank: The pipeline rank.
        order: The hint order.
        pos: Task -> hint position.
        deps: Number of dependencies of each position.
        local_next: For each position, the positions on this rank that depend on it.
        data_local: For each position, the position on this rank that consumes its output
            tensor, or -1.
        data_remote: For each position, ``(dst_rank, consumer task)`` for an output that
            leaves the rank, or None.
        src_rank: For each position, the rank its input message comes from, or -1 when its
            input is local or absent.
        first_forward: Whether the position is a forward of the first virtual stage (its
            input is the microbatch itself).
    """

    rank: int
    order: tuple[Task, ...]
    pos: dict[Task, int]
    deps: tuple[int, ...]
    local_next: tuple[tuple[int, ...], ...]
    data_local: tuple[int, ...]
    data_remote: tuple[tuple[int, Task] | None, ...]
    src_rank: tuple[int, ...]
    first_forward: tuple[bool, ...]

    @classmethod
    def build(cls, plan: StepPlan, rank: int, order: Sequence[Task]) -> RankProgram:
        """Flatten ``order`` (validated) into arrays."""
        order = tuple(order)
        g = plan.graph  # tasks as numbers (see TaskGraph)
        index, tasks, rank_of = g.index, g.tasks, g.rank
        ids = [index[t] for t in order]
        at = dict(zip(ids, range(len(ids)), strict=True))  # number -> hint position
        pos = dict(zip(order, range(len(order)), strict=True))
        deps = []
        local_next: list[list[int]] = [[] for _ in order]
        data_local = [-1] * len(order)
        data_remote: list[tuple[int, Task] | None] = [None] * len(order)
        src_rank = [-1] * len(order)
        first = [False] * len(order)
        producers, data_producer, data_consumer = g.producers, g.data_producer, g.data_consumer
        stage0 = plan.microbatches  # the forwards of virtual stage 0 are numbers 0 .. M-1
        for i, n in enumerate(ids):
            prods = producers[n]
            deps.append(len(prods))
            for pr in prods:
                if rank_of[pr] == rank:
                    local_next[at[pr]].append(i)
            dp = data_producer[n]
            if dp >= 0 and rank_of[dp] != rank:
                src_rank[i] = rank_of[dp]
            first[i] = n < stage0
            dc = data_consumer[n]
            if dc >= 0:
                dst = rank_of[dc]
                if dst == rank:
                    data_local[i] = at[dc]
                else:
                    data_remote[i] = (dst, tasks[dc])
        return cls(
            rank=rank,
            order=order,
            pos=pos,
            deps=tuple(deps),
            local_next=tuple(tuple(x) for x in local_next),
            data_local=tuple(data_local),
            data_remote=tuple(data_remote),
            src_rank=tuple(src_rank),
            first_forward=tuple(first),
        )


@dataclass(frozen=True, eq=False)
class StepSchedule:
    """The validated schedule of a step: the plan, the hint and each rank's admission bound.

    Build it with ``StepSchedule.build``; every rank of a pipeline must use equal schedules
    (they are pure functions of the plan and the declared durations, so each process can
    compute its own).

    Attributes:
        plan: The step plan.
        hint: Every rank's hint order.
        bounds: Every rank's admission bound (most activations in flight); with a byte
            budget, the count the hint itself reaches (for reports: bytes are the bound).
        hint_name: The hint's canonical name (or the generator's name).
        activation_bytes: Each forward's activation bytes (None: memory is counted in
            activations).
        budgets: Every rank's byte budget (None without ``activation_bytes``).
        reference_bytes: Every rank's peak bytes under the fixed order the default budget
            is taken from (None without ``activation_bytes``).
    """

    plan: StepPlan
    hint: dict[int, tuple[Task, ...]]
    bounds: tuple[int, ...]
    hint_name: str = "custom"
    declared: Durations | None = field(default=None, repr=False)
    source: str | HintFn | None = field(default=None, repr=False)
    memory_factor: float | None = field(default=None, repr=False)
    max_inflight: int | tuple[int, ...] | None = field(default=None, repr=False)
    activation_bytes: ActivationBytes | None = field(default=None, repr=False)
    budgets: tuple[int, ...] | None = None
    reference_bytes: tuple[int, ...] | None = field(default=None, repr=False)
    memory_budget: MemoryBudget | None = field(default=None, repr=False)
    _weights: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _derived: dict[object, StepSchedule] = field(default_factory=dict, repr=False)
    _root: StepSchedule | None = field(default=None, repr=False)
    _programs: dict[int, RankProgram] = field(default_factory=dict, repr=False)
    _plan: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(
        cls,
        plan: StepPlan,
        hint: str | HintFn | Hint = "breadth_first_weighted",
        *,
        durations: Durations | None = None,
        max_inflight: int | Sequence[int] | None = None,
        memory_factor: float | None = None,
        activation_bytes: ActivationBytes | None = None,
        memory_budget: MemoryBudget | None = None,
    ) -> StepSchedule:
        """Generate (or take) a hint, resolve the bounds and validate everything.

        Args:
            plan: The step plan.
            hint: A hint name, a generator ``(plan, durations) -> {rank: [Task]}``, or a
                ready-made ``{rank: [Task]}``.
            durations: Declared durations for cost-aware hints.
            max_inflight: Admission bound, one for all ranks or one per rank (counts
                activations; with ``activation_bytes``, the bound is then a count too).
            memory_factor: Scale of the default admission bound (a count).
            activation_bytes: Each forward's activation bytes on its rank: memory is then
                bytes, each rank's budget by default what the fixed order holds on these
                bytes (1F1B's, or the hint's own when the hint is a fixed order), and the
                cost-aware hints are built within it (see ``rrfp_async._memory``).
            memory_budget: With ``activation_bytes``: a float scales the default byte
                budget; an int (or ``"24GiB"``) is bytes; or one such value per rank.

        Raises:
            HintError: An invalid hint or bound, or a ``hint`` that is none of the three.
            PlanError: ``plan`` is not a ``StepPlan``, ``durations`` are not ``Durations``
                of the plan's shape, ``memory_budget`` without ``activation_bytes`` or
                with a count bound, or a byte budget the hint cannot run in.
        """
        check_type("plan", plan, StepPlan, "a StepPlan")
        check_durations(plan, durations)
        if memory_budget is not None and activation_bytes is None:
            raise PlanError(
                "memory_budget is a byte budget: it needs each forward's activation bytes"
                " (activation_bytes=ActivationBytes(...)); to bound the count of activations"
                " instead, use max_inflight or memory_factor"
            )
        if activation_bytes is not None:
            check_type("activation_bytes", activation_bytes, ActivationBytes, "ActivationBytes")
            activation_bytes.check_plan(plan)
            if max_inflight is None and memory_factor is None:
                return cls._build_bytes(plan, hint, durations, activation_bytes, memory_budget)
            if memory_budget is not None:
                raise PlanError(
                    "give memory_budget (bytes) or max_inflight / memory_factor (a count of"
                    " activations), not both"
                )
        name, orders = _resolve_hint(plan, hint, durations)
        bounds = resolve_bounds(
            plan, orders, max_inflight=max_inflight, memory_factor=memory_factor
        )
        return cls(
            plan=plan,
            hint={r: tuple(orders[r]) for r in range(plan.stages)},
            bounds=tuple(bounds),
            hint_name=name,
            declared=durations,
            source=hint if isinstance(hint, str) or callable(hint) else None,
            memory_factor=memory_factor,
            max_inflight=(
                max_inflight
                if max_inflight is None or isinstance(max_inflight, int)
                else tuple(max_inflight)
            ),
            activation_bytes=activation_bytes,
        )

    @classmethod
    def _build_bytes(
        cls,
        plan: StepPlan,
        hint: str | HintFn | Hint,
        durations: Durations | None,
        nbytes: ActivationBytes,
        memory_budget: MemoryBudget | None,
    ) -> StepSchedule:
        """``build`` with memory in bytes (see ``rrfp_async._memory``'s design note)."""
        weights = _signed_bytes(plan, nbytes)
        ref = [_peak(ids, weights) for ids in _reference_numbers(plan)]
        name = canonical_hint_name(hint) if isinstance(hint, str) else None
        if name is not None and name in LIST_SCHEDULED:
            budgets = resolve_budgets(plan, ref, memory_budget)
            ids = LIST_SCHEDULED[name](plan, durations, nbytes=nbytes, budgets=budgets)
            # A list schedule is a valid hint within the budgets by construction
            # (``_listsched``): nothing to check.
            delta = plan_tables(plan).delta
            tasks = plan.graph.tasks
            orders: Hint = {r: tuple(map(tasks.__getitem__, x)) for r, x in enumerate(ids)}
            peaks = [_peak(x, delta) for x in ids]
        else:
            name, orders = _resolve_hint(plan, hint, durations)
            # A fixed order: the default budget is what it holds itself (or 1F1B, if more).
            ref = [max(a, weighted_peak(orders[r], nbytes)) for r, a in enumerate(ref)]
            budgets = resolve_budgets(plan, ref, memory_budget)
            check_budgets(plan, orders, nbytes, budgets, ref, memory_budget)
            peaks = [hint_peak(orders[r]) for r in range(plan.stages)]
        counts = [max(default_bound(plan, r), peaks[r]) for r in range(plan.stages)]
        return cls(
            plan=plan,
            hint={r: tuple(orders[r]) for r in range(plan.stages)},
            bounds=tuple(counts),
            hint_name=name,
            declared=durations,
            source=hint if isinstance(hint, str) or callable(hint) else None,
            activation_bytes=nbytes,
            budgets=tuple(budgets),
            reference_bytes=tuple(ref),
            memory_budget=memory_budget,
        )

    def peak_bytes(self, rank: int) -> int | None:
        """The most bytes ``rank``'s hint holds when run strictly (None without bytes)."""
        if self.activation_bytes is None:
            return None
        return weighted_peak(self.hint[rank], self.activation_bytes)

    def ledger(self, rank: int) -> AdmissionLedger:
        """A fresh admission ledger for a step of ``rank``: in bytes against its budget
        when the schedule has one, else counting activations against its bound."""
        prog = self.program(rank)
        weights = self.position_bytes(rank)
        if weights is None or self.budgets is None:
            return AdmissionLedger(prog.order, self.bounds[rank], prog.pos)
        return AdmissionLedger(prog.order, self.budgets[rank], prog.pos, weights)

    def reference_of(self, rank: int) -> int | None:
        """``reference_bytes[rank]`` (None without a byte budget)."""
        return None if self.reference_bytes is None else self.reference_bytes[rank]

    def position_bytes(self, rank: int) -> list[int] | None:
        """Each hint position's change of ``rank``'s in-flight bytes (a forward's bytes, the
        freeing backward's negated), or None when memory is counted in activations."""
        if self.budgets is None or self.activation_bytes is None:
            return None
        got = self._weights.get(rank)
        if got is None:
            got = position_weights(self.hint[rank], self.activation_bytes)
            self._weights[rank] = got
        return got

    def with_durations(
        self, durations: Durations | None, activation_bytes: ActivationBytes | None = None
    ) -> StepSchedule:
        """This schedule for a step with other declared durations (this step's sizes).

        A generated hint is generated again from ``durations`` (a cost-aware hint then
        follows the step's microbatches); the admission bounds stay as they are. A
        ready-made hint is kept. Every rank computes the same result from the same sizes,
        so no rank has to send it (what it costs:
        BENCHMARKS.md#notes-from-the-runtimes-docstrings).

        With a byte budget, ``activation_bytes`` are this step's bytes (default: this
        schedule's): the budget is derived again from them the way this schedule's was
        (``memory_budget``), and the hint is built within it.

        Raises:
            HintError: The regenerated hint does not fit the bounds.
            PlanError: ``activation_bytes`` for a schedule without a byte budget, or a byte
                budget the hint cannot run in.
        """
        if self.budgets is not None or activation_bytes is not None:
            if self.budgets is None:
                raise PlanError(
                    "activation_bytes for a schedule counted in activations: build it with"
                    " StepSchedule.build(..., activation_bytes=) to bound bytes"
                )
            nbytes = activation_bytes if activation_bytes is not None else self.activation_bytes
            src_b = self.hint if self.source is None else self.source
            out_b = StepSchedule.build(
                self.plan,
                src_b,
                durations=durations,
                activation_bytes=nbytes,
                memory_budget=self.memory_budget,
            )
            return replace(out_b, source=self.source, _derived={})
        if durations is None:
            return self
        src = self.hint if self.source is None else self.source
        out = StepSchedule.build(
            self.plan, src, durations=durations, max_inflight=list(self.bounds)
        )
        # Steps of another size derive their bounds the way this schedule was built.
        return replace(
            out,
            memory_factor=self.memory_factor,
            max_inflight=self.max_inflight,
            source=self.source,
            _derived={},
        )

    def for_microbatches(self, n: int) -> StepSchedule:
        """This schedule for a step of ``n`` microbatches (a last partial batch, a larger
        step): the same hint source and admission arguments on the same topology, built once
        and cached. A cost-aware hint gets no durations here (it is then its cost-blind
        order); give ``run_step`` a ``schedule=`` built with this step's durations instead.

        Raises:
            PlanError: ``n`` is not an integer >= 1, the hint was given as a ready-made
                ``{rank: [Task]}`` mapping (it cannot be regenerated for another size), or
                the schedule has a byte budget on microbatches of different sizes (the new
                step's bytes are unknown here).
        """
        n = check_count("microbatches", n)
        if n == self.plan.microbatches:
            return self
        root = self._root
        if root is not None:  # derived ones derive from their root (one cache, no chains)
            return root.for_microbatches(n)
        got = self._derived.get(n)
        if got is None:
            if self.source is None:
                raise PlanError(
                    f"a step of {n} microbatches needs a schedule for {n}, and this one"
                    f" ({self.plan.microbatches} microbatches) has a ready-made hint that"
                    " cannot be regenerated: build the schedule from a hint name or generator,"
                    " or pass run_step(..., schedule=...) for that step"
                )
            nbytes = None
            if self.budgets is not None and self.activation_bytes is not None:
                rows = self.activation_bytes.rows()
                if any(len(set(row)) > 1 for row in rows):
                    raise PlanError(
                        f"a step of {n} microbatches needs its own activation bytes (this"
                        f" schedule's are for {self.plan.microbatches} microbatches of"
                        " different sizes): pass run_step(..., schedule="
                        "schedule.for_microbatches(n) built with StepSchedule.build(...,"
                        " activation_bytes=) for that step)"
                    )
                nbytes = ActivationBytes([[row[0]] * n for row in rows])
            if nbytes is not None:
                got = StepSchedule.build(
                    replace(self.plan, microbatches=n),
                    self.source,
                    activation_bytes=nbytes,
                    memory_budget=self.memory_budget,
                )
                got = replace(got, hint_name=self.hint_name, _root=self)
                self._derived[n] = got
                return got
            got = StepSchedule.build(
                replace(self.plan, microbatches=n),
                self.source,
                memory_factor=self.memory_factor,
                max_inflight=(
                    list(self.max_inflight)
                    if isinstance(self.max_inflight, tuple)
                    else self.max_inflight
                ),
            )
            got = replace(got, hint_name=self.hint_name, _root=self)
            self._derived[n] = got
        return got

    def forward_only(self) -> StepSchedule:
        """The forward-only (evaluation) schedule of this plan: ``F`` tasks only, each rank
        ordered by microbatch, then stage; no admission limit (nothing is stashed for a
        backward). Built once and cached."""
        if self.plan.forward_only:
            return self
        got = self._derived.get("forward")
        if got is None:
            plan = replace(
                self.plan, forward_only=True, split_backward=False, ordered_weights=False
            )
            hint = {
                r: sorted(plan.tasks_of(r), key=lambda t: (t.mb, t.stage))
                for r in range(plan.stages)
            }
            got = replace(StepSchedule.build(plan, hint), hint_name="forward_only")
            self._derived["forward"] = got
        return got

    def program(self, rank: int) -> RankProgram:
        """The flattened program of ``rank`` (built once, then cached)."""
        prog = self._programs.get(rank)
        if prog is None:
            prog = RankProgram.build(self.plan, rank, self.hint[rank])
            self._programs[rank] = prog
        return prog

    def planned(self, rank: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """The plan of ``rank``: for each hint position, the planned start (seconds after
        the step starts) and the idle gap the plan foresees right before the task (its
        planned start minus the planned end of the task before it), from the declared
        durations with every rank running its hint strictly. None without durations."""
        if self.declared is None:
            return None
        out = self._plan.get(rank)
        if out is None:
            times = strict_timeline(self.plan, self.hint, self.declared)
            for r in range(self.plan.stages):
                prev = 0.0
                starts, gaps = [], []
                for t in self.hint[r]:
                    start, end = times[t]
                    starts.append(start)
                    gaps.append(max(0.0, start - prev))
                    prev = end
                self._plan[r] = (tuple(starts), tuple(gaps))
            out = self._plan[rank]
        return out


def _resolve_hint(
    plan: StepPlan, hint: str | HintFn | Hint, durations: Durations | None
) -> tuple[str, Hint]:
    """``hint``'s canonical name and its validated orders (a name, a generator or a
    ready-made mapping).

    Raises:
        HintError: An invalid hint, or a ``hint`` that is none of the three.
    """
    if isinstance(hint, str):
        name = canonical_hint_name(hint)
        gen = LIST_SCHEDULED.get(name)
        if gen is not None:  # valid by construction: no need to validate it
            tasks = plan.graph.tasks
            ids = gen(plan, durations)
            return name, {r: list(map(tasks.__getitem__, x)) for r, x in enumerate(ids)}
        return name, make_hint(name, plan, durations)
    if callable(hint):
        return getattr(hint, "__name__", "custom"), make_hint(hint, plan, durations)
    if isinstance(hint, Mapping):
        validate_hint(plan, hint)
        return "custom", hint
    raise HintError(
        "hint must be a hint name, a generator (plan, durations) -> {rank: [Task, ...]}"
        f" or a {{rank: [Task, ...]}} mapping, got {describe(hint)}"
    )


def reference_orders(plan: StepPlan) -> dict[int, list[Task]]:
    """The fixed order a byte budget is taken from by default: 1F1B, or interleaved 1F1B
    with several chunks; where those do not apply (V-shape placement, a split backward,
    a microbatch count the interleaved order does not take) the backward-first list
    schedule on equal costs, which is 1F1B's rule (a ready backward first, within 1F1B's
    count) on any plan."""
    tasks = plan.graph.tasks
    return {r: list(map(tasks.__getitem__, ids)) for r, ids in enumerate(_reference_numbers(plan))}


@lru_cache(maxsize=16)
def _reference_numbers(plan: StepPlan) -> tuple[tuple[int, ...], ...]:
    """``reference_orders`` as task numbers, built once per plan (it depends on nothing
    else; every step of a byte budget takes its budget from it)."""
    try:
        orders = make_hint("backward_forward_warmup", plan)
    except HintError:
        orders = make_hint("backward_first", plan)
    index = plan.graph.index
    return tuple(tuple(map(index.__getitem__, orders[r])) for r in range(plan.stages))


def _signed_bytes(plan: StepPlan, nbytes: ActivationBytes) -> list[int]:
    """What each task number does to its rank's bytes in flight: a forward adds its bytes,
    the backward that frees them (``B`` / ``I``) subtracts them, a ``W`` nothing: the
    weights of ``position_weights`` by number."""
    w = [x for row in nbytes.rows() for x in row]
    g = plan.graph
    if not g.num_backward:
        return w
    return w + [-x for x in w] + [0] * (len(g.tasks) - 2 * len(w))


def _peak(ids: Sequence[int], weights: Sequence[int]) -> int:
    """The largest running sum of ``weights`` over ``ids`` (0 at the start): what a rank
    whose order is ``ids`` holds at most, run strictly (``hint_peak``, ``weighted_peak``)."""
    return max(accumulate(map(weights.__getitem__, ids), initial=0))
