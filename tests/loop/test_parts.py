"""The parts of a stage loop, each constructed alone with its collaborators passed in: the
step history, the running step, the task runner, the sequence check, and the one step
resolution that every entry point uses."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import Task
from rrfp_async._admission import AdmissionLedger
from rrfp_async.loop import resolve_step
from rrfp_async.loop._executors import TaskContext
from rrfp_async.loop._history import StepHistory
from rrfp_async.loop._state import NO_DATA, StepState
from rrfp_async.loop._step_run import StepRun
from rrfp_async.loop._task_runner import TaskRunner
from tests._virtual import run_virtual


def _schedule(p: int = 2, m: int = 2) -> rr.StepSchedule:
    return rr.StepSchedule.build(
        rr.StepPlan(topology=rr.Topology(stages=p), microbatches=m), "1f1b"
    )


def _state(rank: int, p: int = 2, m: int = 2, step: int = 0) -> StepState:
    """The state of ``rank`` when its step starts (as ``StageLoop`` builds it)."""
    sched = _schedule(p, m)
    prog = sched.program(rank)
    n = len(prog.order)
    mbs = list(range(m))
    st = StepState(
        step=step,
        plan=sched.plan,
        prog=prog,
        ledger=AdmissionLedger(prog.order, sched.bounds[rank], prog.pos),
        microbatches=mbs,
        ctx=TaskContext(rank, step, sched.plan, mbs),
        missing=list(prog.deps),
        arrived=bytearray(n),
        started=bytearray(n),
        finished=bytearray(n),
        inbox=[NO_DATA] * n,
        left=n,
    )
    st.ends = [0.0] * n
    st.starts = [0.0] * n
    st.ready = [i for i in range(n) if prog.deps[i] == 0]
    for i in range(n):
        if prog.first_forward[i]:
            st.inbox[i] = mbs[prog.order[i].mb]
    return st


# ---------------------------------------------------------------- StepHistory


def test_the_history_fails_an_aborted_step_when_it_starts_and_drops_its_messages() -> None:
    h = StepHistory(rank=3)
    h.keep_early(2, Task.parse("0F0"), "x", 1)
    err = RuntimeError("elsewhere")
    h.abort(2, err, running=None)  # not started yet: it fails when it starts
    assert h.aborted(2) is err and h.is_dead(2)
    assert h.take_early(2) == []  # its early message was dropped
    h.refuse_rerun(2)  # failed elsewhere first: not refused, it fails
    assert h.start(2) is err and h.next_step == 3
    assert h.late_failures == []


def test_the_history_refuses_a_failed_steps_number_until_it_is_forgotten() -> None:
    h = StepHistory(rank=0)
    assert h.start(0) is None and h.next_step == 1
    h.failed(0)
    with pytest.raises(rr.PlanError, match="rank 0: step 0 failed here before"):
        h.refuse_rerun(0)
    h.forget_failed()
    h.refuse_rerun(0)
    assert not h.is_dead(0)


def test_an_abort_of_a_step_that_ended_well_is_a_late_failure() -> None:
    h = StepHistory(rank=0)
    h.start(0)
    h.start(1)
    late = RuntimeError("late")
    h.abort(0, late, running=1)
    assert h.late_failures == [late] and h.aborted(0) is None
    h.keep_early(5, Task.parse("0F1"), "y", 1)
    assert h.is_ahead(5, running=1) and not h.is_ahead(1, running=1)
    assert h.take_early(5) == [(Task.parse("0F1"), "y", 1)] and h.take_early(5) == []


# ---------------------------------------------------------------- StepRun


class _Monitor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def blocked(self, stage: Any) -> None:
        self.calls.append(("blocked", stage))

    def unblocked(self, stage: Any) -> None:
        self.calls.append(("unblocked", stage))


def test_a_delivered_input_readies_its_task_and_wakes_the_blocked_wait() -> None:
    mon, owner = _Monitor(), object()
    run = StepRun(1, monitor=mon, owner=owner)
    st = _state(rank=1)
    first = Task.parse("1F0")
    pos = st.prog.pos[first]
    assert pos not in st.ready

    async def main() -> bool:
        run.start(st, asyncio.get_running_loop().time)
        asyncio.get_running_loop().call_soon(run.deliver, st, first, "act", 0)
        got = await run.wait(lambda: "nothing yet")
        return got

    assert run_virtual(main()) is True
    assert pos in st.ready and st.inbox[pos] == "act" and st.arrived[pos]
    assert mon.calls == [("blocked", owner), ("unblocked", owner)] and not run.blocked
    with pytest.raises(rr.errors.ProtocolError, match="arrived twice"):
        run.deliver(st, first, "again", 0)
    with pytest.raises(rr.errors.ProtocolError, match="expected rank 0"):
        run.deliver(st, Task.parse("1F1"), "act", 2)


def test_a_failure_ends_the_wait_and_stays_until_the_next_step() -> None:
    run = StepRun(0)
    st = _state(rank=1)
    boom = RuntimeError("boom")

    async def main() -> None:
        run.start(st, asyncio.get_running_loop().time)
        assert await run.wait(lambda: "-", timeout=1.0) is False  # timed: nothing came
        asyncio.get_running_loop().call_soon(run.fail, boom)
        await run.wait(lambda: "-")

    with pytest.raises(RuntimeError, match="boom"):
        run_virtual(main())
    assert run.failure is boom
    assert run.clear_failure() is None  # not a broken channel: the next step starts clean


def test_a_broken_channel_fails_every_later_step() -> None:
    run = StepRun(0)
    broken = rr.errors.ChannelError("the channel broke")
    run.fail(broken)
    assert run.clear_failure() is broken and run.clear_failure() is broken


# ---------------------------------------------------------------- TaskRunner


class _Executor:
    def __init__(self) -> None:
        self.ran: list[tuple[Task, Any]] = []

    async def execute(self, task: Task, data: Any, ctx: Any, /) -> Any:
        self.ran.append((task, data))
        return f"out of {task}"


class _Endpoint:
    """An ``Endpoint`` that records what it sends."""

    rank = 0
    inflight = 0

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, Task, Any]] = []

    def bind(self, sink: Any) -> None:
        pass

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        self.sent.append((dst, step, task, payload))


def test_the_task_runner_runs_a_task_and_hands_its_output_to_the_next_rank() -> None:
    ex, ep = _Executor(), _Endpoint()
    run = StepRun(0)
    runner = TaskRunner(0, executor=ex, endpoint=ep, run=run)
    assert not runner.eager  # a plain executor has no output hook
    st = _state(rank=0, step=4)
    task = Task.parse("0F0")
    pos = st.prog.pos[task]

    async def main() -> None:
        run.start(st, asyncio.get_running_loop().time)
        await runner.execute(st, pos)

    run_virtual(main())
    assert ex.ran == [(task, 0)]  # a first forward reads its microbatch
    assert ep.sent == [(1, 4, Task.parse("1F0"), "out of 0F0")]
    assert st.finished[pos] and st.started[pos] and st.running == -1
    assert [e.task for e in st.executed] == [task] and st.decisions == 1
    assert st.ledger.inflight == 1 and pos not in st.ready and st.left == len(st.prog.order) - 1


def test_a_failing_task_is_no_longer_running() -> None:
    class Failing(_Executor):
        async def execute(self, task: Task, data: Any, ctx: Any, /) -> Any:
            raise ValueError("the task failed")

    run = StepRun(0)
    runner = TaskRunner(0, executor=Failing(), endpoint=_Endpoint(), run=run)
    st = _state(rank=0)

    async def main() -> None:
        run.start(st, asyncio.get_running_loop().time)
        await runner.execute(st, st.prog.pos[Task.parse("0F0")])

    with pytest.raises(ValueError, match="the task failed"):
        run_virtual(main())
    assert st.running == -1 and run.computing() is None


# ---------------------------------------------------------------- resolve_step


def test_resolve_step_derives_a_schedule_for_another_size_and_keeps_the_base() -> None:
    base = _schedule(m=4)
    r = resolve_step("rank 0", base, [0, 1, 2], step=None, schedule=None, train=True, next_step=7)
    assert r.step == 7 and r.schedule.plan.microbatches == 3 and r.base is base
    ev = resolve_step("rank 0", base, [0, 1], step=9, schedule=None, train=False, next_step=7)
    assert ev.step == 9 and ev.schedule.plan.forward_only and ev.base is base
    given = _schedule(m=2)
    r2 = resolve_step("rank 0", base, [0, 1], step=None, schedule=given, train=True, next_step=0)
    assert r2.schedule is given and r2.base is given  # later steps derive from it
    with pytest.raises(rr.PlanError, match="rank 0: microbatches: the per-step schedule has 2"):
        resolve_step("rank 0", base, [0], step=None, schedule=given, train=True, next_step=0)
