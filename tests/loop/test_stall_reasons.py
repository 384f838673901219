"""Stall reasons name the actual blocker: one test per reason, from a constructed step state,
and a pipeline whose strict policy's log names the task it holds back, not admission."""

from __future__ import annotations

import asyncio
import bisect
from typing import Any

import pytest
from structlog.testing import capture_logs

import rrfp_async as rr
from rrfp_async import Task
from rrfp_async._admission import AdmissionLedger
from rrfp_async.channels import LocalChannel
from rrfp_async.loop._executors import TaskContext
from rrfp_async.loop._state import NO_DATA, StepState
from rrfp_async.observability import _events as ev
from tests._virtual import run_virtual


def state(p: int, m: int, rank: int, hint: str = "1f1b") -> StepState:
    """The state of ``rank`` when its step starts, built the way ``StageLoop._begin`` does."""
    plan = rr.StepPlan(topology=rr.Topology(stages=p), microbatches=m)
    sched = rr.StepSchedule.build(plan, hint)
    prog = sched.program(rank)
    n = len(prog.order)
    st = StepState(
        step=0,
        plan=plan,
        prog=prog,
        ledger=AdmissionLedger(prog.order, sched.bounds[rank], prog.pos),
        microbatches=list(range(m)),
        ctx=TaskContext(rank, 0, plan, list(range(m))),
        missing=list(prog.deps),
        arrived=bytearray(n),
        started=bytearray(n),
        finished=bytearray(n),
        inbox=[NO_DATA] * n,
        left=n,
    )
    st.ready = [i for i in range(n) if prog.deps[i] == 0]
    return st


def _satisfy(st: StepState, pos: int) -> None:
    st.missing[pos] -= 1
    if st.missing[pos] == 0:
        bisect.insort(st.ready, pos)
    st.version += 1


def arrive(st: StepState, *names: str) -> None:
    """The remote inputs of the tasks ``names`` arrive (as ``StepRun.deliver``)."""
    for name in names:
        pos = st.prog.pos[Task.parse(name)]
        st.arrived[pos] = 1
        _satisfy(st, pos)


def start(st: StepState, name: str) -> int:
    """The task ``name`` starts (as ``TaskRunner.execute`` does before awaiting it)."""
    pos = st.prog.pos[Task.parse(name)]
    assert pos in st.admitted(), f"{name} is not admitted: {st.why(pos)}"
    st.ledger.start_at(pos)
    st.started[pos] = 1
    st.ready.remove(pos)
    st.left -= 1
    st.running = pos
    st.version += 1
    return pos


def run(st: StepState, *names: str) -> None:
    """The tasks ``names`` start and finish, in order."""
    for name in names:
        pos = start(st, name)
        st.running = -1
        st.ledger.finish_at(pos)
        st.finished[pos] = 1
        st.version += 1
        for nxt in st.prog.local_next[pos]:
            _satisfy(st, nxt)


def test_inputs_missing_names_the_message_and_its_rank() -> None:
    st = state(4, 8, 1)  # 1F0 needs 0F0 from rank 0; nothing arrived yet
    reason = st.stall_reason("strict")
    assert reason.startswith("waiting for 1F0 <- message 0F0 from rank 0; 1F1 <- message 0F1")
    assert "admission" not in reason and "policy" not in reason
    # A backward also waits for its own local forward.
    st = state(2, 4, 0)
    run(st, "0F0", "0F1")
    st.ready.clear()  # (0F2 is ready; look at what the backward waits for)
    assert st.why(st.prog.pos[Task.parse("0B0")]) == "0B0 <- message 1B0 from rank 1"


def test_admission_bound_reached_says_the_real_count_and_bound() -> None:
    st = state(4, 8, 0)  # rank 0: bound 4; every forward is ready from the start
    run(st, "0F0", "0F1", "0F2", "0F3")
    reason = st.stall_reason("strict")
    assert reason.startswith(
        "admission bound reached (4/4 in flight): it holds back ready 0F4 0F5 0F6 0F7 until a"
        " backward frees an activation; waiting for 0B0 <- message 1B0 from rank 1"
    ), reason


def test_admission_below_the_bound_says_what_it_keeps_room_for() -> None:
    # Rank 1 (bound 3): only 1F3's input arrived. 1F0..1F2 come first in the hint and
    # would need 3 slots; starting 1F3 first would leave them 2, so it is refused at 0/3.
    st = state(4, 8, 1)
    arrive(st, "1F3")
    pos = st.prog.pos[Task.parse("1F3")]
    assert st.ready == [pos] and not st.admitted()
    reason = st.stall_reason("readiness_first")
    assert reason.startswith(
        "admission holds back ready 1F3: 0/3 in flight and the tasks hinted before 1F3 that"
        " have not started still need 3 more; waiting for 1F0 <- message 0F0 from rank 0"
    ), reason
    assert "bound reached" not in reason
    assert st.why(pos).startswith("1F3 is ready but admission holds it back: 0/3 in flight")


def test_a_policy_waiting_for_the_hinted_task_names_it_and_what_it_holds_back() -> None:
    # The case: rank 2 of 4 (bound 2) under strict, 2F3 hinted next but not arrived,
    # 2B2 ready and admitted. Before: "admission bound reached (1/2 in flight); held back: 2B2".
    st = state(4, 8, 2)
    arrive(st, "2F0", "2F1", "2B0", "2F2", "2B1")
    run(st, "2F0", "2F1", "2B0", "2F2", "2B1")
    arrive(st, "2B2")
    st.awaited = st.prog.pos[Task.parse("2F3")]
    reason = st.stall_reason("strict")
    assert reason == (
        "policy strict waits for 2F3 <- message 1F3 from rank 1 (the next hinted task); it"
        " holds back ready 2B2"
    )
    assert st.ledger.inflight == 1 and "admission" not in reason


def test_a_policy_that_chose_to_wait_says_so() -> None:
    st = state(4, 8, 2)
    arrive(st, "2F0", "2F1", "2B0", "2F2", "2B1")
    run(st, "2F0", "2F1", "2B0", "2F2", "2B1")
    arrive(st, "2B2")
    st.changing = True  # wait_for_change: the policy does not say for what
    assert st.stall_reason("backfill") == (
        "policy backfill chose to wait (for a change of the ready set); it holds back ready 2B2"
    )
    st.ready.clear()  # nothing admitted: then the blocker behind it is named too
    st.version += 1
    reason = st.stall_reason("backfill")
    assert reason.startswith(
        "policy backfill chose to wait (for a change of the ready set); nothing is admitted:"
        " waiting for 2F3 <- message 1F3 from rank 1"
    ), reason


def test_a_policy_that_overran_its_turn_is_named() -> None:
    st = state(4, 8, 2)
    arrive(st, "2F0")
    st.deciding = True  # its coroutine was awaited and has not returned
    assert st.stall_reason("slowpoke") == (
        "policy slowpoke has not returned its choice among ready and admitted 2F0: it"
        " blocks, or awaits something other than the view's waits (wait_until_ready,"
        " wait_for_change); the stage runs nothing until it returns"
    )


def test_a_step_timeout_under_an_overrunning_policy_names_the_policy() -> None:
    # Fails on the old code: the dump said "ready and admitted: 0F0" (as if all were well).
    async def slowpoke(view: rr.ReadyView) -> Task:
        await asyncio.sleep(3600)  # neither wait_until_ready nor wait_for_change
        return view.ready[0]

    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    stage = rr.StageLoop(
        0,
        schedule=rr.StepSchedule.build(plan, "1f1b"),
        executor=rr.sim.CostModelExecutor(rr.Durations.from_arrays(plan, [[1e-3, 1e-3]])),
        endpoint=LocalChannel(1).endpoint(0),
        policy=slowpoke,
        step_timeout=0.2,
    )
    with pytest.raises(rr.StepTimeoutError) as err:
        asyncio.run(stage.run_step([0, 1]))
    text = str(err.value) + "".join(getattr(err.value, "__notes__", []))
    assert "slowpoke has not returned its choice among ready and admitted 0F0" in text, text
    # The policy is the cause, in the first line, with where it was suspended (issue 41 (d)).
    first = str(err.value).splitlines()[0]
    assert first.startswith(
        "rank 0 step 0: the policy 'test_a_step_timeout_under_an_overrunning"
    ), first
    assert "did not return a decision for 0.2 s" in first, first
    assert "slowpoke (test_stall_reasons.py:" in first, first
    assert err.value.policy is not None and err.value.policy.endswith("slowpoke"), err.value.policy


def test_a_step_timeout_outside_the_policy_turn_names_no_policy() -> None:
    class Hang:
        async def execute(self, task: Task, data: object, ctx: rr.TaskContext, /) -> None:
            await asyncio.Event().wait()  # a task that never returns

    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=1)
    stage = rr.StageLoop(
        0,
        schedule=rr.StepSchedule.build(plan, "1f1b"),
        executor=Hang(),
        endpoint=LocalChannel(1).endpoint(0),
        step_timeout=0.2,
    )
    with pytest.raises(rr.StepTimeoutError) as err:
        asyncio.run(stage.run_step([0]))
    assert err.value.policy is None
    assert str(err.value).startswith("rank 0 step 0: no progress to the end of the step"), err.value


def test_a_policy_waiting_on_the_ready_set_for_a_peers_message_is_not_blamed() -> None:
    """Rank 0 of 3 stops in its F1 (a task that never returns): on rank 1, 1B0 is ready and
    admitted but the hinted 1F1 waits for rank 0's message, and readiness_first (which runs a
    backward only in its hinted turn) waits on the ready set. The step waited for rank 0, as
    the hint's own order would: rank 1's policy is not the cause. Red before: rank 1 said
    "the policy 'readiness_first' did not return a decision", and its peers named rank 1's
    policy (issue 41's campaign, seed 2000023)."""

    class StopsAtF1:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        async def execute(self, task: Task, data: object, ctx: rr.TaskContext, /) -> object:
            if self.rank == 0 and task.kind == "F" and task.mb == 1:
                await asyncio.Event().wait()
            await asyncio.sleep(1e-3)
            return 0.0

    plan = rr.StepPlan(topology=rr.Topology(stages=3), microbatches=2)
    sched = rr.StepSchedule.build(plan, "1f1b")
    channel = LocalChannel(3)
    stages = [
        rr.StageLoop(
            r,
            schedule=sched,
            executor=StopsAtF1(r),
            endpoint=channel.endpoint(r),
            policy="readiness_first",
            step_timeout=0.5,
        )
        for r in range(3)
    ]

    async def main() -> list[BaseException | rr.StepStats]:
        return await asyncio.gather(*(s.run_step([0, 1]) for s in stages), return_exceptions=True)

    got = asyncio.run(main())
    e1 = got[1]
    assert isinstance(e1, rr.StepTimeoutError), got
    assert e1.policy is None, e1
    assert str(e1).startswith("rank 1 step 0: no progress to the end of the step"), e1
    assert "ready: 1B0" in str(e1) and "next hinted: 1F1" in str(e1), e1  # (the case)


def test_a_tp_follower_waiting_for_the_leaders_decision_names_the_leader() -> None:
    st = state(2, 4, 0)
    run(st, "0F0")
    st.decisions = 1
    st.leader_wait, st.leader = 1, 4
    reason = st.stall_reason("strict")
    assert reason == "TP follower waits for decision 1 of step 0 from the TP leader (global rank 4)"
    assert "0F1" not in reason  # ready here, but the follower runs only what the leader decides


def test_a_tp_follower_waiting_for_the_decided_task_says_what_it_needs() -> None:
    st = state(2, 4, 0)
    run(st, "0F0", "0F1")
    st.decisions = 2
    st.decided = st.prog.pos[Task.parse("0B0")]
    assert st.stall_reason("strict") == (
        "TP follower waits for 0B0 <- message 1B0 from rank 1 (the TP leader's decision 2)"
    )


def test_a_running_task_is_the_executor() -> None:
    st = state(2, 4, 1)
    arrive(st, "1F0")
    start(st, "1F0")
    assert st.stall_reason("strict") == "1F0 is running (the executor is busy with it)"
    assert st.why(st.prog.pos[Task.parse("1B0")]) == "1B0 <- local 1F0 (running)"


class _Follower:
    """A TP follower's coordinator stand-in: the leader's decisions arrive at given times."""

    is_leader = False
    leader = 7

    def __init__(self, arrivals: list[tuple[float, Task]]) -> None:
        self.arrivals = arrivals
        self.q: asyncio.Queue[Task] = asyncio.Queue()

    def begin_step(self, step: int, decisions: int) -> None:
        loop = asyncio.get_running_loop()
        for t, task in self.arrivals:
            loop.call_at(loop.time() + t, self.q.put_nowait, task)

    def has_decision(self, step: int) -> bool:
        return not self.q.empty()

    def publish(self, step: int, seq: int, task: Task) -> None:
        raise AssertionError("a follower does not publish")

    async def receive(self, step: int, seq: int) -> Task:
        return await self.q.get()

    async def end_step(self) -> None:
        pass

    async def verify_sequence(self, step: int, executed: Any) -> None:
        pass


@pytest.mark.timeout(60)
def test_a_tp_followers_stall_events_say_it_waits_for_the_leader_only_when_it_does() -> None:
    # One stage, GPipe, tasks of 1 s: 0F0 0F1 0B1 0B0 (every input local). Decisions 0 and 1
    # arrive at t=2 (the follower waits), decision 2 at t=3.5 while 0F1 runs (no wait),
    # decision 3 at t=9 (a wait again).
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    s = rr.StepSchedule.build(plan, "gpipe")
    order = list(s.hint[0])
    times = [2.0, 2.0, 3.5, 9.0]
    stage = rr.StageLoop(
        0,
        schedule=s,
        executor=rr.sim.CostModelExecutor(rr.Durations.from_arrays(plan, [[1.0, 1.0]])),
        endpoint=LocalChannel(1).endpoint(0),
        coordinator=_Follower(list(zip(times, order, strict=True))),
        verify_sequences=False,
        observer=rr.LogObserver(),
        deduce_tp=False,  # every input is local: it would deduce them all (test_tp_deduce)
    )
    with capture_logs() as logs:
        run_virtual(stage.run_step([0, 1]))
    stalls = [e["reason"] for e in logs if e["event"] == ev.STALL]
    assert stalls == [
        f"TP follower waits for decision {k} of step 0 from the TP leader (global rank 7)"
        for k in (0, 3)
    ]
    assert [e["task"] for e in logs if e["event"] == ev.TASK_START] == [str(t) for t in order]


@pytest.mark.timeout(60)
def test_a_strict_pipelines_log_names_the_task_it_holds_back_not_admission() -> None:
    """Every ``policy strict waits for X ... holds back ready Y`` line is true: the rank's
    next decision is X, and Y was ready at that decision; none blames admission."""
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=8)
    s = rr.StepSchedule.build(plan, "1f1b")
    # A slow forward: microbatch 3 on rank 0 (5x); the later ranks then have 2B2 ready
    # long before 2F3 and strict waits for 2F3 anyway.
    d = rr.Durations.from_arrays(
        plan, [[5.0 if (v, mb) == (0, 3) else 1.0 for mb in range(8)] for v in range(4)]
    )
    pipe = rr.LocalPipeline(
        s,
        rr.sim.CostModelExecutor(d),
        policy="strict",
        observer=rr.LogObserver(),
        latency=lambda step, task: 0.1,
    )
    with capture_logs() as logs:
        run_virtual(pipe.run_step(list(range(8))))
    waits = [
        (i, e)
        for i, e in enumerate(logs)
        if e["event"] == ev.STALL and e["reason"].startswith("policy strict waits for")
    ]
    held = [(i, e) for i, e in waits if "holds back ready" in e["reason"]]
    assert held, "not vacuous: strict held a ready task back behind a late hinted one"
    for i, e in waits:
        reason = e["reason"]
        assert "admission" not in reason, reason
        awaited = reason.removeprefix("policy strict waits for ").split(" ")[0]
        nxt = next(
            x for x in logs[i + 1 :] if x["event"] == ev.DECISION and x["stage"] == e["stage"]
        )
        assert nxt["task"] == nxt["hinted"] == awaited, (reason, nxt)
        if "holds back ready" in reason:
            back = reason.split("holds back ready ")[1].split()
            assert set(back) <= set(nxt["ready"]) - {awaited}, (reason, nxt)
