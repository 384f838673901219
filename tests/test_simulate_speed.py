"""The simulator's speed work changed nothing it computes.

* Recorded values: 136 steps (random sizes, chunks, placements, hints, policies, workloads,
  noise, latencies, memory; and 8 x 64 / 16 x 128 steps under every policy) simulated before
  the speed work; makespans, per-rank task orders and every task's exact start and end
  must come out bit for bit the same.
* The virtual loop's fast iteration (``VirtualEventLoop._run_once``, no selector poll in a
  closed simulation) against asyncio's own iteration on random steps: identical makespans,
  orders and times.
* The garbage collector is paused while a step is simulated, and restored after.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async.loop._virtual import VirtualEventLoop

pytestmark = pytest.mark.timeout(300)

RECORDED = json.loads((Path(__file__).parent / "data" / "simulate_recorded.json").read_text())


def digest(r: rr.sim.SimResult) -> tuple[str, str]:
    """sha256[:16] of the per-rank orders, and of the orders with exact times."""
    timed = hashlib.sha256()
    for rank in r.executed:
        timed.update(b"|".join(f"{e.task}:{e.start!r}:{e.end!r}".encode() for e in rank))
        timed.update(b"#")
    orders = hashlib.sha256()
    for rank in r.executed:
        orders.update(" ".join(str(e.task) for e in rank).encode())
        orders.update(b"#")
    return orders.hexdigest()[:16], timed.hexdigest()[:16]


def outcome(config: dict[str, Any]) -> list[str]:
    if config.get("policy", "readiness_first") in ("readiness_first", "rf", "readiness"):
        # Recorded under the rule that also ran backwards out of order: ``greedy`` since
        # readiness-first keeps the backwards in the hint's order (tests/loop/test_stage.py).
        config = {**config, "policy": "greedy"}
    if config.get("max_inflight") is None and config.get("memory_factor") is None:
        # Recorded when memory was a count of activations; it is bytes by default since
        # (tests/test_simulate_bytes.py): memory_factor=1.0 is that count bound exactly.
        config = {**config, "memory_factor": 1.0}
    try:
        r = rr.simulate(**config)
    except rr.RRFPError as e:
        return [type(e).__name__]
    return [r.makespan.hex(), *digest(r)]


@pytest.mark.parametrize(
    "row", RECORDED["rows"], ids=[f"row{i}" for i in range(len(RECORDED["rows"]))]
)
def test_simulate_reproduces_the_recorded_steps(row: list[Any]) -> None:
    config, *want = row
    assert outcome(config) == want


POLICIES = ["strict", "readiness_first", "lateness_aware", "backfill"]
HINTS = ["1f1b", "breadth_first_weighted", "backward_first", "interleaved_1f1b", "zb_h1"]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    chunks = draw(st.sampled_from([1, 1, 2]))
    return {
        "stages": draw(st.integers(1, 6)),
        "chunks": chunks,
        "microbatches": draw(st.integers(1, 16)),
        "hint": draw(st.sampled_from(HINTS)),
        "policy": draw(st.sampled_from(POLICIES)),
        "workload": draw(st.sampled_from(["uniform", "text", "multimodal"])),
        "jitter": draw(st.sampled_from([0.0, 0.3])),
        "latency": draw(st.sampled_from([0.0, 1e-3])),
        "memory_factor": draw(st.sampled_from([None, 2.0])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60)
@given(config=configs())
def test_fast_iteration_matches_asyncios_own(config: dict[str, Any]) -> None:
    fast = outcome(config)
    mp = pytest.MonkeyPatch()
    try:
        # asyncio's private loop step (typeshed does not declare it): the reference.
        mp.setattr(VirtualEventLoop, "_run_once", asyncio.SelectorEventLoop._run_once)  # type: ignore[attr-defined]
        full = outcome(config)
    finally:
        mp.undo()
    assert fast == full


def test_the_fast_iteration_runs_in_a_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not vacuous: a simulated step goes through the fast iteration, not asyncio's own.
    # One call of the fast _run_once runs iterations until the next one would need the
    # selector, so the iterations are counted, not the calls.
    counts = {"full": 0}
    loops: list[VirtualEventLoop] = []
    base = asyncio.SelectorEventLoop._run_once  # type: ignore[attr-defined]  # (as above)

    def full(self: Any) -> None:
        counts["full"] += 1
        base(self)

    monkeypatch.setattr(asyncio.SelectorEventLoop, "_run_once", full)
    real_fast = VirtualEventLoop._run_once

    def fast(self: Any) -> None:
        if self not in loops:
            loops.append(self)
        real_fast(self)

    monkeypatch.setattr(VirtualEventLoop, "_run_once", fast)
    rr.simulate(stages=4, microbatches=8)
    assert len(loops) == 1
    assert loops[0].fast_iterations > 50
    assert counts["full"] <= 2  # at most the loop's first and last iterations


def test_collector_paused_while_simulating_and_restored() -> None:
    seen: list[bool] = []

    async def probe(view: rr.ReadyView) -> rr.Task:
        seen.append(gc.isenabled())
        return view.ready[0]

    assert gc.isenabled()
    rr.simulate(stages=2, microbatches=2, policy=probe)
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        rr.simulate(stages=2, microbatches=2)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
    with pytest.raises(rr.PlanError):
        rr.simulate(stages=0, microbatches=2)
    assert gc.isenabled()  # restored on an error too


def oracle_lower_bound(plan: rr.StepPlan, durations: rr.Durations) -> float:
    """``lower_bound`` as it was before the speed work (method lookups per task)."""
    nv, m = plan.num_virtual, plan.microbatches
    bk = plan.backward_kind
    order = [rr.Task(v, "F", i) for v in range(nv) for i in range(m)]
    order += [rr.Task(v, bk, i) for v in reversed(range(nv)) for i in range(m)]
    if plan.split_backward:
        order += [rr.Task(v, "W", i) for v in range(nv) for i in range(m)]
    rank_of = plan.topology.rank_of
    of, latency = durations.of, durations.latency
    head: dict[rr.Task, float] = {}
    for t in order:
        h = 0.0
        for pr in plan.producers(t):
            lat = latency(t) if rank_of(pr.stage) != rank_of(t.stage) else 0.0
            h = max(h, head[pr] + of(pr) + lat)
        head[t] = h
    tail: dict[rr.Task, float] = {}
    for t in reversed(order):
        tl = 0.0
        for c in plan.consumers(t):
            lat = latency(c) if rank_of(c.stage) != rank_of(t.stage) else 0.0
            tl = max(tl, lat + of(c) + tail[c])
        tail[t] = tl
    best = max(head[t] + of(t) + tail[t] for t in order)
    for r in range(plan.stages):
        tasks = plan.tasks_of(r)
        busy = sum(of(t) for t in tasks)
        best = max(best, min(head[t] for t in tasks) + busy + min(tail[t] for t in tasks))
    return best


@settings(max_examples=80)
@given(data=st.data())
def test_lower_bound_matches_the_original(data: st.DataObject) -> None:
    p = data.draw(st.integers(1, 5))
    v = data.draw(st.sampled_from([1, 1, 2, 3]))
    m = data.draw(st.integers(1, 10))
    split = data.draw(st.booleans())
    plan = rr.StepPlan(
        topology=rr.Topology(
            stages=p, chunks=v, placement=data.draw(st.sampled_from(["interleaved", "vshape"]))
        ),
        microbatches=m,
        split_backward=split,
        ordered_weights=split and data.draw(st.booleans()),
    )
    seed = data.draw(st.integers(0, 2**16))
    fw = [[0.5 + ((seed * 31 + i * 7 + j * 13) % 17) / 7 for j in range(m)] for i in range(p * v)]
    d = rr.Durations.from_arrays(plan, fw).perturbed(
        seed=seed,
        jitter=data.draw(st.sampled_from([0.0, 0.3])),
        latency=data.draw(st.sampled_from([0.0, 1e-2])),
        latency_jitter=0.5,
    )
    assert rr.sim.lower_bound(plan, d) == oracle_lower_bound(plan, d)
