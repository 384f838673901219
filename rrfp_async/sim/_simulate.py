"""``simulate``: one pipeline step as a discrete-event simulation of the real runtime.

The simulation runs the very same ``StageLoop``, policy and admission code as a real run,
with a ``CostModelExecutor`` and an in-process channel, on a ``VirtualEventLoop``: the
clock jumps from event to event.

Speed. A step costs a few tens of microseconds per task, close to linear in the tasks
(``rrfp-async bench simulator`` prints the curve). What made it so, in the order a profile
showed them: the stage put its stall reason into words on every wait (now only for an
observer); the cost-aware hint's list scheduler scanned each rank's ready list per
dispatch and every rank per instant, and the hint check swept all ranks until nothing
moved (now heaps and a worklist, held to the originals by oracle tests); the virtual loop
polled its selector every iteration (now skipped in a closed simulation); the garbage
collector's passes over the step's growing heap (now paused while a step runs); then
the planning code hashing ``Task`` tuples (now task numbers indexing lists:
``StepPlan.graph``) and a dict insert per task for ``ReadyView.durations`` (now a view).

Guards. Nothing outside the loop can wake a simulation (it has no real I/O), so the loop
runs with ``stall_when_idle``: the moment nothing is scheduled while a stage still waits
(a policy awaiting an event nobody sets), the step is a ``DeadlockError`` that names the
policy and what it awaits. A policy that keeps the clock moving without ever deciding (a
``sleep`` loop) meets ``time_limit`` (virtual seconds), one that spins without moving it
(``sleep(0)``) meets ``wall_limit`` (real seconds): both a ``StepTimeoutError``. Sizes are
capped before anything is built (``MAX_CELLS``, ``MAX_CELLS_PER_RANK``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import Any, TypeVar

from .._check import check_bool, check_int, check_real, check_type, describe
from .._costs import CostModel, Durations, Microbatch, check_jitter
from .._errors import PlanError
from .._memory import ActivationBytes, MemoryBudget
from .._tasks import Placement, StepPlan, Topology
from .._workloads import Workload, make_workload
from ..loop import (
    UNSET,
    CostModelExecutor,
    ExecutedTask,
    LocalPipeline,
    StageObserver,
    TPOptions,
    resolve_tp_options,
)
from ..observability import MultiObserver, TraceRecorder
from ..policies import (
    Hint,
    HintFn,
    Policy,
    StepSchedule,
    canonical_hint_name,
    check_durations,
)
from ._guard import run_virtual
from ._result import SimResult, held_peak, reference_peaks
from ._sim_tp import TPDecision, attach, resolve_tp, tp_executors

__all__ = [
    "DEFAULT_WALL_LIMIT",
    "MAX_CELLS",
    "MAX_CELLS_PER_RANK",
    "SimResult",
    "compare",
    "lower_bound",
    "simulate",
]

MAX_CELLS = 2**17
"""Most (virtual stage, microbatch) pairs of a simulated step: ``stages x chunks x
microbatches`` (each pair is 2 or 3 tasks): 128 x 1024, a 1024-GPU what-if at TP 8. See
BENCHMARKS.md (simulator section) for what a step of each size costs."""

MAX_CELLS_PER_RANK = 2**12
"""Most (chunk, microbatch) pairs per rank: ``chunks x microbatches``. The cost-aware hints
and the admission scan grow faster than linearly in a rank's task count (what a larger rank
costs: BENCHMARKS.md#the-per-rank-limit)."""

DEFAULT_WALL_LIMIT = 300.0
"""Default ``wall_limit`` of ``simulate``: real seconds a simulated step may run."""

TIME_LIMIT_FLOOR = 60.0
TIME_LIMIT_FACTOR = 100.0
"""Default ``time_limit`` of ``simulate``: ``max(TIME_LIMIT_FLOOR, TIME_LIMIT_FACTOR x the
step's serial time)`` virtual seconds, the serial time being every task's realized duration
and every message's latency one after the other (no schedule that progresses needs more)."""


def _topo_order(plan: StepPlan) -> list[int]:
    """Every task's number (``plan.graph``) in an order where producers precede consumers."""
    nv, m = plan.num_virtual, plan.microbatches
    cell = nv * m
    out = list(range(cell))  # the forwards, stage by stage
    if not plan.forward_only:
        for v in reversed(range(nv)):  # the backwards, last stage first
            out.extend(range(cell + v * m, cell + (v + 1) * m))
    if plan.split_backward:
        out.extend(range(2 * cell, 3 * cell))  # the W tasks after all I tasks
    return out


def lower_bound(plan: StepPlan, durations: Durations) -> float:
    """A lower bound on the step's makespan under ``durations`` (any schedule, any memory).

    The larger of (a) the critical path through the dependency graph, messages' latencies
    included, and (b) for every rank, the earliest any of its tasks can start, plus all of
    its work, plus the least work that must still follow its last task.

    Raises:
        PlanError: ``plan`` is not a ``StepPlan`` or ``durations`` not ``Durations`` of its
            shape.
    """
    check_type("plan", plan, StepPlan, "a StepPlan")
    check_type("durations", durations, Durations, "Durations")
    check_durations(plan, durations)
    g = plan.graph  # tasks as numbers: lists indexed by them (see TaskGraph)
    order = _topo_order(plan)
    rank_of, producers, consumers = g.rank, g.producers, g.consumers
    dur, lat = durations.by_number(plan)
    n = len(dur)
    head = [0.0] * n
    for t in order:
        h = 0.0
        r = rank_of[t]
        for pr in producers[t]:
            x = head[pr] + dur[pr] + (lat[t] if lat is not None and rank_of[pr] != r else 0.0)
            if x > h:
                h = x
        head[t] = h
    tail = [0.0] * n
    for t in reversed(order):
        tl = 0.0
        r = rank_of[t]
        for c in consumers[t]:
            x = (lat[c] if lat is not None and rank_of[c] != r else 0.0) + dur[c] + tail[c]
            if x > tl:
                tl = x
        tail[t] = tl
    critical = max(head[t] + dur[t] + tail[t] for t in order)
    best = critical
    for ids in g.by_rank:
        busy = sum(dur[t] for t in ids)
        best = max(best, min(head[t] for t in ids) + busy + min(tail[t] for t in ids))
    return best


def _check_microbatches(microbatches: Any) -> tuple[int, list[Microbatch] | None]:
    """M and the given microbatches (None for a count)."""
    if isinstance(microbatches, bool | str | bytes) or not isinstance(
        microbatches, Integral | Sequence
    ):
        raise PlanError(
            "microbatches must be an int >= 1 or a non-empty sequence of Microbatch, got"
            f" {describe(microbatches)}"
        )
    if isinstance(microbatches, Integral):
        return check_int("microbatches", microbatches, minimum=1), None
    mbs = list(microbatches)
    if not mbs:
        raise PlanError("microbatches must be an int >= 1 or a non-empty sequence of Microbatch")
    for i, mb in enumerate(mbs):
        check_type(f"microbatches[{i}]", mb, Microbatch, "a Microbatch")
    return len(mbs), mbs


def _check_size(topo: Topology, m: int) -> None:
    p, v = topo.stages, topo.chunks
    cells = p * v * m
    if cells > MAX_CELLS:
        raise PlanError(
            f"simulate: stages x chunks x microbatches = {p} x {v} x {m} = {cells} exceeds the"
            f" limit of {MAX_CELLS} (MAX_CELLS); simulate a smaller step"
        )
    if v * m > MAX_CELLS_PER_RANK:
        raise PlanError(
            f"simulate: chunks x microbatches = {v} x {m} = {v * m} per rank exceeds the limit"
            f" of {MAX_CELLS_PER_RANK} (MAX_CELLS_PER_RANK); simulate a smaller step"
        )


def _serial_time(plan: StepPlan, d: Durations) -> float:
    return math.fsum(d.of(t) + d.latency(t) for t in plan.all_tasks())


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a step is simulated.

    A simulated step allocates a few objects per task (handles, futures, records) and
    keeps many of them until it ends; the collector's passes over that growing heap cost
    a fifth of a 64 x 512 step and grew faster than the step. Almost none of it is
    cyclic (reference counting frees it), so nothing piles up meanwhile. The collector
    is re-enabled afterwards only if it was on (another thread that paused it too, or a
    caller that turned it off, keeps its state).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_F = TypeVar("_F", bound=Callable[..., Any])


def _pausing_collector(fn: _F) -> _F:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _collector_paused():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class _Default:
    """A keyword of ``simulate`` that a schedule replaces, left out: its default, shown as
    the default's value (so that giving it with ``schedule`` is told apart)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_CHUNKS: Any = _Default(1)
_HINT: Any = _Default("breadth_first_weighted")
_ORDERED_WEIGHTS: Any = _Default(False)
_PLACEMENT: Any = _Default("interleaved")


def _given(value: object) -> bool:
    """Whether a keyword a schedule replaces was given (None: left out)."""
    return value is not None and not isinstance(value, _Default)


def _default(value: Any) -> Any:
    return value.value if isinstance(value, _Default) else value


def _from_schedule(schedule: object, stages: int | None, **replaced: object) -> StepSchedule:
    """``schedule``, checked, and refused beside the keywords it replaces.

    Raises:
        PlanError: ``schedule`` is no ``StepSchedule``, or a keyword it replaces is given
            too (``stages`` only where it differs; the message names them).
    """
    check_type("schedule", schedule, StepSchedule, "a StepSchedule (StepSchedule.build)")
    assert isinstance(schedule, StepSchedule)
    clash = [k for k, v in replaced.items() if _given(v)]
    if stages is not None and stages != schedule.plan.stages:
        clash.insert(0, "stages")
    if clash:
        names = ", ".join(f"{k}=" for k in clash)
        raise PlanError(
            f"simulate: schedule= gives the plan, the hint and the admission bounds; {names}"
            " given too: leave them out (they are the schedule's), or leave out schedule="
        )
    return schedule


def _workload_size(workload: object, m: int | None, given: list[Microbatch] | None) -> int:
    """M of a step whose microbatches come from a ``Workload`` object.

    Raises:
        PlanError: ``microbatches`` is a sequence too, or a count that differs.
    """
    assert isinstance(workload, Workload)
    n = len(workload.microbatches)
    if given is not None:
        raise PlanError(
            "simulate: give the microbatches in the Workload or in microbatches=, not both"
        )
    if m is not None and m != n:
        raise PlanError(
            f"simulate: microbatches={m} but the workload {workload.name!r} has {n} microbatches"
        )
    return n


@_pausing_collector
def simulate(
    *,
    stages: int | None = None,
    microbatches: int | Sequence[Microbatch] | None = None,
    chunks: int = _CHUNKS,
    hint: str | HintFn | Hint = _HINT,
    policy: str | Policy = "readiness_first",
    max_inflight: int | Sequence[int] | None = None,
    memory_factor: float | None = None,
    forward: Sequence[Sequence[float]] | None = None,
    backward: Sequence[Sequence[float]] | None = None,
    workload: str | Workload | None = None,
    jitter: float = 0.0,
    seed: int | None = 0,
    split_backward: bool | None = None,
    ordered_weights: bool = _ORDERED_WEIGHTS,
    placement: Placement = _PLACEMENT,
    cost_model: CostModel | None = None,
    latency: float = 0.0,
    latency_jitter: float = 0.0,
    straggler_prob: float = 0.0,
    observer: StageObserver | None = None,
    record: bool = False,
    time_limit: float | None = None,
    wall_limit: float | None = DEFAULT_WALL_LIMIT,
    tp: int = 1,
    tp_latency: float | None = None,
    tp_check: float | None = None,
    tp_deduce: bool = UNSET,
    tp_options: TPOptions | None = None,
    schedule: StepSchedule | None = None,
    memory_budget: MemoryBudget | None = None,
    activation_bytes: ActivationBytes | None = None,
) -> SimResult:
    """Simulate one pipeline step on a virtual clock with the real stage-loop code.

    The step is given by keywords (``stages``, ``microbatches``, ``chunks``, ``hint``, ...)
    or by a ``schedule`` (``StepSchedule.build(plan, hint, ...)``) that carries the plan,
    the hint and the admission bounds; the sizes and costs come from ``workload`` (a name
    or a ``Workload`` object), ``forward`` / ``backward`` or ``cost_model`` either way.

    Args:
        stages: Pipeline ranks P (required without ``schedule``; with it, the schedule's).
        microbatches: Number of microbatches M, or the microbatches themselves (with sizes).
            Without it: the schedule's or the ``Workload`` object's count; required
            otherwise.
        chunks: Model chunks per rank V.
        hint: Hint name (see ``rrfp_async.policies.HINTS``), a generator ``(plan,
            durations) -> {rank: [Task]}``, or a ready-made ``{rank: [Task]}``.
        policy: Policy name or coroutine.
        max_inflight: Admission bound (one for all ranks, or per rank).
        memory_factor: Scale of the default admission bound.
        forward: Explicit forward seconds ``[virtual_stage][microbatch]`` (replay).
        backward: Explicit backward seconds (default 2x forward).
        workload: ``"uniform"``, ``"text"`` or ``"multimodal"`` (default uniform), or a
            ``Workload`` object (its microbatches and cost model, e.g. ``make_workload``'s).
        jitter: Sigma of the mean-one lognormal compute noise of the realized durations,
            in ``[0, MAX_JITTER]`` (3; see ``rrfp_async._costs.MAX_JITTER`` for why).
        seed: Seed of the workload sizes and of the noise. None draws a fresh seed, which
            the result reports (``SimResult.seed``) so that the step can be repeated.
        split_backward: Split backwards into I/W (default: only for the ``zb_h1`` hint).
        ordered_weights: Run each stage's W tasks in microbatch order (needs a split).
        placement: ``"interleaved"`` or ``"vshape"``.
        cost_model: Override the workload's cost model (sizes still come from ``workload``).
        latency: Mean one-way message latency, seconds.
        latency_jitter: Sigma of the lognormal noise of each message's latency (like
            ``jitter``, at most ``MAX_JITTER``).
        straggler_prob: Probability that a task runs 3x longer.
        observer: Optional observer of every stage transition (logging, tracing).
        record: Keep a trace recording in ``SimResult.trace`` (spans, messages, decisions).
        time_limit: Virtual seconds the step may take before it fails (a policy that keeps
            sleeping instead of deciding). None: ``max(60, 100 x the step's serial time)``,
            the serial time being every realized task and message latency one after the
            other; ``math.inf``: no limit.
        wall_limit: Real seconds the simulated step may run (a policy that spins without
            letting the clock move); default ``DEFAULT_WALL_LIMIT`` (300); None: no limit.
        tp: TP degree of every stage. Only its coordination is simulated (give the
            compute per TP rank in the durations or cost model): each stage is the leader
            of a TP group whose followers start a task only ``tp_latency`` after the
            leader's decision (the look-ahead included), and the step ends ``tp_check``
            after the last task (see ``rrfp_async.sim._sim_tp``). 1 (default): none.
        tp_latency: Seconds a TP decision takes to reach the followers (None: the fitted
            model ``TP_DECISION_LATENCY(tp)``; 0: free, the step is exactly the one without
            TP).
        tp_check: Seconds of end-of-step TP coordination (None: ``TP_STEP_CHECK(tp)``).
        tp_deduce: The followers deduce the decisions they can and start those tasks
            without the latency (``StageLoop(deduce_tp=)``: under a policy that chooses the
            ready head, the next hinted task when its inputs are all local); False: every
            task waits for its decision. ``TPOptions.deduce``, as a flat keyword.
        tp_options: The TP options as one value (``TPOptions``; give it or ``tp_deduce``,
            not both). The simulation uses ``deduce`` only: its stages are TP leaders of a
            simulated group, which always coordinate, compare no sequences and have no
            channel to fold a check into (``tp_check`` models that check's time).
        schedule: The step's schedule (``StepSchedule.build``): its plan (stages, M,
            chunks and placement, split backward, ordered weights), hint and admission
            bounds. With it, ``chunks``, ``hint``, ``max_inflight``, ``memory_factor``,
            ``split_backward``, ``ordered_weights``, ``placement`` and a different
            ``stages`` are refused (a ``PlanError`` naming them). Its hint runs as built
            (planned with the ``durations`` given to ``StepSchedule.build``, not with the
            workload's).
        memory_budget: Each rank's activation byte budget: a float scales the default
            (what strict 1F1B holds on these microbatches, or the hint itself when it is a
            fixed order), an int or ``"24GiB"`` is bytes (see ``rrfp_async._memory``).
            Memory is bytes by default; ``max_inflight`` / ``memory_factor`` bound the
            count of activations instead.
        activation_bytes: Each forward's bytes (``ActivationBytes``); default: each
            microbatch's tokens (image tokens included) on every virtual stage, i.e. one
            unit per token (uniform microbatches: the count bound).

    Sizes: at most ``MAX_CELLS`` (65536) pairs ``stages x chunks x microbatches`` and
    ``MAX_CELLS_PER_RANK`` (4096) pairs ``chunks x microbatches``.

    Returns:
        The ``SimResult``. Hints are computed from the *declared* durations, the run meets
        the *realized* ones (declared x noise), identical for every policy given a seed.

    Raises:
        PlanError: Invalid sizes, durations, workload, cost model or flag, a step over the
            size limits, ``schedule`` beside a keyword it replaces, or ``tp_options``
            beside ``tp_deduce``.
        HintError: Invalid hint or bound.
        PolicyError: The policy is no coroutine, raised (``CancelledError`` included) or
            returned a task that is not ready.
        DeadlockError: No rank can progress any more: every stage waits and nothing is
            scheduled (the message names each rank's policy and what it awaits).
        StepTimeoutError: The step ran past ``time_limit`` or ``wall_limit`` (named).
    """
    t_wall = time.perf_counter()
    tp, tp_latency, tp_check = resolve_tp(tp, tp_latency, tp_check)
    deduce = resolve_tp_options(
        tp_options, "simulate", {"tp_deduce": "deduce"}, {"tp_deduce": tp_deduce}, arg="tp_options"
    ).deduce
    if schedule is not None:
        schedule = _from_schedule(
            schedule,
            stages,
            chunks=chunks,
            hint=hint,
            max_inflight=max_inflight,
            memory_factor=memory_factor,
            split_backward=split_backward,
            ordered_weights=ordered_weights,
            placement=placement,
        )
    elif stages is None:
        raise PlanError("simulate: give stages= (and microbatches=), or schedule=")
    m_given, given = (None, None) if microbatches is None else _check_microbatches(microbatches)
    if isinstance(workload, Workload):
        m_given = _workload_size(workload, m_given, None if given is None else given)
    elif workload is not None and not isinstance(workload, str):
        raise PlanError(
            f"workload must be a workload name or None, got {describe(workload)}; or a"
            " Workload object (rrfp_async.sim.Workload, e.g. make_workload's)"
        )
    if schedule is not None:
        plan = schedule.plan
        if m_given is not None and m_given != plan.microbatches:
            raise PlanError(
                f"simulate: {m_given} microbatches but the schedule's plan has {plan.microbatches}"
            )
        m = plan.microbatches
        _check_size(plan.topology, m)
    elif m_given is None:
        raise PlanError("simulate: give microbatches= (or a schedule= or a Workload object)")
    else:
        m = m_given
        if split_backward is not None:
            check_bool("split_backward", split_backward)
        ordered_weights = _default(ordered_weights)
        hint = _default(hint)
        check_bool("ordered_weights", ordered_weights)
        if split_backward is None:
            split_backward = isinstance(hint, str) and canonical_hint_name(hint) == "zb_h1"
        assert stages is not None  # (refused above)
        topo = Topology(stages=stages, chunks=_default(chunks), placement=_default(placement))
        _check_size(topo, m)  # before the plan is built
        plan = StepPlan(
            topology=topo,
            microbatches=m,
            split_backward=split_backward or ordered_weights,
            ordered_weights=ordered_weights,
        )
    check_bool("record", record)
    jitter = check_jitter("jitter", jitter)
    latency_jitter = check_jitter("latency_jitter", latency_jitter)
    latency = check_real("latency", latency, minimum=0.0)
    straggler_prob = check_real("straggler_prob", straggler_prob, minimum=0.0, maximum=1.0)
    seed = secrets.randbits(32) if seed is None else check_int("seed", seed)
    if time_limit is not None:
        time_limit = check_real(
            "time_limit", time_limit, minimum=0.0, strict_minimum=True, allow_inf=True
        )
    if wall_limit is not None:
        wall_limit = check_real(
            "wall_limit", wall_limit, minimum=0.0, strict_minimum=True, allow_inf=True
        )
        if math.isinf(wall_limit):
            wall_limit = None
    if cost_model is not None:
        check_type("cost_model", cost_model, CostModel, "a CostModel or None")
    mbs: Sequence[Microbatch]
    if forward is not None:
        if workload is not None or cost_model is not None:
            raise PlanError("give explicit forward durations or a workload / cost model, not both")
        base = Durations.from_arrays(plan, forward, backward)
        mbs = [Microbatch(index=i) for i in range(m)]
        noise = CostModel(
            jitter=jitter,
            straggler_prob=straggler_prob,
            latency=latency,
            latency_jitter=latency_jitter,
        )
    else:
        if backward is not None:
            raise PlanError("backward durations need forward durations too")
        wl = (
            workload
            if isinstance(workload, Workload)
            else make_workload(workload or "uniform", m, virtual_stages=plan.num_virtual, seed=seed)
        )
        mbs = wl.microbatches if given is None else given
        cost = cost_model or wl.cost
        base = cost.declared(plan, mbs)
        noise = CostModel(
            jitter=jitter or cost.jitter,
            straggler_prob=straggler_prob or cost.straggler_prob,
            straggler_factor=cost.straggler_factor,
            latency=latency or cost.latency,
            latency_jitter=latency_jitter or cost.latency_jitter,
        )
    # Hints plan with the declared durations (mean latency, no noise); the run meets the
    # realized ones, drawn per task from the seed, the same for every policy.
    declared = base.perturbed(seed=seed, latency=noise.latency)
    realized = base.perturbed(
        seed=seed,
        jitter=noise.jitter,
        straggler_prob=noise.straggler_prob,
        straggler_factor=noise.straggler_factor,
        latency=noise.latency,
        latency_jitter=noise.latency_jitter,
    )
    if time_limit is None:
        serial = _serial_time(plan, realized) + tp_check
        if tp_latency > 0:  # every task may wait for its decision
            serial += tp_latency * sum(1 for _ in plan.all_tasks())
        time_limit = max(TIME_LIMIT_FLOOR, TIME_LIMIT_FACTOR * serial)
        limit_note = (
            f"the default: max({TIME_LIMIT_FLOOR:g}, {TIME_LIMIT_FACTOR:g} x the step's serial"
            f" time {serial:.6g} s); pass time_limit= to change it"
        )
    else:
        limit_note = "pass time_limit= to change it"
    recorder = TraceRecorder() if record else None
    if recorder is not None:
        observer = MultiObserver(observer, recorder) if observer is not None else recorder
    if activation_bytes is None:
        nbytes = (
            schedule.activation_bytes
            if schedule is not None and schedule.activation_bytes is not None
            else ActivationBytes.from_sizes(plan, [mb.tokens for mb in mbs])
        )
    else:
        check_type("activation_bytes", activation_bytes, ActivationBytes, "ActivationBytes")
        nbytes = activation_bytes
    if schedule is None:
        counted = max_inflight is not None or memory_factor is not None
        schedule = StepSchedule.build(
            plan,
            hint,
            durations=declared,
            max_inflight=max_inflight,
            memory_factor=memory_factor,
            activation_bytes=nbytes if not counted or memory_budget is not None else None,
            memory_budget=memory_budget,
        )
    elif memory_budget is not None:
        raise PlanError(
            "simulate: memory_budget with schedule=: build the schedule with it"
            " (StepSchedule.build(..., activation_bytes=, memory_budget=))"
        )
    executor = CostModelExecutor(realized)
    coords = None
    if tp_latency > 0:  # else nothing is installed: exactly the step without TP
        executors, coords = tp_executors(executor, plan.stages, tp_latency)
    pipe = LocalPipeline(
        schedule,
        executor if coords is None else executors,
        policy=policy,
        latency=lambda step, task: realized.latency(task),
        observer=observer,
        coordinators=coords,
        deduce_tp=deduce,
    )
    if coords is not None:
        attach(pipe.stages, coords)
    stats = run_virtual(
        pipe,
        mbs,
        time_limit=None if math.isinf(time_limit) else time_limit,
        wall_limit=wall_limit,
        limit_note=limit_note,
    )
    start = min(s.started for s in stats)
    makespan = max(s.finished for s in stats) - start + tp_check
    lb = lower_bound(plan, realized)
    if start == 0.0:  # the virtual clock starts at 0: times relative to it are the same
        executed = tuple(s.executed for s in stats)
    else:
        executed = tuple(
            tuple(ExecutedTask(e.task, e.start - start, e.end - start) for e in s.executed)
            for s in stats
        )
    return SimResult(
        makespan=makespan,
        lower_bound=lb,
        efficiency=lb / makespan if makespan > 0 else 1.0,
        peak_inflight=tuple(s.peak_inflight for s in stats),
        max_inflight=tuple(s.max_inflight for s in stats),
        executed=executed,
        deviations=tuple(s.deviations for s in stats),
        hint=schedule.hint_name,
        policy=stats[0].policy,
        stats=tuple(stats),
        wall_time=time.perf_counter() - t_wall,
        schedule=schedule,
        trace=None if recorder is None else recorder.data,
        seed=seed,
        tp=tp,
        tp_latency=tp_latency,
        tp_check=tp_check,
        peak_bytes=tuple(held_peak(s.executed, nbytes) for s in stats),
        reference_bytes=tuple(reference_peaks(plan, nbytes)),
        budget_bytes=schedule.budgets,
        tp_decisions=None
        if coords is None
        else tuple(
            tuple(TPDecision(d.task, d.decided - start, d.start - start, d.deduced) for d in c.log)
            for c in coords
        ),
    )


def compare(
    policies: Sequence[str | Policy] = ("strict", "readiness_first"), **kwargs: Any
) -> dict[str, SimResult]:
    """Simulate the same step (same sizes, same realized noise) under several policies.

    ``kwargs`` are ``simulate``'s; ``seed=None`` draws one fresh seed for all of them.

    Raises:
        PlanError: ``policies`` is not a sequence of policies (a single name, say), or
            ``policy`` is among ``kwargs``; and whatever ``simulate`` raises.
    """
    if isinstance(policies, str | bytes) or not isinstance(policies, Sequence):
        raise PlanError(
            f"policies must be a sequence of policy names or policies, got {describe(policies)}"
        )
    if "policy" in kwargs:
        raise PlanError("compare takes its policies in `policies`, not `policy`")
    if kwargs.get("seed", 0) is None:
        kwargs["seed"] = secrets.randbits(32)
    out: dict[str, SimResult] = {}
    for p in policies:
        r = simulate(policy=p, **kwargs)
        out[r.policy] = r
    return out
