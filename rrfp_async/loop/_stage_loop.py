"""The stage loop: one object per pipeline rank that runs its tasks of each step.

This module holds the stage's observer and monitor protocols and :class:`StageLoop`, which
wires the parts that own the stage's state and reads, in ``run_step``, as the algorithm of
a step: resolve it, start it, dispatch its tasks, end it (or fail it). The parts, each
constructible alone with its collaborators passed in:

* :class:`~rrfp_async.loop._history.StepHistory`: the next step number, the steps that
  failed here or elsewhere, early messages, late failures (its design note: why);
* :class:`~rrfp_async.loop._step_run.StepRun`: the running step's state, its ready set and
  inputs, the one wait, the blocked flag, the step's failure and observer;
* :class:`~rrfp_async.loop._task_runner.TaskRunner`: the executor call, the admission
  ledger's start and finish, the hand-off of outputs, the wait for a failed step's task;
* the dispatchers, one per role: :class:`~rrfp_async.loop._decide.Decider` (alone, or TP
  leader with its look-ahead; the dispatch loop's design note) and
  :class:`~rrfp_async.loop._follow.Follower` (TP follower, its deduced decisions);
* :class:`~rrfp_async.loop._coordinator.SequenceCheck`: the TP sequence check, once a step.

The step's bookkeeping is :class:`~rrfp_async.loop._state.StepState`, the policy's view
:class:`~rrfp_async.loop._view.StageView`, the dumps and the deadlock grid
:mod:`rrfp_async.loop._diagnostics`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .._check import check_int, check_type, describe
from .._errors import DeadlockError, PlanError, ProtocolError, StateNote
from .._tasks import StepPlan, Task
from ..channels import Endpoint
from ..policies import (
    Policy,
    PolicyBase,
    ReadyView,
    StepSchedule,
    chooses_ready_head,
    get_policy,
    policy_name,
)
from ._checks import check_step_timeout, resolve_step
from ._coordinator import Coordinator, SequenceCheck
from ._decide import Decider, watchdog_error
from ._diagnostics import dump, grid_row
from ._executors import (
    Executor,
    StepFailedExecutor,
    StepResultsExecutor,
    TaskContext,
    check_executor,
)
from ._follow import Follower, deducible
from ._history import StepHistory
from ._observe import attach_observer_error, call_failed, guard_observer
from ._records import ExecutedTask, StepStats
from ._state import NO_DATA, StepState
from ._step_run import StepRun
from ._task_runner import TaskRunner
from ._tp_options import UNSET, TPOptions, stage_tp_options
from ._view import StageView
from ._virtual import VirtualClockLoop

__all__ = [
    "ExecutedTask",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepStats",
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


class StageLoop:
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
        tp: How the TP ranks work together, as one value (``TPOptions``; give it or the
            flat keywords ``coordinate``, ``verify_sequences``, ``deduce_tp``, not both).
            The stage uses ``coordinate``, ``verify`` and ``deduce``; ``fold_check`` has
            no meaning here (the coordinator, built by its owner, folds the check or not).
        coordinate: ``TPOptions.coordinate``: with a coordinator, followers run the
            leader's decisions. False lets every TP rank decide alone (for measurement and
            tests only: their collectives may then not match).
        verify_sequences: ``TPOptions.verify``: with a coordinator, after each step, check
            that every TP rank executed the same sequence (``DivergenceError`` otherwise).
        flight_recorder: How many recent events (message, start, end) to keep for the
            state dump of a failed step (0: none).
        max_microbatches: The most microbatches a step may have (None: no limit).
        deduce_tp: ``TPOptions.deduce``: TP follower under a policy that
            ``chooses_ready_head``: start a decision it can deduce (the next hinted task,
            ready on this rank with local inputs only) without waiting for the leader's
            row, and check the row when it arrives (see "Deduced TP decisions" in
            ``loop/_follow.py``). False: wait for every row (for measurement).
        on_failure: Called as ``on_failure(step, exc)`` when a step fails while one of its
            tasks is still on the executor, before the stage waits for that task
            (``DistributedStage`` tells the other ranks there, so that they need not wait
            for this rank's task).

    Use ``await stage.run_step(microbatches)`` for each step, inside any running loop.

    A failed step does not poison the next one: the stage remembers the failed step's number
    and drops the messages of that step that still arrive (peers may have sent them before
    it failed), so the next step starts clean. Only a broken channel (a ``ChannelError``
    handed to :meth:`fail`) fails every later step.

    Raises:
        PlanError: ``rank`` is not an integer in the pipeline, ``schedule`` is not a
            ``StepSchedule``, ``executor`` has no usable ``execute(task, data, ctx)``,
            ``endpoint`` has no ``bind``/``send``, ``step_timeout`` is not None or a number
            > 0, ``flight_recorder`` is not an integer >= 0, ``coordinate``,
            ``verify_sequences`` or ``deduce_tp`` is not a bool, ``tp`` is no
            ``TPOptions``, or ``tp`` is given with one of those flat keywords.
        PolicyError: ``policy`` is neither a registered name nor a coroutine function.
    """

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
        coordinate: bool = UNSET,
        verify_sequences: bool = UNSET,
        flight_recorder: int = 32,
        max_microbatches: int | None = None,
        deduce_tp: bool = UNSET,
        on_failure: Callable[[int, BaseException], None] | None = None,
        tp: TPOptions | None = None,
    ) -> None:
        check_type("schedule", schedule, StepSchedule, "a StepSchedule")
        rank = check_int("rank", rank, minimum=0, maximum=schedule.plan.stages - 1)
        exec_async = check_executor(executor, rank)
        for method in ("bind", "send"):
            if not callable(getattr(endpoint, method, None)):
                raise PlanError(
                    f"endpoint of rank {rank} {describe(endpoint)} has no {method} method; an"
                    " endpoint needs bind(sink) and send(dst, step, task, payload)"
                )
        step_timeout = check_step_timeout(step_timeout)
        flight_recorder = check_int("flight_recorder", flight_recorder, minimum=0)
        options = stage_tp_options(tp, rank, coordinate, verify_sequences, deduce_tp)
        self.rank = rank
        #: The schedule of the running (or last) step.
        self.schedule = schedule
        self._base = schedule  # what steps of other sizes (and eval steps) derive from
        self.max_microbatches = (
            None
            if max_microbatches is None
            else check_int("max_microbatches", max_microbatches, minimum=1)
        )
        self.policy = get_policy(policy)
        self.policy_name = policy_name(self.policy)
        self.observer = observer
        self.step_timeout = step_timeout
        self.coordinator = coordinator
        #: The TP options, as one value (given as ``tp`` or as the flat keywords).
        self.tp = options
        self.coordinate = options.coordinate
        self.verify_sequences = options.verify
        self.deduce_tp = options.deduce
        self._on_failure = on_failure  # (see the ``on_failure`` argument)
        #: The flight recorder: the recent events (message, start, end) a dump lists.
        self.recent: collections.deque[tuple[float, str, Task]] | None = (
            collections.deque(maxlen=flight_recorder) if flight_recorder > 0 else None
        )
        # The parts (see the module's docstring), wired once.
        self._history = StepHistory(rank)
        self._run = StepRun(rank, monitor=monitor, owner=self, recent=self.recent)
        self._view = StageView(self, self._run)
        self._tasks = TaskRunner(
            rank,
            executor=executor,
            endpoint=endpoint,
            run=self._run,
            exec_async=exec_async,
            hooks=self.policy if isinstance(self.policy, PolicyBase) else None,
        )
        self._decider = Decider(
            rank, policy_name=self.policy_name, view=self._view, run=self._run, runner=self._tasks
        )
        self._follower = Follower(
            rank, policy_name=self.policy_name, view=self._view, run=self._run, runner=self._tasks
        )
        self._sequence = SequenceCheck()
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
                on this rank (its late messages are dropped by that number); or the executor's
                ``execute`` returned no awaitable.
            PolicyError: The policy misbehaved.
            DeadlockError: The step can never finish (detected by the monitor).
            StepTimeoutError: The watchdog fired.
            ProtocolError: A message did not fit the step.
            PeerError: A peer's channel failed or closed while this rank waited for it.
            DivergenceError: The TP ranks of the stage diverged.
        """
        if self._run.state is not None:
            raise PlanError(
                f"rank {self.rank}: run_step is already running step {self._run.state.step}; a"
                " stage runs one step at a time (await the running step first)"
            )
        step = self._resolve(microbatches, step, schedule, train)
        try:
            # _begin inside: a step that fails while it starts (a bad early message, a
            # policy hook that raises) must still end, or the stage stays "running" forever.
            st = self._begin(step, microbatches)
            await self._dispatch_watched(st)
            return self._end(st)
        except BaseException as e:
            await self._fail(step, e)
            raise
        finally:
            self._run.end()

    def _resolve(
        self,
        microbatches: Sequence[Any],
        step: int | None,
        schedule: StepSchedule | None,
        train: bool,
    ) -> int:
        """Resolve the step's number and schedule (``resolve_step``) and install them; raise
        at once when the step cannot run: it failed on another rank before it started on
        this one, or the channel is broken."""
        history = self._history
        resolved = resolve_step(
            f"rank {self.rank}",
            self._base,
            microbatches,
            step=step,
            schedule=schedule,
            train=train,
            next_step=history.next_step,
            max_microbatches=self.max_microbatches,
        )
        if step is not None:
            history.refuse_rerun(resolved.step)
        n = resolved.step
        aborted = history.start(n)
        if aborted is not None:  # it failed on another rank before it started on this one
            self._post_failed_sequence(n, aborted)
            raise aborted
        self._base = resolved.base
        self.schedule = resolved.schedule
        failure = self._run.clear_failure()
        if failure is not None:  # a broken channel stays broken: every later step fails
            history.failed(n)
            self._post_failed_sequence(n, failure)
            raise failure
        return n

    async def _dispatch_watched(self, st: StepState) -> None:
        """``_dispatch`` under the step watchdog (``step_timeout``), if there is one."""
        if self.step_timeout is None:
            await self._dispatch(st)
            return
        try:
            async with asyncio.timeout(self.step_timeout):
                await self._dispatch(st)
        except TimeoutError as e:  # (the policy's turn: it is the cause, named first)
            dump = self.dump()
            raise watchdog_error(self.rank, st, self.policy_name, self.step_timeout, dump) from e

    def _end(self, st: StepState) -> StepStats:
        """The step ran every task: its stats (an observer that raised fails it still)."""
        stats = self._stats(st)
        if self._run.obs is not None:
            self._run.obs.step_end(stats)
        if self._run.obs_error is not None:  # the observer raised after the last task
            raise self._run.obs_error
        return stats

    async def _fail(self, step: int, e: BaseException) -> None:
        """Step ``step`` failed with ``e``: its late messages are dropped, the TP sequence
        check and the executor hear of it, the state dump goes on ``e``, and a task still on
        the executor is waited for (after ``on_failure`` told the peers)."""
        self._history.failed(step)
        self._post_failed_sequence(step, e)
        if isinstance(self.executor, StepFailedExecutor):
            self.executor.step_failed(step)
        if not isinstance(e, asyncio.CancelledError):
            self._dump_on_failure(e)
        computing = self._run.computing()
        if computing is not None:
            if self._on_failure is not None:  # tell the peers first: the wait takes a task
                self._on_failure(step, e)
            await self._tasks.settle(computing, e)

    def _begin(self, step: int, microbatches: Sequence[Any]) -> StepState:
        """Start step ``step``: its state, the inputs it has already, its observer."""
        prog = self.schedule.program(self.rank)
        n = len(prog.order)
        st = StepState(
            step=step,
            plan=self.schedule.plan,
            prog=prog,
            ledger=self.schedule.ledger(self.rank),
            microbatches=microbatches,
            ctx=TaskContext(self.rank, step, self.schedule.plan, microbatches),
            missing=list(prog.deps),
            arrived=bytearray(n),
            started=bytearray(n),
            finished=bytearray(n),
            inbox=[NO_DATA] * n,
            left=n,
        )
        now = _clock_of(asyncio.get_running_loop())
        st.t_start = st.last_end = st.prefix_end = now()
        st.ends = [st.t_start] * n
        st.starts = [st.t_start] * n
        for i in range(n):
            if prog.first_forward[i]:
                st.inbox[i] = microbatches[prog.order[i].mb]
            if prog.deps[i] == 0:
                st.ready.append(i)
        run = self._run
        run.start(st, now)
        hooks = self._tasks.hooks
        if hooks is not None:
            hooks.on_step_start(self.rank, step)
        # Skipped for the whole step when inactive; guarded: see _observe.
        run.obs = guard_observer(self, run)
        if run.obs is not None:
            run.obs.step_start()
        for task, payload, src in self._history.take_early(step):
            self.deliver(step, task, payload, src)
        run.check_closed_peers()
        return st

    async def _dispatch(self, st: StepState) -> None:
        """Run every task of ``st`` through the dispatcher of this stage's role, then take
        part in the TP sequence check."""
        coord = self.coordinator if self.coordinate else None
        if coord is not None:
            coord.begin_step(st.step, len(st.prog.order))
        if coord is not None and not coord.is_leader:
            await self._follower.dispatch(st, coord, self.deduces_tp)
        else:
            await self._decider.dispatch(st, self.policy, coord)
            if coord is not None:
                await coord.end_step()
        if self.coordinator is not None and self.verify_sequences:
            await self._sequence.verify(self.coordinator, st.step, [e.task for e in st.executed])

    def _post_failed_sequence(self, step: int, exc: BaseException) -> None:
        """A step that failed on this rank before its TP sequence check still takes part in it."""
        if self.coordinator is not None and self.verify_sequences:
            self._sequence.post_failed(self.coordinator, step, exc)

    def _dump_on_failure(self, exc: BaseException) -> None:
        """Attach this rank's state to the error and hand it to the observer's ``failed``
        (:class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``)."""
        text = self.dump(recent=True)
        attach_observer_error(self._run, exc)
        call_failed(self, exc, text)  # a hook that raises adds a note, never replaces exc
        if not isinstance(exc, DeadlockError):  # a deadlock carries every rank's grid
            exc.add_note(StateNote(f"state of rank {self.rank} when the step failed:\n{text}"))

    # ------------------------------------------------------------------ the channel's sink

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` arrived from rank ``src`` (called by the channel)."""
        run = self._run
        st = run.state
        if st is not None and step == st.step:
            run.deliver(st, task, payload, src)
            return
        history = self._history
        if history.is_dead(step):
            # Sent before its step failed: dropped, never handed to a later step.
            if self.recent is not None:
                self.recent.append(
                    (run.now(), f"dropped (step {step} failed) message from rank {src} for", task)
                )
            return
        if history.is_ahead(step, None if st is None else st.step):
            history.keep_early(step, task, payload, src)
            return
        raise ProtocolError(
            f"rank {self.rank}: message for {task} of step {step} from rank {src} arrived"
            f" after that step ended"
        )

    def fail(self, exc: BaseException) -> None:
        """End the current (or next) step with ``exc`` (a broken channel, a deadlock)."""
        self._run.fail(exc)

    def peer_closed(self, src: int, *, why: str | None = None) -> None:
        """Rank ``src`` closed its channel: no message from it will come any more (``why``:
        what its CLOSE said, origin first)."""
        self._run.peer_closed(src, why=why)

    def step_aborted(self, step: int, exc: BaseException) -> None:
        """Step ``step`` failed on another rank (the channel's ABORT; ``exc`` says where and
        why): fail it on this rank now if it runs, or the moment it starts if it has not started;
        drop its messages either way. A step that already ended well on this rank cannot fail any
        more: ``exc`` is kept in ``late_failures``."""
        st = self._run.state
        if st is not None and st.step == step:
            self._run.fail(exc)
        else:
            self._history.abort(step, exc, None if st is None else st.step)

    # ------------------------------------------------------------------ the step history

    def check_step_number(self, step: int) -> None:
        """Refuse to run ``step`` again after it failed on this rank (its late messages are dropped
        by that number); a step that failed on another rank first is not refused (it fails).

        Raises:
            PlanError: ``step`` failed on this rank before.
        """
        self._history.refuse_rerun(step)

    def aborted(self, step: int) -> BaseException | None:
        """Why step ``step`` failed on another rank before it started on this one (None if not)."""
        return self._history.aborted(step)

    def forget_failed_steps(self) -> None:
        """The channel dropped every message still in flight (a local pipeline does after a
        failed step): a failed step's number may be run again."""
        self._history.forget_failed()

    @property
    def next_step(self) -> int:
        """The number of the step that runs when ``run_step`` is given none."""
        return self._history.next_step

    @property
    def late_failures(self) -> list[BaseException]:
        """ABORTs of steps that had already ended well on this rank (the end-of-step agreement
        fails those)."""
        return self._history.late_failures

    @property
    def base_schedule(self) -> StepSchedule:
        """What the schedules of later steps derive from (steps of other sizes, eval steps):
        the constructor's schedule, or the last per-step training schedule given."""
        return self._base

    # ------------------------------------------------------------------ introspection

    def now(self) -> float:
        """The loop's clock (virtual time under a :class:`VirtualEventLoop`, else monotonic)."""
        return self._run.now()

    @property
    def view(self) -> ReadyView:
        """The policy's view of this stage (what observers and policies may read)."""
        return self._view

    @property
    def plan(self) -> StepPlan:
        """The step plan."""
        return self.schedule.plan

    @property
    def step(self) -> int | None:
        """The step being run, or None between steps."""
        st = self._run.state
        return None if st is None else st.step

    @property
    def executor(self) -> Executor:
        """Runs this rank's tasks."""
        return self._tasks.executor

    @property
    def endpoint(self) -> Endpoint:
        """This rank's end of the channel."""
        return self._tasks.endpoint

    @property
    def monitor(self) -> StageMonitor | None:
        """The deadlock monitor (None: none)."""
        return self._run.monitor

    @property
    def blocked(self) -> bool:
        """Whether the running step waits, untimed, for its ready set to change (what the
        deadlock monitor reads)."""
        return self._run.blocked

    @property
    def eager_outputs(self) -> bool:
        """Whether remote outputs leave from the executor's compute thread (its
        ``set_output_hook``) rather than when the loop resumes."""
        return self._tasks.eager

    @property
    def settle_timeout(self) -> float:
        """How long a failed step waits for the task still running on the executor, in
        seconds of the loop's clock (default 30)."""
        return self._tasks.settle_timeout

    @settle_timeout.setter
    def settle_timeout(self, value: float) -> None:
        self._tasks.settle_timeout = value

    @property
    def tp_deduced(self) -> int:
        """TP follower: decisions started without waiting for the leader (deduced), over
        every step."""
        return self._follower.deduced

    @property
    def deduces_tp(self) -> bool:
        """Whether this stage, as a TP follower, deduces decisions: ``deduce_tp`` and a
        policy that ``chooses_ready_head`` (see "Deduced TP decisions" in ``_follow``)."""
        return self.deduce_tp and chooses_ready_head(self.policy)

    def deduces(self, task: Task) -> bool:
        """Whether a TP follower of this stage would deduce ``task`` as the next decision
        of the running step, without the leader's row: it deduces (``deduces_tp``), and
        ``task`` is the hint's head with no input message."""
        st = self._run.state
        if st is None or not self.deduces_tp:
            return False
        pos = st.prog.pos.get(task)
        return pos is not None and deducible(st, pos)

    def waiting_for(self, limit: int | None = None) -> Iterator[str]:
        """What the next unstarted, not-ready tasks (in hint order) wait for, one line each."""
        st = self._run.state
        return iter(()) if st is None else st.waiting_for(limit)

    def stall_reason(self) -> str | None:
        """Why this stage starts nothing now, in words, naming the blocker first (None
        between steps; see ``StepState.stall_reason``)."""
        st = self._run.state
        return None if st is None else st.stall_reason(self.policy_name)

    def policy_waits_for(self) -> str | None:
        """What the task the policy waits for (``wait_until_ready``) still waits for, in
        words, or None when the policy waits for no task."""
        st = self._run.state
        return None if st is None or st.awaited < 0 else st.why(st.awaited)

    def dump(self, recent: bool = False) -> str:
        """A readable snapshot of the stage: ready set, in-flight, what waiting tasks wait for
        (and, with ``recent``, the last events of the flight recorder)."""
        return dump(
            self.rank,
            self.policy_name,
            self.schedule.hint_name,
            self._run.state,
            self.recent if recent else None,
        )

    def grid_row(self, width: int = 8) -> str:
        """This stage's row of a deadlock grid (``deadlock_grid``): its next unstarted tasks
        (at most ``width``) and why it starts nothing."""
        return grid_row(self.rank, self.policy_name, self._run.state, width)

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
            peak_inflight=st.ledger.peak_count,
            max_inflight=self.schedule.bounds[self.rank],
            peak_bytes=st.ledger.peak if st.ledger.bytes else None,
            budget_bytes=st.ledger.bound if st.ledger.bytes else None,
            reference_bytes=self.schedule.reference_of(self.rank),
            decisions=st.decisions,
            deviations=st.deviations,
            tp_deduced=st.deduced,
        )
