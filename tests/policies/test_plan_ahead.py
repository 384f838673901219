"""``PlanAhead``: the next step's schedule built on a worker thread is the inline one."""

from __future__ import annotations

import threading

import pytest

import rrfp_async as rr
from rrfp_async.policies import PlanAhead

pytestmark = pytest.mark.timeout(60)


def _step(seed: int, stages: int = 4, m: int = 16) -> tuple[rr.Durations, rr.ActivationBytes]:
    plan = rr.StepPlan(topology=rr.Topology(stages=stages), microbatches=m)
    wl = rr.make_workload("multimodal", m, virtual_stages=stages, seed=seed)
    nbytes = rr.ActivationBytes.from_sizes(plan, [mb.tokens for mb in wl.microbatches])
    return wl.cost.declared(plan, wl.microbatches), nbytes


WORKERS = ["process", "thread"]


@pytest.mark.parametrize("worker", WORKERS)
def test_the_schedule_built_ahead_is_the_inline_one(worker: str) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=16)
    d0, b0 = _step(0)
    first = rr.StepSchedule.build(plan, "bfw", durations=d0, activation_bytes=b0)
    seeds = range(1, 9)
    with PlanAhead(worker=worker) as ahead:  # type: ignore[arg-type]
        # Each step from the previous step's result (the worker keeps those), then a few
        # from the first again (the process worker let it go by then and gets it again).
        chain, sched = [], first
        for seed in seeds:
            sched = ahead.submit(sched, *_step(seed)).result(timeout=60)
            chain.append(sched)
        again = [ahead.submit(first, *_step(seed)).result(timeout=60) for seed in seeds]
    prev = first
    for seed, s, t in zip(seeds, chain, again, strict=True):
        want = prev.with_durations(*_step(seed))
        assert s.hint == want.hint == t.hint
        assert s.budgets == want.budgets == t.budgets
        assert s.hint != first.hint  # not vacuous: each step got its own plan
        prev = want


@pytest.mark.parametrize("worker", WORKERS)
def test_a_count_schedule_ahead_too(worker: str) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=16)
    d0, _ = _step(0)
    first = rr.StepSchedule.build(plan, "bfw", durations=d0)
    d1, _ = _step(1)
    with PlanAhead(worker=worker) as ahead:  # type: ignore[arg-type]
        got = ahead.submit(first, d1).result(timeout=60)
    assert got.hint == first.with_durations(d1).hint
    assert got.bounds == first.bounds


def test_a_thread_worker_builds_while_the_caller_goes_on() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=16)
    d0, b0 = _step(0)
    first = rr.StepSchedule.build(plan, "bfw", durations=d0, activation_bytes=b0)
    gate = threading.Event()
    seen: list[str] = []

    d1, b1 = _step(1)
    orig = first.with_durations

    def slow(  # the build, held until the caller has gone on
        durations: rr.Durations | None, nbytes: rr.ActivationBytes | None = None
    ) -> object:
        seen.append(threading.current_thread().name)
        assert gate.wait(10)
        return orig(durations, nbytes)

    object.__setattr__(first, "with_durations", slow)
    with PlanAhead(worker="thread") as ahead:
        pending = ahead.submit(first, d1, b1)
        assert not pending.done()  # submit returned while the build waits
        gate.set()
        assert pending.result(timeout=30).hint == orig(d1, b1).hint
    assert seen and seen[0].startswith("rrfp-plan-ahead")
    assert seen[0] != threading.current_thread().name


@pytest.mark.parametrize("worker", WORKERS)
def test_a_build_error_comes_from_result_and_a_closed_planner_refuses(worker: str) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=16)
    d0, b0 = _step(0)
    tight = rr.StepSchedule.build(
        plan, "bfw", durations=d0, activation_bytes=b0, memory_budget=max(b0.rows()[0]) + 1
    )
    d1, b1 = _step(1)
    big = rr.ActivationBytes.from_sizes(plan, [10 * x for x in b1.rows()[0]])
    ahead = PlanAhead(worker=worker)  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="budget"):
        ahead.submit(tight, d1, big).result(timeout=60)
    ahead.close()
    ahead.close()
    with pytest.raises(rr.PlanError, match="closed"):
        ahead.submit(tight, d1, b1)
    with pytest.raises(rr.PlanError, match="StepSchedule"):
        PlanAhead(worker="thread").submit("bfw", d1)  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="'process' or 'thread'"):
        PlanAhead(worker="fork")  # type: ignore[arg-type]
