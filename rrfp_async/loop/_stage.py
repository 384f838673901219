"""The stage loop: one object per pipeline rank that runs its tasks of each step.

Design note
-----------
A stage owns a *ready set*: the tasks of its rank whose inputs have all arrived and that
have not started. It changes only on events, never by polling:

* a message arrives (``deliver``, called by the channel on the loop thread), or
* one of the stage's own tasks finishes (which satisfies its same-rank dependents).

The loop body is: wait until some ready task is admitted -> ask the policy coroutine which
one to run -> run it on the executor and await its completion -> hand its output to the
consumer (locally, or through the channel). The stage runs one task at a time, like a GPU
compute stream; messages keep arriving while a task runs because the executor awaits.

Admission (``AdmissionLedger``) keeps in-flight activations within the bound and makes
out-of-order dispatch deadlock-free against a valid hint. A policy can still misbehave (wait
for something that never comes); a *monitor* that sees every stage of a process (the local
pipeline) then raises ``DeadlockError`` with a rank x task grid, and a step watchdog
(``step_timeout``) bounds every other wait.

Everything a stage starts belongs to the caller's task: the stage never creates orphan
tasks and takes over nothing global, so it runs inside any asyncio loop.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .._admission import AdmissionLedger
from .._errors import (
    ChannelError,
    DeadlockError,
    DivergenceError,
    PeerError,
    PolicyError,
    ProtocolError,
    RRFPError,
    StepTimeoutError,
)
from .._tasks import StepPlan, Task
from ..channels._base import Endpoint
from ..policies._policy import Policy, PolicyBase, ReadyView, get_policy, policy_name
from ..policies._schedule import RankProgram, StepSchedule
from ._executors import Executor, TaskContext

__all__ = [
    "Coordinator",
    "ExecutedTask",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepStats",
]


class ExecutedTask(NamedTuple):
    """A task as it ran: ``task`` from ``start`` to ``end`` (seconds on the stage clock)."""

    task: Task
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What one stage did in one step.

    Attributes:
        rank: The pipeline rank.
        step: The step number.
        policy: The policy's name.
        hint: The hint's name.
        started: Clock when the step started on this stage.
        finished: Clock when the stage's last task finished.
        executed: Tasks in execution order with start/end times.
        peak_inflight: Most activations held at once.
        max_inflight: The admission bound.
        decisions: Number of dispatch decisions (= tasks).
        deviations: Decisions that ran a task other than the next hinted one.
    """

    rank: int
    step: int
    policy: str
    hint: str
    started: float
    finished: float
    executed: tuple[ExecutedTask, ...]
    peak_inflight: int
    max_inflight: int
    decisions: int
    deviations: int

    @property
    def busy(self) -> float:
        """Seconds spent running tasks."""
        return sum(e.end - e.start for e in self.executed)

    @property
    def elapsed(self) -> float:
        """Seconds from step start to the stage's last task end."""
        return self.finished - self.started

    @property
    def idle(self) -> float:
        """Seconds of the step the stage was not running a task."""
        return self.elapsed - self.busy


class StageObserver(Protocol):
    """Receives one call per state transition of a stage (tracing, logging, dumps).

    Every method is called on the loop thread; keep them cheap. A stage without an observer
    pays one ``is None`` test per transition. An observer may have an ``active`` attribute:
    when it is false at the start of a step, the stage does not call it during that step.

    An observer may also define ``failed(stage, exc, dump)``: called (active or not) when a
    step fails, with the stage's state as text (see :meth:`StageLoop.dump`);
    :class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``.
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


class Coordinator(Protocol):
    """Makes the TP ranks of a stage run one task sequence (``channels.DecisionChannel``).

    The leader's policy decides and ``publish``es each decision; followers ``receive`` it
    and run that task once it is ready locally.
    """

    @property
    def is_leader(self) -> bool:
        """Whether this rank's policy decides."""

    def begin_step(self, step: int, decisions: int) -> None:
        """A step with ``decisions`` dispatches starts."""

    def publish(self, step: int, seq: int, task: Task) -> None:
        """Leader: announce decision ``seq`` without waiting."""

    async def receive(self, step: int, seq: int) -> Task:
        """Follower: the leader's decision ``seq``."""

    async def end_step(self) -> None:
        """Leader: every decision of the step has gone out."""

    async def verify_sequence(self, step: int, executed: Sequence[Task]) -> None:
        """Every rank: check that all TP ranks executed the same sequence."""


class StageMonitor(Protocol):
    """Sees when stages block; raises a deadlock when no stage can ever progress."""

    def blocked(self, stage: StageLoop) -> None:
        """``stage`` is waiting for its ready set to change and runs nothing."""

    def unblocked(self, stage: StageLoop) -> None:
        """``stage`` is no longer blocked."""


_NO_DATA = object()


def _clock_of(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """The stage clock: the loop's own when it is virtual, else ``time.monotonic`` (one
    system-wide clock, so spans of different processes line up; uvloop's ``time()`` is
    cached per iteration at millisecond resolution)."""
    if getattr(loop, "virtual_clock", False):
        return loop.time
    return time.monotonic


def _expire(w: asyncio.Future[bool]) -> None:
    if not w.done():
        w.set_result(False)


@dataclass(eq=False)
class _StepState:
    step: int
    prog: RankProgram
    ledger: AdmissionLedger
    microbatches: Sequence[Any]
    ctx: TaskContext
    missing: list[int]
    arrived: bytearray
    started: bytearray
    finished: bytearray
    inbox: list[Any]
    ready: list[int] = field(default_factory=list)
    left: int = 0
    version: int = 0
    executed: list[ExecutedTask] = field(default_factory=list)
    observed: dict[Task, float] = field(default_factory=dict)
    decisions: int = 0
    deviations: int = 0
    t_start: float = 0.0
    last_end: float = 0.0
    adm_cache: tuple[int, list[int]] = (-1, [])
    awaited: int = -1
    ends: list[float] = field(default_factory=list)
    prefix_scan: int = 0
    prefix_end: float = 0.0


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
        coordinate: With a coordinator: followers run the leader's decisions. False lets
            every TP rank decide alone (for measurement and tests only: their collectives
            may then not match).
        verify_sequences: With a coordinator: after each step, check that every TP rank
            executed the same sequence (``DivergenceError`` otherwise).
        flight_recorder: How many recent events (message, start, end) to keep for the
            state dump of a failed step (0: none).

    Use ``await stage.run_step(microbatches)`` for each step, inside any running loop.
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
        coordinate: bool = True,
        verify_sequences: bool = True,
        flight_recorder: int = 32,
    ) -> None:
        if not 0 <= rank < schedule.plan.stages:
            raise ValueError(f"rank {rank} is outside the pipeline (0..{schedule.plan.stages - 1})")
        self.rank = rank
        self.schedule = schedule
        self.executor = executor
        self.endpoint = endpoint
        self.policy = get_policy(policy)
        self.policy_name = policy_name(self.policy)
        self._hooks = self.policy if isinstance(self.policy, PolicyBase) else None
        self.monitor = monitor
        self.observer = observer
        self._obs: StageObserver | None = None
        self.step_timeout = step_timeout
        self.coordinator = coordinator
        self.coordinate = coordinate
        self.verify_sequences = verify_sequences
        self.recent: collections.deque[tuple[float, str, Task]] | None = (
            collections.deque(maxlen=flight_recorder) if flight_recorder > 0 else None
        )
        self._now: Callable[[], float] = time.monotonic
        self._closed_peers: set[int] = set()
        self.blocked = False
        self._st: _StepState | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._failure: BaseException | None = None
        self._early: dict[int, list[tuple[Task, Any, int]]] = {}
        self._next_step = 0
        self._view = _View(self)
        # Outputs leave from the compute thread when both sides allow it (see Executor).
        self._eager = bool(getattr(endpoint, "threadsafe_send", False)) and hasattr(
            executor, "output_hook"
        )
        if hasattr(executor, "output_hook"):  # this stage's hook, or none (not a stale one)
            executor.output_hook = self._send_output if self._eager else None
        endpoint.bind(self)

    # ------------------------------------------------------------------ inbound events

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` arrived from rank ``src`` (called by the channel)."""
        st = self._st
        if st is None or step != st.step:
            if (st is None and step >= self._next_step) or (st is not None and step > st.step):
                self._early.setdefault(step, []).append((task, payload, src))
                return
            raise ProtocolError(
                f"rank {self.rank}: message for {task} of step {step} from rank {src} arrived"
                f" after that step ended"
            )
        pos = st.prog.pos.get(task)
        if pos is None:
            raise ProtocolError(
                f"rank {self.rank} step {step}: message from rank {src} names {task}, which is"
                " not a task of this rank"
            )
        if st.prog.src_rank[pos] != src:
            raise ProtocolError(
                f"rank {self.rank} step {step}: input of {task} came from rank {src}, expected"
                f" rank {st.prog.src_rank[pos]}"
            )
        if st.arrived[pos]:
            raise ProtocolError(
                f"rank {self.rank} step {step}: input of {task} from rank {src} arrived twice"
            )
        st.arrived[pos] = 1
        st.inbox[pos] = payload
        if self.recent is not None:
            self.recent.append((self._now(), f"message from rank {src} for", task))
        if self._obs is not None:
            self._obs.message(self, task, src)
        self._satisfy(st, pos)

    def _send_output(self, task: Task, out: Any) -> None:
        """The executor's output hook, on its compute thread: send a remote output now.

        Reads only data that is fixed while the task runs (the step's program).
        """
        st = self._st
        if st is None:
            return
        remote = st.prog.data_remote[st.prog.pos[task]]
        if remote is not None:
            self.endpoint.send(remote[0], st.step, remote[1], out)

    def fail(self, exc: BaseException) -> None:
        """End the current (or next) step with ``exc`` (a broken channel, a deadlock)."""
        if self._failure is None:
            self._failure = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)
            self.blocked = False

    def peer_closed(self, src: int) -> None:
        """Rank ``src`` closed its channel: no message from it will come any more."""
        self._closed_peers.add(src)
        self._check_closed_peers()

    def _check_closed_peers(self) -> None:
        st = self._st
        if st is None or not self._closed_peers:
            return
        for pos, src in enumerate(st.prog.src_rank):
            if src in self._closed_peers and not st.arrived[pos]:
                self.fail(
                    PeerError(
                        f"rank {self.rank} step {st.step}: rank {src} closed its channel (it"
                        f" ended or failed) while {st.prog.order[pos]} still waits for its"
                        " message"
                    )
                )
                return

    def _satisfy(self, st: _StepState, pos: int) -> None:
        st.missing[pos] -= 1
        if st.missing[pos] == 0:
            bisect.insort(st.ready, pos)
            st.version += 1
            if self._obs is not None:
                self._obs.ready(self, st.prog.order[pos])
            self._notify()

    def _notify(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)
            # Unblock now, not when this coroutine resumes, so that a monitor check in
            # between never sees a stage as blocked that is about to run.
            self.blocked = False
            if self.monitor is not None:
                self.monitor.unblocked(self)

    async def _wait(self, reason: str, timeout: float | None = None) -> bool:
        """Wait for the next change of the ready set; False if ``timeout`` passed first.

        Only an untimed wait counts as *blocked* for the deadlock monitor: a timed one
        has a wake-up of its own coming.
        """
        if self._failure is not None:
            raise self._failure
        loop = asyncio.get_running_loop()
        w: asyncio.Future[bool] = loop.create_future()
        self._waiter = w
        if self._obs is not None:
            self._obs.stall(self, reason)
        timer = None
        if timeout is None:
            self.blocked = True
            if self.monitor is not None:
                self.monitor.blocked(self)
        else:
            timer = loop.call_later(max(0.0, timeout), _expire, w)
        try:
            return await w
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
            if self.blocked:
                self.blocked = False
                if self.monitor is not None:
                    self.monitor.unblocked(self)

    # ------------------------------------------------------------------ the step

    def now(self) -> float:
        """The loop's clock (virtual time under a :class:`VirtualEventLoop`, else monotonic)."""
        return self._now()

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
        return None if self._st is None else self._st.step

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
    ) -> StepStats:
        """Run this rank's tasks of one step; return what it did.

        Args:
            microbatches: The step's microbatches (the first stage's forwards read them).
            step: The step number (default: one more than the last).
            schedule: A schedule for this step only (e.g. a hint computed from this step's
                microbatch sizes); it must have the same plan.

        Raises:
            PolicyError: The policy misbehaved.
            DeadlockError: The step can never finish (detected by the monitor).
            StepTimeoutError: The watchdog fired.
            ProtocolError: A message did not fit the step.
            PeerError: A peer's channel failed or closed while this rank waited for it.
            DivergenceError: The TP ranks of the stage diverged.
        """
        if self._st is not None:
            raise RuntimeError(
                f"rank {self.rank}: run_step is already running step {self._st.step}"
            )
        if schedule is not None:
            if schedule.plan != self.schedule.plan:
                raise ValueError("a per-step schedule must have the stage's plan")
            self.schedule = schedule
        plan = self.schedule.plan
        if len(microbatches) != plan.microbatches:
            raise ValueError(
                f"rank {self.rank}: the plan has {plan.microbatches} microbatches, got"
                f" {len(microbatches)}"
            )
        step = self._next_step if step is None else step
        self._next_step = step + 1
        if not isinstance(self._failure, ChannelError):
            self._failure = None  # a broken channel stays broken: every later step fails
        if self._failure is not None:
            raise self._failure
        st = self._begin(step, microbatches)
        try:
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
            return stats
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                self._dump_on_failure(e)
            raise
        finally:
            self._st = None

    def _begin(self, step: int, microbatches: Sequence[Any]) -> _StepState:
        prog = self.schedule.program(self.rank)
        n = len(prog.order)
        loop = asyncio.get_running_loop()
        st = _StepState(
            step=step,
            prog=prog,
            ledger=AdmissionLedger(prog.order, self.schedule.bounds[self.rank], prog.pos),
            microbatches=microbatches,
            ctx=TaskContext(self.rank, step, self.schedule.plan, microbatches),
            missing=list(prog.deps),
            arrived=bytearray(n),
            started=bytearray(n),
            finished=bytearray(n),
            inbox=[_NO_DATA] * n,
            left=n,
        )
        self._now = _clock_of(loop)
        st.t_start = st.last_end = st.prefix_end = self._now()
        st.ends = [st.t_start] * n
        for i in range(n):
            if prog.first_forward[i]:
                st.inbox[i] = microbatches[prog.order[i].mb]
            if prog.deps[i] == 0:
                st.ready.append(i)
        self._st = st
        if self._hooks is not None:
            self._hooks.on_step_start(self.rank, step)
        obs = self.observer
        # An observer that would write nothing (e.g. logging filtered out) is skipped for
        # the whole step: disabled logging costs this one check.
        self._obs = obs if obs is not None and getattr(obs, "active", True) else None
        if self._obs is not None:
            self._obs.step_start(self)
        for task, payload, src in self._early.pop(step, ()):
            self.deliver(step, task, payload, src)
        self._check_closed_peers()
        return st

    async def _loop(self, st: _StepState) -> None:
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
            await self.coordinator.verify_sequence(st.step, [e.task for e in st.executed])

    async def _follow(self, st: _StepState, coord: Coordinator) -> None:
        """TP follower: run the leader's decisions in order, each once it is ready here."""
        obs = self._obs
        view = self._view
        while st.left:
            if self._failure is not None:
                raise self._failure
            task = await coord.receive(st.step, st.decisions)
            if obs is not None:
                obs.tp_decision(self, task, st.decisions, False)
            pos = st.prog.pos.get(task)
            if pos is None or st.started[pos]:
                why = "already ran here" if pos is not None else "is not a task of this rank"
                raise DivergenceError(
                    f"rank {self.rank} step {st.step}: the TP leader's decision {st.decisions}"
                    f" is {task}, which {why}"
                )
            while pos not in self._admitted(st):
                if st.missing[pos] == 0:
                    raise DivergenceError(
                        f"rank {self.rank} step {st.step}: the TP leader chose {task}, which is"
                        f" ready here but not admitted ({st.ledger.inflight}/{st.ledger.bound}"
                        " in flight): the ranks' states diverged"
                    )
                await self._wait(f"TP follower waits for {task}: {self._why(st, pos)}")
            if obs is not None:
                obs.decision(self, task, view.ready, self._now() - st.last_end)
            await self._execute(st, pos)

    # TP look-ahead. A follower can only start a task once the leader's decision for it has
    # arrived; a decision taken when the leader's compute frees up reaches the followers one
    # broadcast later, and inside TP collectives the leader then waits for them: one
    # broadcast per task on the critical path. But a policy that always runs the next
    # hinted task when it is ready (every built-in one: ``chooses_ready_head``) would choose
    # exactly that task at the end of the current one if it is ready already now (or will be
    # by then: its only missing input is the running task's output), since nothing can
    # outrank it and the head is always admitted. So the leader publishes it as
    # the next decision as soon as the current task is on its compute thread, and the
    # broadcast travels while everybody computes.

    async def _decide_and_run(self, st: _StepState, coord: Coordinator | None) -> None:
        policy = self.policy
        view = self._view
        obs = self._obs
        order = st.prog.order
        pre = -1  # a look-ahead decision already published for the next dispatch
        look = None
        if coord is not None and getattr(policy, "chooses_ready_head", False):

            def look(seq: int, running: int) -> None:
                nonlocal pre
                if self._st is not st or st.decisions != seq or pre >= 0:
                    return  # the next decision was taken already (an executor that never yielded)
                h = st.ledger.head
                # Ready now, or ready the moment the running task ends (its only missing input
                # is that task's output: a last stage's B after its F, a W after its I).
                if h < len(order) and (
                    st.missing[h] == 0 or (st.missing[h] == 1 and h in st.prog.local_next[running])
                ):
                    coord.publish(st.step, st.decisions, order[h])
                    if obs is not None:
                        obs.tp_decision(self, order[h], st.decisions, True)
                    pre = h

        while st.left:
            if self._failure is not None:
                raise self._failure
            if pre >= 0:
                pos, pre = pre, -1
                if obs is not None:
                    obs.decision(self, order[pos], view.ready, self._now() - st.last_end)
                await self._execute(st, pos, look)
                continue
            if not self._admitted(st):
                await self._wait(self._stall_reason(st))
                continue
            try:
                task = await policy(view)
            except RRFPError:
                raise
            except Exception as e:
                raise PolicyError(
                    f"policy {self.policy_name!r} raised on rank {self.rank} step {st.step}: {e!r}",
                    policy=self.policy_name,
                    rank=self.rank,
                    step=st.step,
                ) from e
            pos = self._check_choice(st, task)
            if coord is not None:
                coord.publish(st.step, st.decisions, task)
                if obs is not None:
                    obs.tp_decision(self, task, st.decisions, True)
            if obs is not None:
                obs.decision(self, task, view.ready, self._now() - st.last_end)
            await self._execute(st, pos, look)

    def _admitted(self, st: _StepState) -> list[int]:
        if st.adm_cache[0] != st.version:
            st.adm_cache = (st.version, st.ledger.filter_admissible(st.ready))
        return st.adm_cache[1]

    def _check_choice(self, st: _StepState, task: object) -> int:
        pos: int | None = st.prog.pos.get(task) if isinstance(task, Task) else None
        if pos is None or pos not in self._admitted(st):
            if pos is None:
                why = "is not a task of this rank"
            elif st.started[pos]:
                why = "already ran"
            elif st.missing[pos]:
                why = "is not ready (its inputs have not all arrived)"
            else:
                why = "is held back by the admission bound"
            raise PolicyError(
                f"policy {self.policy_name!r} on rank {self.rank} step {st.step} returned"
                f" {task!r}, which {why}; ready: {[str(t) for t in self._view.ready]}",
                policy=self.policy_name,
                rank=self.rank,
                step=st.step,
                task=task,
            )
        return pos

    async def _execute(
        self, st: _StepState, pos: int, started: Callable[[int, int], None] | None = None
    ) -> None:
        prog = st.prog
        task = prog.order[pos]
        st.decisions += 1
        if pos != st.ledger.head:
            st.deviations += 1
        st.ledger.start_at(pos)
        st.started[pos] = 1
        st.ready.remove(pos)
        st.version += 1
        st.left -= 1
        data = st.inbox[pos]
        st.inbox[pos] = _NO_DATA
        if data is _NO_DATA:
            data = None
        obs = self._obs
        if obs is not None:
            obs.task_start(self, task)
        t0 = self._now()
        rec = self.recent
        if rec is not None:
            rec.append((t0, "start", task))
        if started is not None:
            # Runs once the executor has handed the task to its compute thread and yields:
            # a look-ahead broadcast must not delay the task's own start.
            asyncio.get_running_loop().call_soon(started, st.decisions, pos)
        out = await self.executor.execute(task, data, st.ctx)
        t1 = self._now()
        if rec is not None:
            rec.append((t1, "end", task))
        st.last_end = t1
        st.ledger.finish_at(pos)
        st.finished[pos] = 1
        st.ends[pos] = t1
        st.version += 1
        st.executed.append(ExecutedTask(task, t0, t1))
        st.observed[task] = t1 - t0
        if obs is not None:
            obs.task_end(self, task, t0, t1)
        if self._hooks is not None:
            self._hooks.on_task_end(task, t1 - t0)
        dl = prog.data_local[pos]
        if dl >= 0:
            st.inbox[dl] = out
        remote = prog.data_remote[pos]
        if remote is not None and not self._eager:
            self.endpoint.send(remote[0], st.step, remote[1], out)
        for nxt in prog.local_next[pos]:
            self._satisfy(st, nxt)

    def _stats(self, st: _StepState) -> StepStats:
        return StepStats(
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
        )

    # ------------------------------------------------------------------ introspection

    def _stall_reason(self, st: _StepState) -> str:
        if st.ready:
            return (
                f"admission bound reached ({st.ledger.inflight}/{st.ledger.bound} in flight);"
                f" held back: {' '.join(str(st.prog.order[p]) for p in st.ready)}"
            )
        waits = list(self.waiting_for(limit=3))
        return "waiting for " + ("; ".join(waits) if waits else "nothing")

    def waiting_for(self, limit: int | None = None) -> Iterator[str]:
        """What the next unstarted, not-ready tasks (in hint order) wait for, one line each."""
        st = self._st
        if st is None:
            return
        n = 0
        for pos in range(st.ledger.head, len(st.prog.order)):
            if st.started[pos] or st.missing[pos] == 0:
                continue
            yield self._why(st, pos)
            n += 1
            if limit is not None and n >= limit:
                return

    def _why(self, st: _StepState, pos: int) -> str:
        plan = self.schedule.plan
        task = st.prog.order[pos]
        if st.started[pos]:
            return f"{task} already started"
        why = []
        for dep in plan.producers(task):
            dpos = st.prog.pos.get(dep)
            if dpos is None:  # a remote producer: its message has not arrived
                if not st.arrived[pos]:
                    why.append(f"message {dep} from rank {plan.rank_of(dep)}")
            elif not st.finished[dpos]:
                why.append(f"local {dep}" + (" (running)" if st.started[dpos] else ""))
        if not why and st.missing[pos] == 0:
            led = st.ledger
            return f"{task} is ready but not admitted ({led.inflight}/{led.bound} in flight)"
        return f"{task} <- " + (", ".join(why) if why else "a running task")

    def _dump_on_failure(self, exc: BaseException) -> None:
        """Attach this rank's state to the error and hand it to the observer's ``failed``
        (:class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``)."""
        text = self.dump(recent=True)
        failed = getattr(self.observer, "failed", None)
        if failed is not None:
            failed(self, exc, text)
        if not isinstance(exc, DeadlockError):  # a deadlock carries every rank's grid
            exc.add_note(f"state of rank {self.rank} when the step failed:\n{text}")

    def dump(self, recent: bool = False) -> str:
        """A readable snapshot of the stage: ready set, in-flight, what waiting tasks wait for
        (and, with ``recent``, the last events of the flight recorder)."""
        st = self._st
        if st is None:
            return f"rank {self.rank}: idle (no step running)"
        order = st.prog.order
        ready = " ".join(str(order[p]) for p in st.ready) or "-"
        adm = " ".join(str(order[p]) for p in self._admitted(st)) or "-"
        head = order[st.ledger.head] if st.ledger.head < len(order) else None
        lines = [
            f"rank {self.rank} step {st.step} policy {self.policy_name} hint"
            f" {self.schedule.hint_name}: {len(order) - st.left}/{len(order)} tasks started,"
            f" in flight {st.ledger.inflight}/{st.ledger.bound}",
            f"  next hinted: {head}",
            f"  ready: {ready}",
            f"  admitted: {adm}",
        ]
        lines += [f"  waits: {w}" for w in self.waiting_for(limit=6)]
        if recent and self.recent:
            t_end = self.recent[-1][0]
            lines.append(f"  last {len(self.recent)} events (seconds before the last):")
            lines += [f"    -{t_end - t:.6f} {what} {detail}" for t, what, detail in self.recent]
        return "\n".join(lines)


class _View:
    """The live ``ReadyView`` a stage hands its policy."""

    __slots__ = ("_s",)

    def __init__(self, stage: StageLoop) -> None:
        self._s = stage

    def _st(self) -> _StepState:
        st = self._s._st
        if st is None:
            raise RuntimeError("the ready view is only valid during a step")
        return st

    @property
    def rank(self) -> int:
        return self._s.rank

    @property
    def step(self) -> int:
        return self._st().step

    @property
    def ready(self) -> list[Task]:
        st = self._st()
        order = st.prog.order
        return [order[p] for p in self._s._admitted(st)]

    @property
    def blocked(self) -> list[Task]:
        st = self._st()
        adm = set(self._s._admitted(st))
        return [st.prog.order[p] for p in st.ready if p not in adm]

    @property
    def next_hinted(self) -> Task:
        st = self._st()
        return st.prog.order[st.ledger.head]

    @property
    def hint(self) -> Sequence[Task]:
        return self._st().prog.order

    def hint_rank(self, task: Task) -> int:
        return self._st().prog.pos[task]

    def is_ready(self, task: Task) -> bool:
        st = self._st()
        pos = st.prog.pos.get(task)
        return pos is not None and pos in self._s._admitted(st)

    @property
    def inflight(self) -> int:
        return self._st().ledger.inflight

    @property
    def max_inflight(self) -> int:
        return self._st().ledger.bound

    @property
    def remaining(self) -> int:
        return self._st().left

    @property
    def durations(self) -> Mapping[Task, float]:
        return self._st().observed

    def now(self) -> float:
        return self._s._now()

    @property
    def idle_since(self) -> float:
        return self._st().last_end

    @property
    def hinted_deadline(self) -> float | None:
        planned = self._s.schedule.planned(self._s.rank)
        if planned is None:
            return None
        starts, gaps = planned
        st = self._st()
        head = st.ledger.head
        # Every task before the head has started; between decisions they have all ended.
        ends = st.ends
        j = st.prefix_scan
        m = st.prefix_end
        while j < head:
            if ends[j] > m:
                m = ends[j]
            j += 1
        st.prefix_scan = j
        st.prefix_end = m
        if head >= len(gaps):
            return m
        # Late means later than the plan both relative to this rank's own progress (its
        # hint prefix ended at m; the plan foresees a gap) and in absolute terms (a rank
        # ahead of the plan waits for the planned start). Clocks are exact up to float
        # rounding of sums taken in different orders, hence the tiny slack.
        d = max(m + gaps[head], st.t_start + starts[head])
        return d + 1e-9 * (1.0 + abs(d))

    async def wait_until_ready(self, task: Task, timeout: float | None = None) -> bool:
        st = self._st()
        pos = st.prog.pos.get(task)
        if pos is None or st.started[pos]:
            why = "already ran" if pos is not None else "is not a task of this rank"
            raise PolicyError(
                f"policy {self._s.policy_name!r} on rank {self._s.rank} step {st.step} waits for"
                f" {task!r}, which {why}",
                policy=self._s.policy_name,
                rank=self._s.rank,
                step=st.step,
                task=task,
            )
        now = self._s._now
        deadline = None if timeout is None else now() + timeout
        st.awaited = pos
        try:
            while pos not in self._s._admitted(st):
                left = None if deadline is None else deadline - now()
                if left is not None and left <= 0:
                    return False
                await self._s._wait(f"policy waits for {task}: " + self._s._stall_reason(st), left)
        finally:
            st.awaited = -1
        return True

    def declared_duration(self, task: Task) -> float | None:
        d = self._s.schedule.declared
        return None if d is None else d.of(task)

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        st = self._st()
        return await self._s._wait(
            "policy waits for a change: " + self._s._stall_reason(st), timeout
        )


def deadlock_grid(stages: Sequence[StageLoop], width: int = 8) -> str:
    """The rank x task grid of a deadlocked step: each rank's next unstarted tasks in hint
    order (``*`` marks ready ones) and what the first of them waits for."""
    lines = []
    for s in stages:
        st = s._st
        if st is None:
            lines.append(f"rank {s.rank:>3} | finished")
            continue
        order = st.prog.order
        cells = []
        for pos in range(st.ledger.head, len(order)):
            if st.started[pos]:
                continue
            mark = "*" if st.missing[pos] == 0 else " "
            cells.append(f"{order[pos]!s:>6}{mark}")
            if len(cells) >= width:
                break
        if st.awaited >= 0:
            first = f"policy {s.policy_name} waits for {s._why(st, st.awaited)}"
        else:
            first = next(iter(s.waiting_for(limit=1)), "")
        lines.append(
            f"rank {s.rank:>3} | {' '.join(cells)} | in flight {st.ledger.inflight}/"
            f"{st.ledger.bound} | {first}  <-- WAITING"
        )
    return "\n".join(lines)


def make_deadlock(stages: Sequence[StageLoop], step: int) -> DeadlockError:
    """The ``DeadlockError`` for ``stages`` (all blocked, nothing in flight)."""
    return DeadlockError(
        f"step {step} cannot finish: no task is ready, none is running and no message is in"
        " flight (* = ready but not chosen or not admitted)",
        step=step,
        grid=deadlock_grid(stages),
    )
