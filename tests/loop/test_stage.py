"""The stage loop: policies, errors, deadlocks, watchdog, embedding, out-of-order inputs."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import (
    DeadlockError,
    Durations,
    LocalPipeline,
    ReadyView,
    StageLoop,
    StepPlan,
    StepSchedule,
    StepTimeoutError,
    Task,
    TaskContext,
    Topology,
    compare,
)
from rrfp_async.channels import LocalChannel
from rrfp_async.errors import HintError, PolicyError, ProtocolError
from rrfp_async.policies import HINTS
from rrfp_async.sim import CostModelExecutor
from tests._virtual import run_virtual


def sched(p: int = 2, m: int = 4, v: int = 1, hint: str = "1f1b", **kw: Any) -> StepSchedule:
    plan = StepPlan(topology=Topology(stages=p, chunks=v), microbatches=m)
    return StepSchedule.build(plan, hint, **kw)


def unit(s: StepSchedule) -> Durations:
    pl = s.plan
    return Durations.from_arrays(pl, [[1.0] * pl.microbatches for _ in range(pl.num_virtual)])


@pytest.mark.parametrize("name", sorted(HINTS))
def test_zero_variance_lateness_aware_equals_strict(name: str) -> None:
    for p, v, m in itertools.product([1, 2, 4, 5], [1, 2, 3], [1, 3, 4, 8, 16]):
        try:
            r = compare(("strict", "lateness_aware"), stages=p, chunks=v, microbatches=m, hint=name)
        except HintError:
            continue
        assert r["lateness_aware"].makespan == pytest.approx(r["strict"].makespan, rel=1e-12)
        assert r["lateness_aware"].executed == r["strict"].executed or all(
            d == 0 for d in r["lateness_aware"].deviations
        )


def test_backfill_is_never_worse_than_strict_with_zero_variance() -> None:
    for name in ["interleaved", "zb_h1", "bfw", "1f1b"]:
        for p, v, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 8)]:
            try:
                r = compare(("strict", "backfill"), stages=p, chunks=v, microbatches=m, hint=name)
            except HintError:
                continue
            assert r["backfill"].makespan <= r["strict"].makespan * (1 + 1e-9)


def test_strict_runs_the_hint_order_under_jitter() -> None:
    r = compare(("strict",), stages=4, microbatches=8, workload="multimodal", jitter=0.5, seed=3)
    res = r["strict"]
    assert res.schedule is not None
    for rank, ex in enumerate(res.executed):
        assert tuple(e.task for e in ex) == res.schedule.hint[rank]
    assert res.deviations == (0, 0, 0, 0)


def _delayed_f1(policy: str) -> list[rr.StepStats]:
    """P=2, M=4, 1F1B at 2x the 1F1B bound, unit durations declared and realized; only the
    activation message of microbatch 1 (stage 0 -> 1) takes 10 s instead of 0."""
    plan = StepPlan(topology=Topology(stages=2), microbatches=4)
    d = Durations.from_arrays(plan, [[1.0] * 4, [1.0] * 4])
    s = StepSchedule.build(plan, "1f1b", durations=d, memory_factor=2.0)

    def latency(step: int, task: Task) -> float:
        return 10.0 if task == Task(1, "F", 1) else 0.0

    pipe = LocalPipeline(s, CostModelExecutor(d), policy=policy, latency=latency)
    return list(run_virtual(pipe.run_step(list(range(4)))))


def _end(stats: list[rr.StepStats]) -> float:
    return max(x.finished for x in stats) - min(x.started for x in stats)


def test_strict_waits_for_a_delayed_input() -> None:
    stats = _delayed_f1("strict")
    order = [e.task for e in stats[1].executed]
    assert order == rr.parse_tasks("1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3")
    assert stats[1].deviations == 0


def test_greedy_runs_a_later_ready_task_and_its_backward_and_ends_sooner() -> None:
    # The preprint's rule read literally: F1's input is late, F2's is there: run F2 and its
    # backward first.
    strict = _delayed_f1("strict")
    greedy = _delayed_f1("greedy")
    order = [e.task for e in greedy[1].executed]
    assert order.index(Task(1, "F", 2)) < order.index(Task(1, "F", 1))
    assert order.index(Task(1, "B", 2)) < order.index(Task(1, "B", 1))
    assert greedy[1].deviations > 0
    assert _end(greedy) < _end(strict) - 1.0
    assert max(x.peak_inflight for x in greedy) <= max(x.max_inflight for x in greedy)


def test_readiness_first_runs_later_forwards_but_backwards_in_the_hints_order() -> None:
    # F1's input is late: F2 and F3 run ahead of it, but B2 waits for B1 (the hint's order
    # of the backwards); the step never ends later than strict's.
    strict = _delayed_f1("strict")
    rf = _delayed_f1("readiness_first")
    order = [e.task for e in rf[1].executed]
    assert order.index(Task(1, "F", 2)) < order.index(Task(1, "F", 1))
    backwards = [t for t in order if t.kind == "B"]
    assert backwards == sorted(backwards, key=lambda t: t.mb)
    assert rf[1].deviations > 0
    assert _end(rf) <= _end(strict)
    assert max(x.peak_inflight for x in rf) <= max(x.max_inflight for x in rf)


def test_lateness_aware_waits_until_late_then_skips() -> None:
    strict = _delayed_f1("strict")
    la = _delayed_f1("lateness_aware")
    order = [e.task for e in la[1].executed]
    assert order.index(Task(1, "F", 2)) < order.index(Task(1, "F", 1))
    assert _end(la) < _end(strict) - 1.0
    # It waited for the hinted task until its planned start had passed: never earlier than
    # the preprint's rule, which skips at once.
    assert _end(la) >= _end(_delayed_f1("greedy")) - 1e-9


def test_readiness_first_fills_planned_bubbles_that_lateness_aware_keeps() -> None:
    # ZB-H1 with zero variance: the seed's rule runs deferred W tasks and later forwards as
    # soon as they are ready (planned bubbles included), lateness_aware runs the hint.
    r = compare(
        ("strict", "readiness_first", "lateness_aware"),
        stages=4,
        microbatches=8,
        hint="zb_h1",
    )
    assert sum(r["lateness_aware"].deviations) == 0
    assert r["lateness_aware"].makespan == r["strict"].makespan
    assert sum(r["readiness_first"].deviations) > 0
    assert r["readiness_first"].makespan < 0.95 * r["strict"].makespan


class _Recorder:
    """An executor that passes strings along and records what each task received."""

    def __init__(self, seen: dict[Task, Any]) -> None:
        self.seen = seen

    async def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        self.seen[task] = data
        await asyncio.sleep(0.001)
        return f"{task.kind}{task.mb}@{task.stage}"


def test_out_of_order_messages_reach_their_tasks() -> None:
    s = sched(p=2, m=4, hint="gpipe")
    seen: dict[Task, Any] = {}

    def latency(step: int, task: Task) -> float:
        return 0.5 if (task.kind, task.mb) == ("F", 2) else 0.0  # mb 2 overtaken by mb 3

    pipe = LocalPipeline(s, _Recorder(seen), policy="greedy", latency=latency)
    stats = run_virtual(pipe.run_step([f"mb{i}" for i in range(4)]))
    order = [e.task for e in stats[1].executed]
    assert order.index(Task(1, "F", 3)) < order.index(Task(1, "F", 2))
    for i in range(4):
        assert seen[Task(0, "F", i)] == f"mb{i}"
        assert seen[Task(1, "F", i)] == f"F{i}@0"
        assert seen[Task(0, "B", i)] == f"B{i}@1"
        assert seen[Task(1, "B", i)] is None  # the last stage's backward starts from the loss


async def test_runs_inside_any_running_loop_in_real_time() -> None:
    s = sched(p=3, m=6, hint="1f1b")
    d = Durations.from_arrays(s.plan, [[0.001] * 6 for _ in range(3)])
    pipe = LocalPipeline(s, CostModelExecutor(d), policy="readiness_first")
    stats = await pipe.run_step(list(range(6)))
    assert [len(x.executed) for x in stats] == [12, 12, 12]
    stats2 = await pipe.run_step(list(range(6)))
    assert stats2[0].step == 1


def test_policy_errors_name_policy_rank_step_task() -> None:
    async def wrong(view: ReadyView) -> Task:
        return Task(0, "B", 3)  # never ready at the start

    pipe = LocalPipeline(sched(), CostModelExecutor(unit(sched())), policy=wrong)
    with pytest.raises(
        PolicyError,
        match=r"policy '.*wrong' on rank 0 step 0 returned Task\(0B3\), which is not ready",
    ) as ei:
        run_virtual(pipe.run_step(range(4)))  # type: ignore[arg-type]
    assert ei.value.rank == 0 and ei.value.step == 0 and ei.value.task == Task(0, "B", 3)


def test_policy_that_raises_is_wrapped() -> None:
    async def boom(view: ReadyView) -> Task:
        raise KeyError("x")

    pipe = LocalPipeline(sched(), CostModelExecutor(unit(sched())), policy=boom)
    with pytest.raises(PolicyError, match="raised on rank") as ei:
        run_virtual(pipe.run_step(range(4)))  # type: ignore[arg-type]
    assert isinstance(ei.value.__cause__, KeyError)


def test_policy_returning_other_rank_task() -> None:
    async def other(view: ReadyView) -> Task:
        return Task(1, "F", 0) if view.rank == 0 else view.ready[0]

    pipe = LocalPipeline(sched(), CostModelExecutor(unit(sched())), policy=other)
    with pytest.raises(PolicyError, match="is not a task of this rank"):
        run_virtual(pipe.run_step(range(4)))  # type: ignore[arg-type]


def test_non_coroutine_policy_is_refused() -> None:
    def sync_policy(view: ReadyView) -> Task:
        return view.ready[0]

    with pytest.raises(PolicyError, match="must be a coroutine function"):
        LocalPipeline(sched(), CostModelExecutor(unit(sched())), policy=sync_policy)  # type: ignore[arg-type]


def test_deadlock_is_detected_with_a_grid() -> None:
    async def stubborn(view: ReadyView) -> Task:
        # Waits for its microbatch-1 forward before anything else: on rank 1 that needs
        # 0F1, which rank 0 (also stubborn: 0B0 first) never sends.
        want = Task(view.rank, "B", 0) if view.rank == 0 else Task(1, "F", 1)
        await view.wait_until_ready(want)
        return want

    s = sched(p=2, m=2, hint="gpipe")
    pipe = LocalPipeline(s, CostModelExecutor(unit(s)), policy=stubborn)
    with pytest.raises(DeadlockError) as ei:
        run_virtual(pipe.run_step(range(2)))  # type: ignore[arg-type]
    msg = str(ei.value)
    assert "step 0 cannot finish" in msg
    assert "rank   0 |" in msg and "rank   1 |" in msg
    assert "waits for 0B0 <- local 0F0, message 1B0 from rank 1" in msg
    assert "1F0 <- message 0F0 from rank 0" in msg


def test_step_timeout_dumps_state() -> None:
    async def sleepy(view: ReadyView) -> Task:
        await asyncio.sleep(100)
        return view.ready[0]

    s = sched(p=1, m=1)
    stage = StageLoop(
        0,
        schedule=s,
        executor=CostModelExecutor(unit(s)),
        endpoint=LocalChannel(1).endpoint(0),
        policy=sleepy,
        step_timeout=5.0,
    )
    with pytest.raises(StepTimeoutError, match=r"did not return a decision for 5\.0 s") as ei:
        run_virtual(stage.run_step([0]))
    assert "ready: 0F0" in str(ei.value)


def test_protocol_errors() -> None:
    s = sched(p=2, m=2)
    ch = LocalChannel(2)
    stage = StageLoop(1, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=ch.endpoint(1))

    async def main() -> None:
        t = asyncio.ensure_future(stage.run_step([0, 1]))
        await asyncio.sleep(0)
        with pytest.raises(ProtocolError, match="not a task of this rank"):
            stage.deliver(0, Task(0, "F", 0), None, 0)
        with pytest.raises(ProtocolError, match="expected rank 0"):
            stage.deliver(0, Task(1, "F", 0), None, 1)
        stage.deliver(0, Task(1, "F", 0), None, 0)
        with pytest.raises(ProtocolError, match="arrived twice"):
            stage.deliver(0, Task(1, "F", 0), None, 0)
        stage.deliver(0, Task(1, "F", 1), None, 0)
        await t
        with pytest.raises(ProtocolError, match="after that step ended"):
            stage.deliver(0, Task(1, "F", 0), None, 0)

    run_virtual(main())


def test_early_messages_for_the_next_step_are_kept() -> None:
    s = sched(p=2, m=1)
    stage = StageLoop(
        1, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=LocalChannel(2).endpoint(1)
    )
    stage.deliver(0, Task(1, "F", 0), "early", 0)  # before the step starts
    stats = run_virtual(stage.run_step([0]))
    assert [str(e.task) for e in stats.executed] == ["1F0", "1B0"]


def test_fixed_durations_refuse_a_step_of_another_size() -> None:
    s = sched(p=1, m=2)
    stage = StageLoop(
        0, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=LocalChannel(1).endpoint(0)
    )
    with pytest.raises(rr.PlanError, match="fixed durations are for 1 virtual stages x 2"):
        run_virtual(stage.run_step([0, 1, 2]))


def _any_size(step: int, mbs: Any) -> Durations:
    plan = StepPlan(topology=Topology(stages=2), microbatches=len(mbs))
    return Durations.from_arrays(plan, [[1.0] * len(mbs) for _ in range(2)])


@pytest.mark.parametrize("sizes", [[4, 3, 4], [4, 1, 6, 4], [2, 8]])
def test_steps_of_any_size_run_without_rebuilding(sizes: list[int]) -> None:
    s = sched(p=2, m=4)
    pipe = LocalPipeline(s, CostModelExecutor(_any_size))
    for n in sizes:
        stats = run_virtual(pipe.run_step(list(range(n))))
        for st in stats:  # every task of an n-microbatch step, once
            assert sorted(map(str, (e.task for e in st.executed))) == sorted(
                f"{st.rank}{k}{m}" for k in "FB" for m in range(n)
            )
    # the derived schedules are cached on the one the pipeline was built with
    assert s.for_microbatches(3) is s.for_microbatches(3)


def test_max_microbatches_refuses_a_larger_step_without_consuming_it() -> None:
    s = sched(p=2, m=4)
    pipe = LocalPipeline(s, CostModelExecutor(_any_size), max_microbatches=5)
    with pytest.raises(rr.PlanError, match="at most max_microbatches=5 per step, got 6"):
        run_virtual(pipe.run_step(list(range(6))))
    assert [x.step for x in run_virtual(pipe.run_step(list(range(5))))] == [0, 0]


def test_a_ready_made_hint_cannot_be_regenerated_for_another_size() -> None:
    s = sched(p=2, m=2)
    fixed = StepSchedule.build(s.plan, dict(s.hint))
    pipe = LocalPipeline(fixed, CostModelExecutor(_any_size))
    with pytest.raises(rr.PlanError, match="ready-made hint that cannot be regenerated"):
        run_virtual(pipe.run_step([0, 1, 2]))


def test_forward_only_step_runs_forwards_only() -> None:
    s = sched(p=2, m=3)
    pipe = LocalPipeline(s, CostModelExecutor(_any_size))
    stats = run_virtual(pipe.run_step([0, 1, 2], train=False))
    assert [sorted(str(e.task) for e in st.executed) for st in stats] == [
        ["0F0", "0F1", "0F2"],
        ["1F0", "1F1", "1F2"],
    ]
    assert all(st.hint == "forward_only" for st in stats)
    # a training step after it runs the training plan again
    stats = run_virtual(pipe.run_step([0, 1, 2]))
    assert len(stats[0].executed) == 6 and stats[0].hint == "1f1b"


def test_stats_account_busy_and_idle() -> None:
    s = sched(p=2, m=2, hint="1f1b")
    pipe = LocalPipeline(s, CostModelExecutor(unit(s)))
    st0, st1 = run_virtual(pipe.run_step([0, 1]))
    assert st0.busy == pytest.approx(6.0) and st1.busy == pytest.approx(6.0)
    assert st0.elapsed == pytest.approx(st0.busy + st0.idle)
    assert st0.peak_inflight == 2 and st0.max_inflight == 2
    assert st1.policy == "readiness_first" and st1.hint == "1f1b"


def test_a_broken_channel_fails_every_later_step() -> None:
    s = sched(p=2, m=1)
    stage = StageLoop(
        1, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=LocalChannel(2).endpoint(1)
    )
    stage.fail(rr.errors.PeerError("edge rank 0 -> rank 1: connection reset"))  # between steps
    with pytest.raises(rr.errors.PeerError, match="connection reset"):
        run_virtual(stage.run_step([0]))
    with pytest.raises(rr.errors.PeerError, match="connection reset"):
        run_virtual(stage.run_step([0]))


def test_peer_closed_fails_a_waiting_stage() -> None:
    s = sched(p=2, m=2)
    stage = StageLoop(
        1, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=LocalChannel(2).endpoint(1)
    )

    async def main() -> None:
        run = asyncio.ensure_future(stage.run_step([0, 1]))
        stage.deliver(0, Task(1, "F", 0), None, 0)
        await asyncio.sleep(0.5)
        stage.peer_closed(0)
        with pytest.raises(
            rr.errors.PeerError, match=r"rank 0 closed its channel .* 1F1 still waits"
        ):
            await run

    run_virtual(main())


class _LeaderLog:
    """A TP coordinator stand-in for a leader: records each publish and what had ended."""

    is_leader = True

    def __init__(self, ended: list[Task]) -> None:
        self.ended = ended
        self.published: list[tuple[int, Task, int]] = []

    def begin_step(self, step: int, decisions: int) -> None:
        pass

    def publish(self, step: int, seq: int, task: Task) -> None:
        self.published.append((seq, task, len(self.ended)))

    async def receive(self, step: int, seq: int) -> Task:
        raise AssertionError("a leader does not receive")

    async def end_step(self) -> None:
        pass

    async def verify_sequence(self, step: int, executed: Any) -> None:
        pass


class _Ending:
    def __init__(self, ended: list[Task]) -> None:
        self.ended = ended

    async def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        await asyncio.sleep(1.0)
        self.ended.append(task)
        return None


def _leader(s: StepSchedule, executor: Any, policy: Any, coord: _LeaderLog) -> StageLoop:
    """A one-rank stage whose TP coordinator is the recording leader stand-in."""
    return StageLoop(
        0,
        schedule=s,
        executor=executor,
        endpoint=LocalChannel(1).endpoint(0),
        policy=policy,
        coordinator=coord,
    )


@pytest.mark.parametrize("policy", ["strict", "readiness_first", "lateness_aware", "backfill"])
def test_tp_leader_publishes_a_ready_hinted_task_one_task_ahead(policy: str) -> None:
    # One rank, GPipe: every forward is ready from the start and each backward as soon as
    # its forward ended (the last stage's backward starts from the loss), so every task but
    # the first is published while the task before it still runs.
    s = sched(p=1, m=4, hint="gpipe")
    ended: list[Task] = []
    coord = _LeaderLog(ended)
    run_virtual(_leader(s, _Ending(ended), policy, coord).run_step(list(range(4))))
    assert [t for _, t, _ in coord.published] == ended == list(s.hint[0])
    assert [seq for seq, _, _ in coord.published] == list(range(8))
    # (seq, tasks ended when it was published): seq k ahead means k - 1 tasks had ended.
    ahead = [seq for seq, _, n in coord.published if n == seq - 1]
    assert ahead == list(range(1, 8))


def test_a_policy_without_the_mark_is_asked_at_every_dispatch() -> None:
    async def mine(view: ReadyView) -> Task:
        return view.ready[-1]  # the lowest-ranked ready task: no look-ahead may be taken

    s = sched(p=1, m=4, hint="gpipe", memory_factor=4.0)
    ended: list[Task] = []
    coord = _LeaderLog(ended)
    run_virtual(_leader(s, _Ending(ended), mine, coord).run_step(list(range(4))))
    assert all(n == seq for seq, _, n in coord.published)
    assert [t for _, t, _ in coord.published] == ended


class _Instant:
    async def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        if task.mb % 3 == 2:
            await asyncio.sleep(0)  # the look-aheads scheduled meanwhile run only now
        return None  # else it never yields to the loop


def test_look_ahead_never_publishes_twice_with_an_executor_that_rarely_yields() -> None:
    s = sched(p=1, m=6, hint="gpipe")
    coord = _LeaderLog([])
    stats = run_virtual(_leader(s, _Instant(), "readiness_first", coord).run_step(list(range(6))))
    assert [seq for seq, _, _ in coord.published] == list(range(12))
    assert [t for _, t, _ in coord.published] == [e.task for e in stats.executed]


def test_tp_leader_looks_ahead_to_a_task_the_running_one_makes_ready() -> None:
    # One rank, 1F1B: F0 B0 F1 B1 ... Each B only waits for its own F (the running task), each
    # F is ready from the start: every decision but the first goes out one task ahead.
    s = sched(p=1, m=4, hint="1f1b")
    ended: list[Task] = []
    coord = _LeaderLog(ended)
    run_virtual(_leader(s, _Ending(ended), "readiness_first", coord).run_step(list(range(4))))
    assert [t for _, t, _ in coord.published] == ended == list(s.hint[0])
    assert [seq for seq, _, n in coord.published if n == seq - 1] == list(range(1, 8))


class _ThreadEndpoint:
    """An endpoint that may be called from any thread (``threadsafe_send``): records the
    sending thread and delivers on the loop."""

    threadsafe_send = True

    def __init__(self, rank: int, stages: dict[int, StageLoop], log: list[tuple[int, Task]]):
        self._rank = rank
        self.stages = stages
        self.log = log
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def inflight(self) -> int:
        return -1

    def bind(self, sink: Any) -> None:
        pass

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        import threading

        self.log.append((threading.get_ident(), task))
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.stages[dst].deliver, step, task, payload, self._rank)


class _ThreadExecutor:
    """Computes on a worker thread and hands each output to ``output_hook`` there."""

    def __init__(self) -> None:
        self.output_hook: Any = None

    def set_output_hook(self, hook: Any, /) -> None:
        self.output_hook = hook

    async def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        def work() -> str:
            out = f"{task}"
            if self.output_hook is not None:
                self.output_hook(task, out, ctx.step)
            return out

        return await asyncio.to_thread(work)


async def test_outputs_leave_from_the_compute_thread_once() -> None:
    import threading

    s = sched(p=2, m=3, hint="1f1b")
    log: list[tuple[int, Task]] = []
    stages: dict[int, StageLoop] = {}
    endpoints = [_ThreadEndpoint(r, stages, log) for r in range(2)]
    for r in range(2):
        stages[r] = StageLoop(r, schedule=s, executor=_ThreadExecutor(), endpoint=endpoints[r])
    for e in endpoints:
        e.loop = asyncio.get_running_loop()
    await asyncio.wait_for(asyncio.gather(*(st.run_step([0, 1, 2]) for st in stages.values())), 10)
    sent = [t for _, t in log]
    # Every cross-rank input was sent exactly once (rank 0's F outputs, rank 1's B outputs)...
    assert sorted(sent) == sorted(
        [Task(1, "F", m) for m in range(3)] + [Task(0, "B", m) for m in range(3)]
    )
    # ... and none of them from the loop's thread.
    assert all(ident != threading.get_ident() for ident, _ in log)


def test_alternating_sizes_reuse_the_derived_schedules() -> None:
    s = sched(p=2, m=4)
    three = s.for_microbatches(3)
    assert three.for_microbatches(4) is s  # back to the root, not a new schedule
    assert three.for_microbatches(5) is s.for_microbatches(5)
    assert three.plan.microbatches == 3 and three.hint_name == s.hint_name


class _LostFollower(_LeaderLog):
    """A leader whose TP follower is gone: every publish after the first fails."""

    def publish(self, step: int, seq: int, task: Task) -> None:
        if seq >= 1:
            raise rr.errors.PeerError(f"sending decision {seq} ({task}) to TP rank 1 failed")
        super().publish(step, seq, task)


def test_a_look_ahead_publish_that_fails_fails_the_step_not_the_loop() -> None:
    # The look-ahead publish runs as a loop callback (call_soon): its error must end the
    # step through fail(), never reach the loop's exception handler.
    s = sched(p=1, m=4, hint="gpipe")
    ended: list[Task] = []
    handled: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: handled.append(ctx))
        stage = _leader(s, _Ending(ended), "strict", _LostFollower(ended))
        with pytest.raises(
            rr.errors.PeerError, match=r"sending decision 1 \(0F1\) to TP rank 1 failed"
        ):
            await stage.run_step(list(range(4)))

    run_virtual(main())
    assert handled == []
    assert ended == [Task(0, "F", 0)]  # the running task ended; nothing else started


def _peer_step_error(step: int) -> rr.PeerStepError:
    return rr.PeerStepError(
        f"rank 1: step {step} failed on rank 0 (global 0): RuntimeError: boom",
        step=step,
        origin=0,
        cause="RuntimeError: boom",
    )


def test_a_step_that_failed_elsewhere_fails_here_now_later_or_is_recorded() -> None:
    # What the p2p channel's ABORT hands the stage: the running step fails at once; a step
    # not started yet fails when it starts (its early messages dropped), consuming its
    # number; a step that already ended well here is only recorded; the stage stays usable.
    s = sched(p=2, m=2)
    stage = StageLoop(
        1, schedule=s, executor=CostModelExecutor(unit(s)), endpoint=LocalChannel(2).endpoint(1)
    )

    async def step(n: int) -> rr.StepStats:
        run = asyncio.ensure_future(stage.run_step([0, 1]))
        await asyncio.sleep(0)
        for mb in (0, 1):
            stage.deliver(n, Task(1, "F", mb), None, 0)
        return await run

    async def main() -> None:
        run = asyncio.ensure_future(stage.run_step([0, 1]))
        stage.deliver(0, Task(1, "F", 0), None, 0)
        await asyncio.sleep(0.5)
        stage.step_aborted(0, _peer_step_error(0))
        with pytest.raises(rr.PeerStepError, match="step 0 failed on rank 0"):
            await run
        stage.deliver(0, Task(1, "F", 1), None, 0)  # a late message of step 0: dropped
        stage.step_aborted(2, _peer_step_error(2))
        stage.deliver(2, Task(1, "F", 0), None, 0)  # an early message of step 2: dropped
        assert stage.recent is not None
        assert [w for _, w, _ in stage.recent if "dropped" in w] == [
            "dropped (step 0 failed) message from rank 0 for",
            "dropped (step 2 failed) message from rank 0 for",
        ]
        assert (await step(1)).step == 1
        with pytest.raises(rr.PeerStepError, match="step 2 failed on rank 0"):
            await stage.run_step([0, 1])  # fails at once, consuming number 2
        assert (await step(3)).step == 3
        stage.step_aborted(3, _peer_step_error(3))  # ended well here: recorded only
        assert [e.step for e in stage.late_failures] == [3]  # type: ignore[attr-defined]

    run_virtual(main())
