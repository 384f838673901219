"""Bad input to the planning side (``simulate``, plans, schedules, costs): every one a typed
error that names the argument, and no simulated step that can hang."""

# mypy: disable-error-code="arg-type,list-item,misc"
# (the checker would refuse what this file tests: every bad input of a plan, passed on
# purpose with the wrong type.)

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.loop import VirtualClockStall, VirtualEventLoop
from rrfp_async.loop._virtual import VirtualTimeLimit
from rrfp_async.sim._simulate import MAX_CELLS, MAX_CELLS_PER_RANK

SMALL: dict[str, Any] = {"stages": 3, "microbatches": 4}


@contextmanager
def quickly(limit: float = 5.0) -> Iterator[None]:
    """The block must end (here: fail) well within ``limit`` real seconds."""
    t = time.perf_counter()
    yield
    assert time.perf_counter() - t < limit


def plan(p: int = 2, m: int = 4) -> rr.StepPlan:
    return rr.StepPlan(topology=rr.Topology(stages=p), microbatches=m)


# ----------------------------------------------------------------- 1. no simulated hang


async def never(view: rr.ReadyView) -> rr.Task:
    await asyncio.Event().wait()  # nobody sets it
    raise AssertionError("unreachable")


async def sleeper(view: rr.ReadyView) -> rr.Task:
    while True:  # noqa: ASYNC110 (polling forever is the misbehaviour under test)
        await asyncio.sleep(1)


async def spinner(view: rr.ReadyView) -> rr.Task:
    while True:  # noqa: ASYNC110
        await asyncio.sleep(0)


async def cancels(view: rr.ReadyView) -> rr.Task:
    raise asyncio.CancelledError


class Stubborn:
    """Sleeps forever and swallows its own cancellation."""

    async def __call__(self, view: rr.ReadyView) -> rr.Task:
        while True:
            with suppress(asyncio.CancelledError):
                await asyncio.sleep(1)


def test_policy_awaiting_what_never_happens_is_a_deadlock_naming_it() -> None:
    with quickly(), pytest.raises(rr.DeadlockError) as ei:
        rr.simulate(**SMALL, policy=never)
    msg = str(ei.value)
    assert "rank 0: policy 'never' was called and has not returned: it awaits Event.wait" in msg
    assert "called from never" in msg and "test_bad_input_plan.py" in msg
    assert "rank 1: waiting for 1F0 <- message 0F0 from rank 0" in msg
    assert ei.value.step == 0 and "<-- WAITING" in ei.value.grid


async def test_deadlock_also_when_simulate_runs_inside_a_running_loop() -> None:
    with quickly(), pytest.raises(rr.DeadlockError, match="policy 'never'"):
        rr.simulate(**SMALL, policy=never)


def test_policy_sleeping_forever_meets_the_default_time_limit() -> None:
    with quickly(), pytest.raises(rr.StepTimeoutError) as ei:
        rr.simulate(**SMALL, policy=sleeper)
    msg = str(ei.value)
    assert "ran past time_limit=60 virtual seconds" in msg
    assert "the default: max(60, 100 x the step's serial time" in msg
    assert "policy 'sleeper' was called and has not returned: it awaits sleep" in msg


def test_time_limit_is_an_argument() -> None:
    with quickly(), pytest.raises(rr.StepTimeoutError, match=r"time_limit=5 virtual seconds"):
        rr.simulate(**SMALL, policy=sleeper, time_limit=5)
    # A step that ends in time is not affected by a tight limit.
    r = rr.simulate(**SMALL, time_limit=1.0)
    assert 0 < r.makespan < 1.0
    with pytest.raises(rr.StepTimeoutError, match=r"time_limit=0\.01"):
        rr.simulate(**SMALL, time_limit=0.01)


def test_spinning_policy_meets_the_wall_limit() -> None:
    with quickly(), pytest.raises(rr.StepTimeoutError) as ei:
        rr.simulate(**SMALL, policy=spinner, wall_limit=0.2)
    assert "ran past wall_limit=0.2 real seconds" in str(ei.value)
    assert "policy 'spinner'" in str(ei.value)


def test_policy_that_swallows_its_cancellation_still_ends() -> None:
    with quickly(), pytest.raises(rr.StepTimeoutError, match="policy 'Stubborn'"):
        rr.simulate(**SMALL, policy=Stubborn(), time_limit=5)


@pytest.mark.parametrize("stages", [1, 3])
def test_policy_raising_cancelled_error_is_a_policy_error(stages: int) -> None:
    with quickly(), pytest.raises(rr.errors.PolicyError) as ei:
        rr.simulate(stages=stages, microbatches=4, policy=cancels)
    assert "policy 'cancels' on rank 0 step 0 raised asyncio.CancelledError" in str(ei.value)
    assert (ei.value.policy, ei.value.rank, ei.value.step) == ("cancels", 0, 0)


def test_policy_waiting_for_a_worker_thread_is_no_deadlock() -> None:
    async def threaded(view: rr.ReadyView) -> rr.Task:
        await asyncio.to_thread(time.sleep, 0.01)  # real time, outside the virtual clock
        return view.ready[0]

    assert rr.simulate(stages=2, microbatches=2, policy=threaded).makespan > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"time_limit": 0}, r"time_limit must be > 0.0, got 0.0"),
        ({"time_limit": -1}, r"time_limit must be > 0.0"),
        ({"time_limit": "5"}, r"time_limit must be a number, got '5' \(str\)"),
        ({"time_limit": math.nan}, r"time_limit must be a number, got NaN"),
        ({"wall_limit": 0}, r"wall_limit must be > 0.0"),
        ({"wall_limit": "x"}, r"wall_limit must be a number"),
    ],
)
def test_bad_limits(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        rr.simulate(**SMALL, **kwargs)


def test_no_limits_at_all_is_allowed() -> None:
    r = rr.simulate(**SMALL, time_limit=math.inf, wall_limit=None)
    assert r.makespan == rr.simulate(**SMALL).makespan


def test_virtual_loop_guards() -> None:
    loop = VirtualEventLoop(stall_when_idle=True, stall_timeout=60)

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    try:
        with quickly(1.0), pytest.raises(VirtualClockStall, match="nothing can wake the loop"):
            loop.run_until_complete(stuck())
    finally:
        loop.close()
    assert issubclass(VirtualClockStall, rr.RRFPError)

    loop = VirtualEventLoop(time_limit=10.0)

    async def sleeps() -> None:
        await asyncio.sleep(100)

    try:
        with pytest.raises(VirtualTimeLimit, match=r"time_limit=10\.0") as ei:
            loop.run_until_complete(sleeps())
        assert isinstance(ei.value, rr.StepTimeoutError) and ei.value.limit == "time_limit"
        assert loop.time() == 10.0
    finally:
        loop.close()
    with pytest.raises(rr.PlanError, match=r"wall_limit must be > 0\.0"):
        VirtualEventLoop(wall_limit=-1)


# ----------------------------------------------------------------- 2. size guards


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"stages": 10**6, "microbatches": 10**6},
            rf"stages x chunks x microbatches = 1000000 x 1 x 1000000 = 1000000000000 exceeds"
            rf" the limit of {MAX_CELLS} \(MAX_CELLS\)",
        ),
        (
            {"stages": 1024, "microbatches": 64, "chunks": 4},
            rf"= 262144 exceeds the limit of {MAX_CELLS}",
        ),
        (
            {"stages": 2, "microbatches": 8192},
            rf"chunks x microbatches = 1 x 8192 = 8192 per rank exceeds the limit of"
            rf" {MAX_CELLS_PER_RANK} \(MAX_CELLS_PER_RANK\)",
        ),
    ],
)
def test_size_guard(kwargs: dict[str, Any], match: str) -> None:
    with quickly(1.0), pytest.raises(rr.PlanError, match=match):
        rr.simulate(**kwargs)


# ----------------------------------------------------------------- 3. no silent wrong result

JITTER = r"must be a finite number in \[0, 3.0\] \(MAX_JITTER"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"jitter": 50}, rf"jitter {JITTER}.*got 50 \(int\)"),
        ({"jitter": 3.5}, rf"jitter {JITTER}.*got 3\.5 \(float\)"),
        ({"latency": 1e-3, "latency_jitter": 4}, rf"latency_jitter {JITTER}"),
        (
            {"cost_model": rr.CostModel(default=rr.StageProfile(per_token=1e306))},
            r"the duration of task 0F0 is inf: the cost model's numbers overflow a float",
        ),
        ({"seed": 1.5}, r"seed must be an integer, got 1\.5 \(float\)"),
        ({"seed": "7"}, r"seed must be an integer, got '7' \(str\)"),
    ],
)
def test_values_that_gave_silent_nonsense_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        rr.simulate(**{"stages": 2, "microbatches": 2, **kwargs})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: rr.Microbatch(index=1, tokens=math.nan),
            r"Microbatch.tokens must be an integer, got nan \(float\)",
        ),
        (
            lambda: rr.Microbatch(index=1, patches=math.inf),
            r"Microbatch.patches must be an integer, got inf \(float\)",
        ),
        (
            lambda: rr.CostModel(straggler_prob=0.5, straggler_factor=math.nan),
            r"straggler_factor must be a finite number >= 1, got nan",
        ),
        (lambda: rr.CostModel(straggler_factor=math.inf), r"straggler_factor must be a finite"),
        (lambda: rr.CostModel(jitter=50), rf"CostModel.jitter {JITTER}"),
        (lambda: rr.CostModel(latency_jitter=50), rf"CostModel.latency_jitter {JITTER}"),
    ],
)
def test_sizes_and_costs_that_gave_silent_nonsense_are_refused(make: Any, match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        make()


def test_jitter_range_edges_are_accepted() -> None:
    for j in (0.0, 3.0):
        r = rr.simulate(**SMALL, jitter=j, latency=1e-3, latency_jitter=j)
        assert math.isfinite(r.makespan) and r.makespan > 0
    with pytest.raises(rr.PlanError, match=rf"jitter {JITTER}"):
        rr.make_workload("text", 4, virtual_stages=2, jitter=3.5)
    d = rr.Durations.from_arrays(plan(), [[1.0] * 4] * 2)
    with pytest.raises(rr.PlanError, match=rf"jitter {JITTER}"):
        d.perturbed(seed=0, jitter=50)
    with pytest.raises(rr.PlanError, match="straggler_factor must be a number, got NaN"):
        d.perturbed(seed=0, straggler_prob=0.5, straggler_factor=math.nan)


def test_seed_none_draws_a_fresh_seed_and_reports_it() -> None:
    kw: dict[str, Any] = {**SMALL, "workload": "multimodal", "jitter": 0.3, "latency": 1e-3}
    a = rr.simulate(**kw, seed=None)  # with a latency this used to be a TypeError
    assert isinstance(a.seed, int) and a.to_dict()["seed"] == a.seed
    again = rr.simulate(**kw, seed=a.seed)
    assert again.makespan == a.makespan and again.seed == a.seed
    results = rr.compare(**kw, seed=None)
    seeds = {r.seed for r in results.values()}
    assert len(seeds) == 1  # one fresh seed for every policy compared
    assert rr.simulate(**kw).seed == 0


# ----------------------------------------------------------------- 4. no raw Python error


def _gen_none(p: rr.StepPlan, d: rr.Durations | None) -> Any:
    return None


def _gen_raises(p: rr.StepPlan, d: rr.Durations | None) -> Any:
    raise ValueError("boom")


def _tuple_hint() -> dict[int, list[tuple[int, str, int]]]:
    h = rr.StepSchedule.build(plan(2, 2), "1f1b").hint
    return {r: [tuple(t) for t in order] for r, order in h.items()}  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"microbatches": 2.5}, rr.PlanError, r"microbatches must be an int >= 1 or a non-empty"),
        ({"microbatches": True}, rr.PlanError, r"got True \(bool\)"),
        ({"microbatches": "4"}, rr.PlanError, r"got '4' \(str\)"),
        ({"microbatches": []}, rr.PlanError, r"microbatches must be an int >= 1 or a non-empty"),
        ({"microbatches": [1, 2]}, rr.PlanError, r"microbatches\[0\] must be a Microbatch"),
        ({"microbatches": 0}, rr.PlanError, r"microbatches must be >= 1, got 0"),
        ({"stages": 2.0}, rr.PlanError, r"stages must be an int >= 1, got 2.0 \(float\)"),
        ({"stages": True}, rr.PlanError, r"stages must be an int >= 1, got True \(bool\)"),
        ({"chunks": "2"}, rr.PlanError, r"chunks must be an int >= 1, got '2' \(str\)"),
        ({"hint": None}, rr.errors.HintError, r"hint must be a hint name, a generator .* got None"),
        ({"hint": 123}, rr.errors.HintError, r"hint must be a hint name, .* got 123 \(int\)"),
        (
            {"hint": "tuples"},
            rr.errors.HintError,
            r"rank 0: position 0 is not a Task: \(0, 'F', 0\)",
        ),
        (
            {"hint": {0: "0F0 0F1", 1: "1F0"}},
            rr.errors.HintError,
            r"rank 0: the order must be a seq",
        ),
        ({"hint": {"0": [], 1: []}}, rr.errors.HintError, r"one order per rank 0..1, got ranks"),
        ({"hint": _gen_none}, rr.errors.HintError, r"hint generator '_gen_none' returned None"),
        (
            {"hint": _gen_raises},
            rr.errors.HintError,
            r"hint generator '_gen_raises' raised ValueError",
        ),
        (
            {"max_inflight": 2.5},
            rr.errors.HintError,
            r"max_inflight must be an integer \(every rank\)",
        ),
        (
            {"max_inflight": "3"},
            rr.errors.HintError,
            r"max_inflight must be an integer .* '3' \(str\)",
        ),
        (
            {"max_inflight": math.nan},
            rr.errors.HintError,
            r"max_inflight must be an integer .* nan",
        ),
        ({"max_inflight": True}, rr.errors.HintError, r"max_inflight must be an integer .* True"),
        (
            {"max_inflight": [math.nan, 2]},
            rr.errors.HintError,
            r"max_inflight\[0\] must be an integer",
        ),
        ({"max_inflight": [2, 2.5]}, rr.errors.HintError, r"max_inflight\[1\] must be an integer"),
        (
            {"memory_factor": math.inf},
            rr.errors.HintError,
            r"memory_factor must be finite, got inf",
        ),
        ({"memory_factor": "2"}, rr.errors.HintError, r"memory_factor must be a number, got '2'"),
        (
            {"memory_factor": math.nan},
            rr.errors.HintError,
            r"memory_factor must be a number, got NaN",
        ),
        ({"memory_factor": 0}, rr.errors.HintError, r"memory_factor must be > 0.0, got 0.0"),
        ({"forward": [[1, "x"], [1, 1]]}, rr.PlanError, r"forward\[0\]\[1\] must be a number"),
        ({"forward": [[1, None], [1, 1]]}, rr.PlanError, r"got None \(NoneType\)"),
        ({"forward": [None, [1, 1]]}, rr.PlanError, r"forward\[0\] must be a sequence of"),
        ({"forward": 1}, rr.PlanError, r"forward durations must be a sequence of rows"),
        ({"cost_model": 3}, rr.PlanError, r"cost_model must be a CostModel or None, got 3"),
        ({"workload": 3}, rr.PlanError, r"workload must be a workload name or None, got 3"),
        ({"split_backward": "yes"}, rr.PlanError, r"split_backward must be True or False"),
        ({"ordered_weights": 1}, rr.PlanError, r"ordered_weights must be True or False"),
        ({"record": "no"}, rr.PlanError, r"record must be True or False, got 'no'"),
    ],
)
def test_simulate_refuses_bad_arguments(kwargs: dict[str, Any], err: type, match: str) -> None:
    if kwargs.get("hint") == "tuples":
        kwargs = {**kwargs, "hint": _tuple_hint()}
    args = {"stages": 2, "microbatches": 2, **kwargs}
    with pytest.raises(err, match=match):
        rr.simulate(**args)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: rr.Topology(stages="2"), r"stages must be an int >= 1, got '2' \(str\)"),
        (lambda: rr.StepPlan(topology=None, microbatches=2), r"topology must be a Topology"),
        (
            lambda: rr.StepPlan(topology=rr.Topology(stages=2), microbatches=True),
            r"microbatches must be an int >= 1, got True \(bool\)",
        ),
        (
            lambda: rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2, split_backward=0),
            r"split_backward must be True or False, got 0 \(int\)",
        ),
        (lambda: rr.StepSchedule.build(None), r"plan must be a StepPlan, got None"),
        (
            lambda: rr.StepSchedule.build(
                plan(2, 4), durations=rr.Durations.from_arrays(plan(2, 2), [[1, 1]] * 2)
            ),
            r"durations are for 2 virtual stages x 2 microbatches, the plan has 2 x 4",
        ),
        (lambda: rr.StepSchedule.build(plan(), durations=[[1]]), r"durations must be Durations"),
        (lambda: rr.Durations.from_arrays(plan(), [[1, "a", 1, 1]] * 2), r"forward\[0\]\[1\]"),
        (lambda: rr.Durations({"F": [[1.0]]}), r"need exactly the kinds .* missing \['B', 'I'"),
        (lambda: rr.Durations(None), r"Durations tables must be a mapping"),
        (
            lambda: rr.Durations({k: [[1.0, None]] for k in "FBIW"}),
            r"tables\['F'\]\[0\]\[1\] must be a number, finite and >= 0, got None",
        ),
        (
            lambda: rr.Durations({k: [[1.0]] for k in "FBIW"}, {k: [[1.0, 2.0]] for k in "FBIW"}),
            r"latencies\['F'\]\[0\] needs one duration per microbatch \(1\), got 2",
        ),
        (
            lambda: rr.Durations.from_arrays(plan(), [[1.0] * 4] * 2).perturbed(seed=None),
            r"seed must be an integer, got None",
        ),
        (lambda: rr.make_workload("text", 2.5, virtual_stages=2), r"microbatches must be an int"),
        (lambda: rr.make_workload(3, 2, virtual_stages=2), r"unknown workload 3 \(int\)"),
        (
            lambda: rr.make_workload("text", 2, virtual_stages=2.5),
            r"virtual_stages must be an integer, got 2.5",
        ),
        (lambda: rr.Microbatch(index=0, tokens="3"), r"Microbatch.tokens must be an integer"),
        (lambda: rr.Microbatch(index=-1), r"Microbatch.index must be >= 0, got -1"),
        (lambda: rr.Microbatch(index=0, tokens=2**60), r"Microbatch.tokens must be <= 2\*\*53|<="),
        (lambda: rr.CostModel(profiles=[1]), r"CostModel.profiles\[0\] must be a StageProfile"),
        (lambda: rr.CostModel(profiles="ab"), r"CostModel.profiles must be a sequence"),
        (lambda: rr.StageProfile(fixed="1"), r"StageProfile.fixed must be a number, got '1'"),
        (
            lambda: rr.CostModel().declared(plan(2, 2), [1, 2]),
            r"microbatches\[0\] must be a Microbatch, got 1 \(int\)",
        ),
        (lambda: rr.sim.lower_bound(plan(), None), r"durations must be Durations, got None"),
        (lambda: rr.compare("strict", **SMALL), r"policies must be a sequence of policy names"),
        (lambda: rr.simulate(**SMALL).chrome_trace(), r"record=True"),
    ],
)
def test_plan_and_cost_constructors_refuse_bad_arguments(make: Any, match: str) -> None:
    with pytest.raises(rr.PlanError, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: rr.StepSchedule.build(plan(2, 2), 7), r"hint must be a hint name"),
        (
            lambda: rr.policies.make_hint(7, plan(2, 2)),
            r"a hint generator must be a hint name or a",
        ),
        (lambda: rr.policies.make_hint(_gen_none, plan(2, 2)), r"'_gen_none' returned None"),
        (lambda: rr.policies.validate_hint(plan(2, 2), [[], []]), r"a hint must be a mapping"),
        (
            lambda: rr.policies.validate_hint(plan(2, 1), {0: [rr.Task("0", "F", 0)], 1: []}),  # type: ignore[arg-type]
            r"rank 0: position 0 is a Task with fields of the wrong type: \('0', 'F', 0\)",
        ),
        (lambda: rr.Task.parse(5), r"cannot parse task 5 \(int\)"),
        (lambda: rr.parse_tasks(None), r"parse_tasks needs a string"),
    ],
)
def test_hint_functions_refuse_bad_arguments(make: Any, match: str) -> None:
    with pytest.raises(rr.errors.HintError, match=match):
        make()


def test_valid_variants_still_work() -> None:
    """Nothing valid got rejected: numpy-free lists, tuples, explicit hints, 0-d values."""
    p2 = plan(2, 2)
    hint = rr.StepSchedule.build(p2, "1f1b").hint  # tuples of Tasks per rank
    assert rr.simulate(stages=2, microbatches=2, hint=hint).hint == "custom"
    assert rr.simulate(stages=2, microbatches=2, hint=rr.policies.HINTS["gpipe"]).hint == "gpipe"
    assert rr.simulate(stages=2, microbatches=2, max_inflight=(2, 1)).max_inflight == (2, 1)
    assert rr.simulate(stages=2, microbatches=2, memory_factor=2).max_inflight == (4, 2)
    mbs = rr.make_workload("multimodal", 4, virtual_stages=2, seed=1).microbatches
    assert rr.simulate(stages=2, microbatches=mbs, workload="multimodal").makespan > 0
    d = rr.Durations({k: ((1.0, 2), (0, 3.5)) for k in "FBIW"})
    assert d.of(rr.Task(1, "W", 1)) == 3.5 and d.shape == (2, 2)
