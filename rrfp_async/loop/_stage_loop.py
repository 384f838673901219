"""The stage loop: one object per pipeline rank that runs its tasks of each step.

This module holds the stage's observer and monitor protocols and :class:`StageLoop` itself:
its construction and the step (``run_step``: start, the loop of the step, its end, what it
returns). The rest of the class is a stack of mixins, one concept per module (the design
note in ``_loop_fields`` draws it): the introspection and state dump (``_loop_introspect``),
the step-failure bookkeeping (``_loop_failures``), message delivery (``_loop_delivery``),
the dispatch loop with its design note (``_loop_dispatch``) and the TP follower with its
deduced decisions (``_loop_tp_follower``). The step's bookkeeping is
:class:`~rrfp_async.loop._state.StepState`, the policy's view
:class:`~rrfp_async.loop._view.StageView`, the dumps and the deadlock grid
:mod:`rrfp_async.loop._diagnostics`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._admission import AdmissionLedger
from .._check import check_bool, check_int, check_type, describe
from .._errors import ChannelError, PeerStepError, PlanError, StepTimeoutError
from .._tasks import Task
from ..channels import Endpoint, ThreadsafeEndpoint
from ..policies import Policy, PolicyBase, StepSchedule, get_policy, policy_name
from ._checks import check_step_args, check_step_timeout
from ._executors import (
    Executor,
    OutputHookExecutor,
    StepFailedExecutor,
    StepResultsExecutor,
    TaskContext,
    check_executor,
)
from ._loop_fields import Coordinator
from ._loop_tp_follower import TPFollower
from ._observe import guard_observer
from ._records import ExecutedTask, StepStats
from ._state import NO_DATA, StepState
from ._view import StageView
from ._virtual import VirtualClockLoop

__all__ = [
    "ExecutedTask",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepStats",
    "check_step_args",
    "check_step_timeout",
]


class StageObserver(Protocol):
    """Receives one call per state transition of a stage (tracing, logging, dumps).

    Every method is called on the loop thread; keep them cheap. A stage without an observer
    pays one ``is None`` test per transition. Two hooks are optional, each a protocol of its
    own: ``active`` (:class:`~rrfp_async.loop.ActiveObserver`: when it is false at the start
    of a step, the stage does not call the observer during that step) and ``failed(stage,
    exc, dump)`` (:class:`~rrfp_async.loop.FailedObserver`: called, active or not, when a
    step fails, with the stage's state as text, see :meth:`StageLoop.dump`;
    :class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``).

    An observer must not raise. If it does, the stage stops calling it for the rest of the
    step and the step fails with an ``ObserverError`` (its cause: the observer's exception),
    or, when the step had failed already, that error gets a note; an exception of
    ``failed`` becomes a note on the step's error (see ``rrfp_async.loop._observe``).
    """

    def step_start(self, stage: StageLoop) -> None:
        """The step started."""

    def message(self, stage: StageLoop, task: Task, src: int) -> None:
        """The input of ``task`` arrived from rank ``src``."""

    def ready(self, stage: StageLoop, task: Task) -> None:
        """``task`` became ready (all inputs present)."""

    def decision(self, stage: StageLoop, task: Task, ready: Sequence[Task], idle: float) -> None:
        """The policy chose ``task`` among ``ready``; the stage had been idle ``idle`` s."""

    def task_start(self, stage: StageLoop, task: Task) -> None:
        """``task`` started."""

    def task_end(self, stage: StageLoop, task: Task, start: float, end: float) -> None:
        """``task`` finished."""

    def stall(self, stage: StageLoop, reason: str) -> None:
        """The stage is idle and waits; ``reason`` says for what."""

    def tp_decision(self, stage: StageLoop, task: Task, seq: int, sent: bool) -> None:
        """A TP decision was broadcast (leader, ``sent``) or received (follower)."""

    def step_end(self, stage: StageLoop, stats: StepStats) -> None:
        """The step ended on this stage."""


class StageMonitor(Protocol):
    """Sees when stages block; raises a deadlock when no stage can ever progress."""

    def blocked(self, stage: StageLoop) -> None:
        """``stage`` is waiting for its ready set to change and runs nothing."""

    def unblocked(self, stage: StageLoop) -> None:
        """``stage`` is no longer blocked."""


def _clock_of(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """The stage clock: the loop's own when it is virtual, else ``time.monotonic`` (one
    system-wide clock, so spans of different processes line up; uvloop's ``time()`` is
    cached per iteration at millisecond resolution)."""
    if isinstance(loop, VirtualClockLoop) and loop.virtual_clock:
        return loop.time
    return time.monotonic


class StageLoop(TPFollower):
    """Runs one pipeline rank's share of each step, readiness-first.

    Args:
        rank: The pipeline rank.
        schedule: The step schedule (plan, hint, bounds); every rank uses an equal one.
        executor: Runs this rank's tasks.
        endpoint: This rank's end of the channel that connects the stages.
        policy: A policy name or coroutine (default ``"readiness_first"``).
        monitor: Optional deadlock monitor that sees every stage (the local pipeline's).
        observer: Optional observer of every transition (tracing).
        step_timeout: Seconds after which a step fails with ``StepTimeoutError`` (on the
            loop clock), or None for no watchdog.
        coordinator: The TP decision channel of this stage (None without TP).
        coordinate: With a coordinator: followers run the leader's decisions. False lets
            every TP rank decide alone (for measurement and tests only: their collectives
            may then not match).
        verify_sequences: With a coordinator: after each step, check that every TP rank
            executed the same sequence (``DivergenceError`` otherwise).
        flight_recorder: How many recent events (message, start, end) to keep for the
            state dump of a failed step (0: none).
        max_microbatches: The most microbatches a step may have (None: no limit).
        deduce_tp: TP follower under a policy that ``chooses_ready_head``: start a decision
            it can deduce (the next hinted task, ready here with local inputs only) without
            waiting for the leader's row, and check the row when it arrives (see "Deduced
            TP decisions" in ``loop/_loop_tp_follower.py``). False: wait for every row (for
            measurement).

    Use ``await stage.run_step(microbatches)`` for each step, inside any running loop.

    A failed step does not poison the next one: the stage remembers the failed step's number
    and drops the messages of that step that still arrive (peers may have sent them before
    it failed), so the next step starts clean. Only a broken channel (a ``ChannelError``
    handed to :meth:`fail`) fails every later step.

    Raises:
        PlanError: ``rank`` is not an integer in the pipeline, ``schedule`` is not a
            ``StepSchedule``, ``executor`` has no usable ``execute(task, data, ctx)``,
            ``endpoint`` has no ``bind``/``send``, ``step_timeout`` is not None or a number
            > 0, ``flight_recorder`` is not an integer >= 0, or ``coordinate``,
            ``verify_sequences`` or ``deduce_tp`` is not a bool.
        PolicyError: ``policy`` is neither a registered name nor a coroutine function.
    """

    monitor: StageMonitor | None  # narrower than StageFields.monitor: the public type

    def __init__(
        self,
        rank: int,
        *,
        schedule: StepSchedule,
        executor: Executor,
        endpoint: Endpoint,
        policy: str | Policy = "readiness_first",
        monitor: StageMonitor | None = None,
        observer: StageObserver | None = None,
        step_timeout: float | None = None,
        coordinator: Coordinator | None = None,
        coordinate: bool = True,
        verify_sequences: bool = True,
        flight_recorder: int = 32,
        max_microbatches: int | None = None,
        deduce_tp: bool = True,
    ) -> None:
        check_type("schedule", schedule, StepSchedule, "a StepSchedule")
        rank = check_int("rank", rank, minimum=0, maximum=schedule.plan.stages - 1)
        self._exec_async = check_executor(executor, rank)
        for method in ("bind", "send"):
            if not callable(getattr(endpoint, method, None)):
                raise PlanError(
                    f"endpoint of rank {rank} {describe(endpoint)} has no {method} method; an"
                    " endpoint needs bind(sink) and send(dst, step, task, payload)"
                )
        step_timeout = check_step_timeout(step_timeout)
        flight_recorder = check_int("flight_recorder", flight_recorder, minimum=0)
        check_bool("coordinate", coordinate)
        check_bool("verify_sequences", verify_sequences)
        check_bool("deduce_tp", deduce_tp)
        self.rank = rank
        self.schedule = schedule
        self._base = schedule  # what steps of other sizes (and eval steps) derive from
        self.max_microbatches = (
            None
            if max_microbatches is None
            else check_int("max_microbatches", max_microbatches, minimum=1)
        )
        self.executor = executor
        self.endpoint = endpoint
        self.policy = get_policy(policy)
        self.policy_name = policy_name(self.policy)
        self._hooks = self.policy if isinstance(self.policy, PolicyBase) else None
        self.monitor = monitor
        self.observer = observer
        self._obs = None  # the guarded observer of this step
        self._obs_error: BaseException | None = None  # what it raised this step (_observe)
        self.step_timeout = step_timeout
        self.coordinator = coordinator
        self.coordinate = coordinate
        self.verify_sequences = verify_sequences
        self.deduce_tp = deduce_tp
        #: TP follower: decisions started without waiting for the leader (deduced).
        self.tp_deduced = 0
        self._verified: int | None = None  # the last step whose TP sequence check was posted
        self.recent: collections.deque[tuple[float, str, Task]] | None = (
            collections.deque(maxlen=flight_recorder) if flight_recorder > 0 else None
        )
        self._now: Callable[[], float] = time.monotonic
        self._closed_peers: set[int] = set()
        self.blocked = False
        self._st: StepState | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._failure: BaseException | None = None
        self._early: dict[int, list[tuple[Task, Any, int]]] = {}
        # Steps that failed (or were cancelled) here: their late messages are dropped.
        self._dead: set[int] = set()
        # Steps that failed on another rank before they started here (``step_aborted``).
        self._aborted: dict[int, BaseException] = {}
        self.late_failures: list[BaseException] = []
        self._next_step = 0
        #: How long a failed step waits for the task still running on the executor (see
        #: ``_settle``), in seconds of the loop's clock.
        self.settle_timeout = 30.0
        #: Called as ``on_failure(step, exc)`` before that wait (``DistributedStage`` tells
        #: the other ranks there, so that they need not wait for this rank's task).
        self.on_failure: Callable[[int, BaseException], None] | None = None
        self._view = StageView(self)
        # Outputs leave from the compute thread when both sides allow it (see Executor).
        if isinstance(executor, OutputHookExecutor):  # this stage's hook, or none (not a stale one)
            self._eager = isinstance(endpoint, ThreadsafeEndpoint) and bool(
                endpoint.threadsafe_send
            )
            executor.output_hook = self._send_output if self._eager else None
        else:
            self._eager = False
        endpoint.bind(self)

    # ------------------------------------------------------------------ the step

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> StepStats:
        """Run this rank's tasks of one step; return what it did.

        Args:
            microbatches: The step's microbatches (the first stage's forwards read them);
                any number >= 1: a step of another size than the plan's runs the schedule
                derived for it (``StepSchedule.for_microbatches``).
            step: The step number (default: one more than the last).
            schedule: A schedule for this step (e.g. a hint computed from this step's
                microbatch sizes); it must have the stage's topology and as many
                microbatches as ``microbatches``, and later steps derive from it.
            train: False runs a forward-only (evaluation) step: ``F`` tasks only
                (``StepSchedule.forward_only``); the last stage's outputs come back in
                ``StepStats.outputs`` when the executor keeps them.

        Raises:
            PlanError: ``microbatches``, ``step`` or ``schedule`` do not fit the stage's plan,
                a step is already running, or ``step`` is the number of a step that failed
                here (its late messages are dropped by that number); or the executor's
                ``execute`` returned no awaitable.
            PolicyError: The policy misbehaved.
            DeadlockError: The step can never finish (detected by the monitor).
            StepTimeoutError: The watchdog fired.
            ProtocolError: A message did not fit the step.
            PeerError: A peer's channel failed or closed while this rank waited for it.
            DivergenceError: The TP ranks of the stage diverged.
        """
        if self._st is not None:
            raise PlanError(
                f"rank {self.rank}: run_step is already running step {self._st.step}; a stage"
                " runs one step at a time (await the running step first)"
            )
        who = f"rank {self.rank}"
        check_step_args(who, self._base.plan, microbatches, step, schedule, self.max_microbatches)
        check_bool(f"{who}: train", train)
        if step is not None:
            self.check_step_number(step)
        base = self._base if schedule is None or schedule.plan.forward_only else schedule
        try:
            sched = schedule if schedule is not None else base.for_microbatches(len(microbatches))
            if not train:
                sched = sched.forward_only()
        except PlanError as e:
            raise PlanError(f"{who}: {e}") from None
        step = self._next_step if step is None else int(step)
        aborted = self._aborted.pop(step, None)
        if aborted is not None:  # it failed on another rank before it started here
            self._next_step = step + 1
            self._post_failed_sequence(step, aborted)
            raise aborted
        self._base = base
        self.schedule = sched
        self._next_step = step + 1
        if not isinstance(self._failure, ChannelError) or isinstance(self._failure, PeerStepError):
            self._failure = None  # a broken channel stays broken: every later step fails
        if self._failure is not None:
            self._dead.add(step)
            self._post_failed_sequence(step, self._failure)
            raise self._failure
        try:
            # _begin inside: a step that fails while it starts (a bad early message, a
            # policy hook that raises) must still end, or the stage stays "running" forever.
            st = self._begin(step, microbatches)
            if self.step_timeout is None:
                await self._loop(st)
            else:
                try:
                    async with asyncio.timeout(self.step_timeout):
                        await self._loop(st)
                except TimeoutError as e:
                    raise StepTimeoutError(
                        f"rank {self.rank} step {step}: no progress to the end of the step"
                        f" within {self.step_timeout} s\n{self.dump()}"
                    ) from e
            stats = self._stats(st)
            if self._obs is not None:
                self._obs.step_end(self, stats)
            if self._obs_error is not None:  # the observer raised after the last task
                raise self._obs_error
            return stats
        except BaseException as e:
            self._dead.add(step)
            self._early.pop(step, None)
            self._post_failed_sequence(step, e)
            if isinstance(self.executor, StepFailedExecutor):
                self.executor.step_failed(step)
            if not isinstance(e, asyncio.CancelledError):
                self._dump_on_failure(e)
            st_now = self._computing()
            if st_now is not None:
                hook = self.on_failure
                if hook is not None:  # tell the peers first: the wait below takes a task
                    hook(step, e)
                await self._settle(st_now, e)
            raise
        finally:
            self._st = None

    def _begin(self, step: int, microbatches: Sequence[Any]) -> StepState:
        prog = self.schedule.program(self.rank)
        n = len(prog.order)
        loop = asyncio.get_running_loop()
        st = StepState(
            step=step,
            plan=self.schedule.plan,
            prog=prog,
            ledger=AdmissionLedger(prog.order, self.schedule.bounds[self.rank], prog.pos),
            microbatches=microbatches,
            ctx=TaskContext(self.rank, step, self.schedule.plan, microbatches),
            missing=list(prog.deps),
            arrived=bytearray(n),
            started=bytearray(n),
            finished=bytearray(n),
            inbox=[NO_DATA] * n,
            left=n,
        )
        self._now = _clock_of(loop)
        st.t_start = st.last_end = st.prefix_end = self._now()
        st.ends = [st.t_start] * n
        st.starts = [st.t_start] * n
        for i in range(n):
            if prog.first_forward[i]:
                st.inbox[i] = microbatches[prog.order[i].mb]
            if prog.deps[i] == 0:
                st.ready.append(i)
        self._st = st
        if self._hooks is not None:
            self._hooks.on_step_start(self.rank, step)
        # Skipped for the whole step when inactive; guarded: see _observe.
        self._obs = guard_observer(self)
        if self._obs is not None:
            self._obs.step_start(self)
        for task, payload, src in self._early.pop(step, ()):
            self.deliver(step, task, payload, src)
        self._check_closed_peers()
        return st

    async def _loop(self, st: StepState) -> None:
        coord = self.coordinator if self.coordinate else None
        if coord is not None:
            coord.begin_step(st.step, len(st.prog.order))
        if coord is not None and not coord.is_leader:
            await self._follow(st, coord)
        else:
            await self._decide_and_run(st, coord)
            if coord is not None:
                await coord.end_step()
        if self.coordinator is not None and self.verify_sequences:
            self._verified = st.step  # posted once per step, whatever it raises
            await self.coordinator.verify_sequence(st.step, [e.task for e in st.executed])

    def _stats(self, st: StepState) -> StepStats:
        losses = outputs = None
        ex = self.executor
        results = ex.step_results if isinstance(ex, StepResultsExecutor) else None
        if results is not None and st.plan.rank_of(Task(st.plan.num_virtual - 1, "F", 0)) == (
            self.rank
        ):
            got_losses, got_outputs = results(st.step)
            m = st.plan.microbatches
            if got_losses:
                losses = tuple(got_losses.get(i, float("nan")) for i in range(m))
            if got_outputs:
                outputs = tuple(got_outputs.get(i) for i in range(m))
        return StepStats(
            losses=losses,
            outputs=outputs,
            rank=self.rank,
            step=st.step,
            policy=self.policy_name,
            hint=self.schedule.hint_name,
            started=st.t_start,
            finished=st.last_end,
            executed=tuple(st.executed),
            peak_inflight=st.ledger.peak,
            max_inflight=st.ledger.bound,
            decisions=st.decisions,
            deviations=st.deviations,
            tp_deduced=st.deduced,
        )
