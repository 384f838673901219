"""The virtual clock is exact from 1e-12 s to 1e9 s per task; non-finite or overflowing
latencies, memory factors and costs are refused, never a hang or a raw OverflowError."""

from __future__ import annotations

import asyncio
import math

import pytest

import rrfp_async as rr
from rrfp_async.sim import VirtualEventLoop
from tests._virtual import run_virtual


@pytest.mark.parametrize("d", [1e-12, 1e-9, 1e-6, 1.0, 1e6, 1e9])
def test_simulated_efficiency_is_exact_at_every_scale(d: float) -> None:
    """Before: 1e-12 s tasks reported an efficiency of 2.5 (timers within 1e-9 s ran
    together) and 1e6 s tasks never finished (the clock could not reach the timer)."""
    r = rr.simulate(stages=4, microbatches=8, forward=[[d] * 8] * 4, wall_limit=20)
    assert r.efficiency == pytest.approx(1.0, rel=1e-9)
    assert r.makespan == pytest.approx(r.lower_bound, rel=1e-9)
    ends = [e.end for row in r.executed for e in row]
    assert len(set(ends)) > 8  # tasks really ran one after another


@pytest.mark.parametrize("start", [0.0, 1.0, 2.0**24, 1e9, 1e12])
def test_timers_fire_in_order_at_their_own_time(start: float) -> None:
    loop = VirtualEventLoop(start=start, stall_when_idle=True)
    fired: list[tuple[int, float]] = []
    try:
        for i, delay in enumerate([3e6, 1.0, 2.5e-7, 1e-12, 0.0]):
            loop.call_later(delay, lambda i=i: fired.append((i, loop.time())))  # type: ignore[misc]  # mypy infers no type for a defaulted lambda argument
        loop.call_later(4e6, loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    # Each fires at exactly its own time (start + delay as a float: below the clock's float
    # spacing some coincide), in time order.
    delays = [3e6, 1.0, 2.5e-7, 1e-12, 0.0]
    assert sorted(i for i, _ in fired) == [0, 1, 2, 3, 4]
    assert [t for _, t in fired] == sorted(t for _, t in fired)
    for i, t in fired:
        assert t == start + delays[i]


def test_a_long_sleep_at_a_late_clock_returns() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(3):
            await asyncio.sleep(1e6)
        return loop.time() - t0

    loop = VirtualEventLoop(start=2.0**30, wall_limit=10)
    try:
        assert loop.run_until_complete(main()) == 3e6
    finally:
        loop.close()


async def _step(latency: float) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    s = rr.StepSchedule.build(plan, "1f1b")
    d = rr.Durations.from_arrays(plan, [[0.1, 0.1]] * 2)
    pipe = rr.LocalPipeline(s, rr.sim.CostModelExecutor(d), latency=lambda step, task: latency)
    await pipe.run_step([None, None])


@pytest.mark.parametrize("latency", [math.inf, math.nan, -1.0])
def test_a_latency_that_never_arrives_is_a_plan_error(latency: float) -> None:
    """Before: a latency of inf scheduled the message at t = inf, and the step hung."""
    with pytest.raises(rr.PlanError, match=r"seconds >= 0, got .* a finite number"):
        run_virtual(asyncio.wait_for(_step(latency), 1e6))


@pytest.mark.parametrize(
    ("kw", "err"),
    [
        ({"memory_factor": 1e308}, rr.errors.HintError),
        ({"latency": 1e308}, rr.PlanError),
        ({"forward": [[1e308] * 4] * 2}, rr.PlanError),
        ({"cost_model": rr.CostModel(default=rr.StageProfile(per_token=1e308))}, rr.PlanError),
    ],
)
def test_overflowing_numbers_are_refused(kw: dict[str, object], err: type[Exception]) -> None:
    """Before: raw OverflowErrors."""
    with pytest.raises(err, match="overflow"):
        rr.simulate(stages=2, microbatches=4, **kw)  # type: ignore[arg-type]
