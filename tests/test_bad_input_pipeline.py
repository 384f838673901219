"""Bad input to the pipeline runtime is a typed error; a failed step never poisons the next.

Covers ``LocalPipeline`` and ``StageLoop``: failed steps and their late messages, executors,
``run_step`` arguments, concurrent steps, the watchdog's error, constructor arguments.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import PlanError, StepSchedule, Task, TaskContext
from rrfp_async.channels import LocalChannel
from rrfp_async.errors import PolicyError
from rrfp_async.loop._pipeline import unwrap_group
from rrfp_async.policies import get_policy
from tests._virtual import run_virtual


def sched(p: int = 2, m: int = 2, hint: str = "1f1b") -> StepSchedule:
    plan = rr.StepPlan(topology=rr.Topology(stages=p), microbatches=m)
    return StepSchedule.build(plan, hint)


def unit(s: StepSchedule) -> rr.Durations:
    pl = s.plan
    return rr.Durations.from_arrays(pl, [[1.0] * pl.microbatches for _ in range(pl.num_virtual)])


class _Flaky:
    """Passes ``"<task>@<step>"`` on, records what each (step, task) received, takes 1 s per
    task, and raises on ``fail_on`` in step 0."""

    def __init__(self, fail_on: Task | None, channel: LocalChannel | None = None) -> None:
        self.fail_on = fail_on
        self.channel = channel
        self.seen: dict[tuple[int, Task], Any] = {}
        self.inflight_at_failure = -1
        self.tag = ""

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        self.seen[(ctx.step, task)] = data
        await asyncio.sleep(1.0)
        if ctx.step == 0 and task == self.fail_on:
            if self.channel is not None:
                self.inflight_at_failure = self.channel.inflight
            raise RuntimeError(f"executor fails {task} on purpose")
        return f"{task}@{ctx.step}{self.tag}"


def _expected_input(task: Task, step: int, p: int, mbs: list[Any]) -> Any:
    """What ``task`` must receive in ``step`` of a plain P-stage pipeline run by ``_Flaky``."""
    if task.kind == "F":
        return mbs[task.mb] if task.stage == 0 else f"{Task(task.stage - 1, 'F', task.mb)}@{step}"
    if task.stage == p - 1:
        return None  # the last stage's backward starts from the loss
    return f"{Task(task.stage + 1, 'B', task.mb)}@{step}"


# ---------------------------------------------------------------- 1. a failed step recovers


@pytest.mark.timeout(30)
def test_a_failed_step_with_messages_in_flight_does_not_poison_the_next() -> None:
    s = sched(p=3, m=4)
    ex = _Flaky(Task(1, "F", 1))
    pipe = rr.LocalPipeline(s, ex, latency=lambda step, task: 2.5)
    ex.channel = pipe.channel
    mbs = [f"mb{i}" for i in range(4)]

    async def main() -> list[rr.StepStats]:
        with pytest.raises(RuntimeError, match="fails 1F1 on purpose"):
            await pipe.run_step(mbs)
        ex.seen.clear()
        return await pipe.run_step(mbs)

    stats = run_virtual(main())
    assert ex.inflight_at_failure > 0  # the failure left messages in flight (not vacuous)
    assert pipe.channel.dropped > 0 and pipe.channel.inflight == 0
    assert [x.step for x in stats] == [1, 1, 1]
    assert all(len(x.executed) == 8 for x in stats)
    for (step, task), data in ex.seen.items():
        assert step == 1 and data == _expected_input(task, 1, 3, mbs), (task, data)


@pytest.mark.timeout(30)
def test_a_late_message_of_a_failed_step_is_dropped_during_the_next() -> None:
    # Step 0: 0F0's output to rank 1 takes 3 s; 0F1 fails at t=2. Step 1 starts at t=2 and
    # its own 0F0 output reaches rank 1 at t=3, the stale one at t=4, while step 1 runs.
    s = sched(p=2, m=2, hint="gpipe")
    ex = _Flaky(Task(0, "F", 1))

    def latency(step: int, task: Task) -> float:
        return 3.0 if (step, task) == (0, Task(1, "F", 0)) else 0.0

    pipe = rr.LocalPipeline(s, ex, latency=latency)

    async def main() -> list[rr.StepStats]:
        with pytest.raises(RuntimeError, match="on purpose"):
            await pipe.run_step([0, 1])
        return await pipe.run_step([0, 1])

    stats = run_virtual(main())
    assert min(x.finished for x in stats) > 4.0  # the stale message landed inside step 1
    assert pipe.channel.dropped == 1
    assert ex.seen[(1, Task(1, "F", 0))] == "0F0@1"
    assert (0, Task(1, "F", 0)) not in ex.seen


@pytest.mark.timeout(30)
def test_a_bare_stage_whose_step_failed_runs_the_next_and_drops_late_messages() -> None:
    s = sched(p=2, m=2)
    ch = LocalChannel(2)
    ex = _Flaky(Task(1, "F", 0))
    stage = rr.StageLoop(1, schedule=s, executor=ex, endpoint=ch.endpoint(1))
    peer = ch.endpoint(0)  # plays rank 0

    async def main() -> rr.StepStats:
        run0 = asyncio.ensure_future(stage.run_step([0, 1]))
        peer.send(1, 0, Task(1, "F", 0), "a0")
        with pytest.raises(RuntimeError, match="fails 1F0 on purpose"):
            await run0
        peer.send(1, 0, Task(1, "F", 1), "late b0")  # a message of the dead step
        await asyncio.sleep(0)
        run1 = asyncio.ensure_future(stage.run_step([0, 1]))
        peer.send(1, 1, Task(1, "F", 0), "a1")
        await asyncio.sleep(0.5)
        peer.send(1, 0, Task(1, "F", 1), "late b0 again")  # arrives during step 1
        await asyncio.sleep(0.5)
        peer.send(1, 1, Task(1, "F", 1), "b1")
        return await run1

    stats = run_virtual(main())
    assert stats.step == 1 and len(stats.executed) == 4
    assert ex.seen[(1, Task(1, "F", 0))] == "a1" and ex.seen[(1, Task(1, "F", 1))] == "b1"
    assert stage.recent is not None
    assert sum("dropped (step 0 failed)" in what for _, what, _ in stage.recent) == 2
    # Reusing the dead step's number would mix its late messages into the retry.
    with pytest.raises(PlanError, match=r"rank 1: step 0 failed here before"):
        run_virtual(stage.run_step([0, 1], step=0))


@pytest.mark.timeout(30)
def test_a_pipeline_may_rerun_a_failed_step_number() -> None:
    # The pipeline discards its channel's messages after a failure: the same number is safe.
    # 0F1 fails at t=2 while 0F0's output (sent at t=1, 2 s on the way) is in flight; it
    # lands at t=3, during the retry of step 0, and must not pass for the retry's 0F0 output.
    s = sched(p=2, m=2, hint="gpipe")
    ex = _Flaky(Task(0, "F", 1))
    pipe = rr.LocalPipeline(s, ex, latency=lambda step, task: 2.0)
    ex.channel = pipe.channel

    async def main() -> list[rr.StepStats]:
        with pytest.raises(RuntimeError, match="on purpose"):
            await pipe.run_step([0, 1], step=0)
        ex.fail_on, ex.tag = None, " (retry)"
        ex.seen.clear()
        return await pipe.run_step([0, 1], step=0)

    assert [x.step for x in run_virtual(main())] == [0, 0]
    assert ex.inflight_at_failure == 1 and pipe.channel.dropped == 1
    assert ex.seen[(0, Task(1, "F", 0))] == "0F0@0 (retry)"
    assert ex.seen[(0, Task(0, "B", 0))] == "1B0@0 (retry)"


# ---------------------------------------------------------------- 2. executors


class _NoneExecute:
    execute = None


class _NotCallable:
    execute = 5


class _NoExecute:
    async def run(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        return None


class _TwoArgs:
    async def execute(self, task: Task, data: Any) -> Any:
        return None


class _SyncNone:
    def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        return None


@pytest.mark.parametrize(
    ("executor", "match"),
    [
        (_NoneExecute(), r"executor of rank 1 .*_NoneExecute.* has no execute method"),
        (_NotCallable(), r"executor of rank 1 .*_NotCallable.* has execute = 5 \(int\)"),
        (_NoExecute(), r"executor of rank 1 .*_NoExecute.* has no execute method"),
        (None, r"executor of rank 1 None \(NoneType\) has no execute method"),
        (_TwoArgs(), r"executor of rank 1 .*: execute\(task, data\) cannot be called as"),
        (rr.sim.CostModelExecutor, r"rank 1: got the class CostModelExecutor, not an instance"),
    ],
)
def test_an_unusable_executor_is_refused_at_construction(executor: Any, match: str) -> None:
    s = sched()
    good = rr.sim.CostModelExecutor(unit(s))
    with pytest.raises(PlanError, match=match):
        rr.LocalPipeline(s, [good, executor])
    with pytest.raises(PlanError, match=match):
        rr.StageLoop(1, schedule=s, executor=executor, endpoint=LocalChannel(2).endpoint(1))


@pytest.mark.timeout(30)
def test_an_execute_that_returns_no_awaitable_fails_its_step_with_a_plan_error() -> None:
    s = sched()
    pipe = rr.LocalPipeline(s, _SyncNone())
    for _ in range(2):  # every step says so; none hangs or turns into another error
        with pytest.raises(
            PlanError,
            match=r"executor of rank 0 .*_SyncNone.*: execute\(0F0\) in step \d returned None"
            r" \(NoneType\), not an awaitable",
        ):
            run_virtual(pipe.run_step([0, 1]))


def _passes_on(tag: str) -> Callable[..., Awaitable[Any]]:
    async def run(task: Task, data: Any, ctx: TaskContext) -> Any:
        await asyncio.sleep(0.1)
        return tag

    return run


class _Decorated:
    """``async def execute`` under a plain-function decorator (like ``torch.no_grad()``)."""

    @staticmethod
    def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)

        return wrapper

    @_wrap
    async def execute(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        await asyncio.sleep(0.1)
        return "decorated"


class _FutureReturning:
    def execute(self, task: Task, data: Any, ctx: TaskContext) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("future")
        return fut


class _AsyncCall:
    async def __call__(self, task: Task, data: Any, ctx: TaskContext) -> Any:
        return "call"


class _CallableExecute:
    def __init__(self) -> None:
        self.execute = _AsyncCall()


class _PartialExecute:
    def __init__(self) -> None:
        self.execute = functools.partial(_passes_on("partial"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "executor",
    [
        rr.sim.CostModelExecutor(unit(sched())),
        _Decorated(),
        _FutureReturning(),
        _CallableExecute(),
        _PartialExecute(),
    ],
)
def test_valid_executors_are_accepted(executor: Any) -> None:
    stats = run_virtual(rr.LocalPipeline(sched(), executor).run_step([0, 1]))
    assert [len(x.executed) for x in stats] == [4, 4]


# ---------------------------------------------------------------- 3. run_step arguments


def _stage(s: StepSchedule, rank: int = 0, **kw: Any) -> rr.StageLoop:
    return rr.StageLoop(
        rank,
        schedule=s,
        executor=rr.sim.CostModelExecutor(unit(s)),
        endpoint=LocalChannel(s.plan.stages).endpoint(rank),
        **kw,
    )


_BAD_STEP_ARGS: list[tuple[dict[str, Any], str]] = [
    ({"microbatches": []}, r"microbatches: a step needs at least 1 microbatch, got 0"),
    ({"microbatches": 2}, r"microbatches must be a sequence of microbatches .*, got 2 \(int\)"),
    (
        {"schedule": sched(p=2, m=4)},
        r"(a per-step schedule must have the stage's topology .*, got"
        r"|microbatches: the per-step schedule has 4 microbatches, got 2)",
    ),
    ({"schedule": sched(p=3, m=2)}, r"a per-step schedule must have the stage's topology"),
    ({"train": 1}, r"train must be True or False, got 1"),
    ({"schedule": "1f1b"}, r"schedule must be a StepSchedule \(or None\), got '1f1b' \(str\)"),
    ({"step": "1"}, r"step must be an integer, got '1' \(str\)"),
    ({"step": -1}, r"step must be >= 0, got -1"),
    ({"step": 1.5}, r"step must be an integer, got 1.5 \(float\)"),
    # Step numbers travel as int64 (message headers): refused, not an OverflowError later.
    ({"step": 2**63}, r"step must be <= 9223372036854775806, got 9223372036854775808"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kw", "match"), _BAD_STEP_ARGS)
def test_bad_run_step_arguments_of_a_pipeline(kw: dict[str, Any], match: str) -> None:
    s = sched()
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)))
    kw = dict(kw)
    mbs = kw.pop("microbatches", [0, 1])
    with pytest.raises(PlanError, match="run_step: " + match):
        run_virtual(pipe.run_step(mbs, **kw))
    # Nothing was consumed: the next good step is step 0 and runs.
    assert [x.step for x in run_virtual(pipe.run_step([0, 1]))] == [0, 0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kw", "match"), _BAD_STEP_ARGS)
def test_bad_run_step_arguments_of_a_stage(kw: dict[str, Any], match: str) -> None:
    s = sched(p=1)
    stage = _stage(s)
    kw = dict(kw)
    mbs = kw.pop("microbatches", [0, 1])
    with pytest.raises(PlanError, match="rank 0: " + match):
        run_virtual(stage.run_step(mbs, **kw))
    assert stage.schedule is s  # a refused per-step schedule was not installed
    assert run_virtual(stage.run_step([0, 1])).step == 0


@pytest.mark.timeout(30)
def test_a_concurrent_step_of_a_pipeline_is_refused_and_the_running_one_ends_well() -> None:
    s = sched()
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)))

    async def main() -> list[rr.StepStats]:
        first = asyncio.ensure_future(pipe.run_step([0, 1]))
        await asyncio.sleep(0.5)
        with pytest.raises(PlanError, match=r"run_step: step 0 of this pipeline is still running"):
            await pipe.run_step([0, 1])
        return await first

    assert [len(x.executed) for x in run_virtual(main())] == [4, 4]


@pytest.mark.timeout(30)
def test_a_concurrent_step_of_a_stage_is_refused() -> None:
    s = sched(p=1)
    stage = _stage(s)

    async def main() -> rr.StepStats:
        first = asyncio.ensure_future(stage.run_step([0, 1]))
        await asyncio.sleep(0.5)
        with pytest.raises(PlanError, match=r"rank 0: run_step is already running step 0"):
            await stage.run_step([0, 1])
        return await first

    assert len(run_virtual(main()).executed) == 4


# ---------------------------------------------------------------- 4. one error, never a group


@pytest.mark.timeout(30)
def test_a_stuck_policy_under_the_watchdog_raises_one_step_timeout_error() -> None:
    async def stuck(view: rr.ReadyView) -> Task:
        await asyncio.sleep(1000)
        return view.ready[0]

    s = sched(p=3, m=2)
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)), policy=stuck, step_timeout=50)
    try:
        run_virtual(pipe.run_step([0, 1]))
    except rr.StepTimeoutError as e:
        err = e
    else:
        pytest.fail("no StepTimeoutError")
    # The watchdog fired in the policy's turn: the stuck policy is the cause, named first.
    assert str(err).startswith("rank 0 step 0: the policy "), str(err)
    assert ".stuck' did not return a decision for 50.0 s" in str(err).splitlines()[0]
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "also raised: StepTimeoutError: rank 1 step 0" in notes
    assert "also raised: StepTimeoutError: rank 2 step 0" in notes
    # ... and the pipeline runs its next step with a policy that decides.
    pipe.stages[0].policy = pipe.stages[1].policy = pipe.stages[2].policy = get_policy("strict")
    assert [x.step for x in run_virtual(pipe.run_step([0, 1]))] == [1, 1, 1]


def test_unwrap_group_returns_the_first_error_with_the_others_as_notes() -> None:
    a, b = rr.errors.PolicyError("first", policy="p"), rr.errors.ProtocolError("second")
    eg = BaseExceptionGroup("g", [a, ExceptionGroup("inner", [b]), asyncio.CancelledError()])
    root = unwrap_group(eg)
    assert root is a and a.__notes__ == ["also raised: ProtocolError: second"]
    cancelled = asyncio.CancelledError()
    assert unwrap_group(BaseExceptionGroup("g", [cancelled])) is cancelled


# ---------------------------------------------------------------- 5. constructor arguments


def _sync_policy(view: rr.ReadyView) -> Task:
    return view.ready[0]


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"step_timeout": -1}, PlanError, r"step_timeout must be > 0.0, got -1.0"),
        ({"step_timeout": 0}, PlanError, r"step_timeout must be > 0.0, got 0.0"),
        ({"step_timeout": math.nan}, PlanError, r"step_timeout must be a number, got NaN"),
        ({"step_timeout": "5"}, PlanError, r"step_timeout must be a number, got '5' \(str\)"),
        ({"step_timeout": True}, PlanError, r"step_timeout must be a number, got True \(bool\)"),
        ({"policy": 5}, PolicyError, r"policy 'int' must be a coroutine function"),
        ({"policy": None}, PolicyError, r"must be a coroutine function"),
        ({"policy": _sync_policy}, PolicyError, r"policy '_sync_policy' must be a coroutine"),
        ({"policy": "no_such_policy"}, PolicyError, r"unknown policy 'no_such_policy'"),
        ({"latency": 5}, PlanError, r"latency must be a function \(step, task\) -> seconds"),
    ],
)
def test_bad_pipeline_arguments(kw: dict[str, Any], error: type[Exception], match: str) -> None:
    s = sched()
    with pytest.raises(error, match=match):
        rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)), **kw)


@pytest.mark.parametrize(
    ("rank", "kw", "match"),
    [
        ("0", {}, r"rank must be an integer, got '0' \(str\)"),
        (1.0, {}, r"rank must be an integer, got 1.0 \(float\)"),
        (None, {}, r"rank must be an integer, got None"),
        (2, {}, r"rank must be <= 1, got 2"),
        (-1, {}, r"rank must be >= 0, got -1"),
        (0, {"flight_recorder": -1}, r"flight_recorder must be >= 0, got -1"),
        (0, {"flight_recorder": "x"}, r"flight_recorder must be an integer, got 'x' \(str\)"),
        (0, {"step_timeout": -2.5}, r"step_timeout must be > 0.0, got -2.5"),
        (0, {"step_timeout": math.nan}, r"step_timeout must be a number, got NaN"),
        (0, {"schedule": "1f1b"}, r"schedule must be a StepSchedule, got '1f1b' \(str\)"),
        (0, {"endpoint": object()}, r"endpoint of rank 0 .* has no bind method"),
        (0, {"coordinate": "no"}, r"coordinate must be True or False, got 'no' \(str\)"),
        (0, {"verify_sequences": 1}, r"verify_sequences must be True or False, got 1 \(int\)"),
        (0, {"deduce_tp": None}, r"deduce_tp must be True or False, got None"),
    ],
)
def test_bad_stage_arguments(rank: Any, kw: dict[str, Any], match: str) -> None:
    s = sched()
    args: dict[str, Any] = {
        "schedule": s,
        "executor": rr.sim.CostModelExecutor(unit(s)),
        "endpoint": LocalChannel(2).endpoint(0),
    }
    args.update(kw)
    with pytest.raises(PlanError, match=match):
        rr.StageLoop(rank, **args)


def test_bad_pipeline_schedule_and_executor_list() -> None:
    s = sched(p=3)
    ex = rr.sim.CostModelExecutor(unit(s))
    with pytest.raises(PlanError, match=r"schedule must be a StepSchedule, got '1f1b' \(str\)"):
        rr.LocalPipeline("1f1b", ex)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"need one executor per rank \(3\), got a sequence of 2"):
        rr.LocalPipeline(s, [ex, ex])


def test_an_infinite_step_timeout_means_no_watchdog() -> None:
    s = sched()
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)), step_timeout=math.inf)
    assert all(st.step_timeout is None for st in pipe.stages)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("delay", "shown"),
    [
        (-1.0, r"-1.0 \(float\)"),
        (math.nan, r"nan \(float\)"),
        (math.inf, r"inf \(float\)"),
        ("1", r"'1' \(str\)"),
    ],
)
def test_a_latency_that_is_no_duration_fails_the_step_and_the_pipeline_recovers(
    delay: Any, shown: str
) -> None:
    s = sched()
    bad = [True]

    def latency(step: int, task: Task) -> Any:
        return delay if bad[0] else 0.5

    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(unit(s)), latency=latency)
    with pytest.raises(
        PlanError, match=rf"latency\(0, 1F0\) must return seconds >= 0, got {shown} \(rank 0"
    ):
        run_virtual(pipe.run_step([0, 1]))
    bad[0] = False
    assert [x.step for x in run_virtual(pipe.run_step([0, 1]))] == [1, 1]


@pytest.mark.timeout(30)
def test_a_policy_raising_cancelled_error_is_a_policy_error_in_real_time() -> None:
    """Not a cancellation of the step: a PolicyError at once, not a wait for the watchdog."""

    async def cancels(view: rr.ReadyView) -> Task:
        raise asyncio.CancelledError

    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    s = StepSchedule.build(plan, "1f1b")
    d = rr.Durations.from_arrays(plan, [[0.001] * 2] * 2)
    pipe = rr.LocalPipeline(
        s, [rr.sim.CostModelExecutor(d) for _ in range(2)], policy=cancels, step_timeout=20
    )
    with pytest.raises(PolicyError, match=r"raised asyncio\.CancelledError") as ei:
        rr.run(pipe.run_step([0, 1]))
    assert ei.value.rank == 0 and str(ei.value.policy).endswith("cancels")
    # and the step is still cancellable from outside: that stays a CancelledError
    pipe2 = rr.LocalPipeline(s, [rr.sim.CostModelExecutor(d) for _ in range(2)], step_timeout=20)

    async def cancel_outside() -> None:
        run = asyncio.ensure_future(pipe2.run_step([0, 1]))
        await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    rr.run(cancel_outside())
