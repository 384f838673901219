"""Property tests of the runtime's invariants over random pipelines (hypothesis).

For random P (1-8), V (1-3), M (1-32), hint, policy, workload, jitter, latency and
admission bound, a simulated step must: run every task exactly once, never before its
dependencies (plus message latency), never hold more activations than the bound, finish
(no deadlock), and never beat the lower bound. Invalid hints must be refused before the
step starts.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as st

from rrfp_async import Placement, StepPlan, Topology, simulate
from rrfp_async._memory import position_weights
from rrfp_async._tasks import activation_delta
from rrfp_async.errors import HintError
from rrfp_async.policies import HINTS, make_hint, validate_hint

POLICIES = ["strict", "readiness_first", "lateness_aware", "backfill"]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    p = draw(st.integers(1, 8))
    v = draw(st.integers(1, 3))
    m = draw(st.integers(1, 32))
    placement: Placement = draw(st.sampled_from(["interleaved", "interleaved", "vshape"]))
    split = draw(st.booleans())
    ordered = split and draw(st.booleans())
    plan = StepPlan(
        topology=Topology(stages=p, chunks=v, placement=placement),
        microbatches=m,
        split_backward=split,
        ordered_weights=ordered,
    )
    usable = []
    for name in sorted(HINTS):
        try:
            make_hint(name, plan)
        except HintError:
            continue
        usable.append(name)
    hint = draw(st.sampled_from(usable))
    bound = draw(st.sampled_from(["default", "factor", "explicit"]))
    kw: dict[str, object] = {}
    if bound == "factor":
        kw["memory_factor"] = draw(st.sampled_from([1.0, 1.5, 2.0, 3.0]))
    elif bound == "explicit":
        from rrfp_async.policies import resolve_bounds

        base = resolve_bounds(plan, make_hint(hint, plan))
        kw["max_inflight"] = [b + draw(st.integers(0, 4)) for b in base]
    return dict(
        stages=p,
        chunks=v,
        microbatches=m,
        placement=placement,
        split_backward=split,
        ordered_weights=ordered,
        hint=hint,
        policy=draw(st.sampled_from(POLICIES)),
        workload=draw(st.sampled_from(["uniform", "text", "multimodal"])),
        jitter=draw(st.sampled_from([0.0, 0.1, 0.5])),
        latency=draw(st.sampled_from([0.0, 0.0, 1e-4, 3e-3])),
        latency_jitter=draw(st.sampled_from([0.0, 0.5])),
        straggler_prob=draw(st.sampled_from([0.0, 0.05])),
        seed=draw(st.integers(0, 2**16)),
        **kw,
    )


@given(configs())
def test_step_invariants(cfg: dict[str, object]) -> None:
    res = simulate(**cfg)  # type: ignore[arg-type]
    sched = res.schedule
    assert sched is not None
    plan = sched.plan
    spans = {}
    for r, ex in enumerate(res.executed):
        tasks = [e.task for e in ex]
        # Every task of the rank exactly once.
        assert sorted(tasks) == sorted(plan.tasks_of(r))
        for e in ex:
            assert e.end >= e.start
            spans[e.task] = e
        # One task at a time on a stage.
        for a, b in itertools.pairwise(ex):
            assert b.start >= a.end - 1e-12
        # In-flight activations (recomputed from the execution order) within the bound: a
        # count, or with a byte budget (the simulator's default) bytes.
        c = peak = 0
        for t in tasks:
            c += activation_delta(t.kind)
            peak = max(peak, c)
        assert peak == res.peak_inflight[r] and res.max_inflight[r] == sched.bounds[r]
        if sched.budgets is None:
            assert peak <= sched.bounds[r]
        else:
            assert sched.activation_bytes is not None
            weights = position_weights(tasks, sched.activation_bytes)
            held = list(itertools.accumulate(weights))
            got = res.stats[r].peak_bytes
            assert got is not None and max(0, *held) == got <= sched.budgets[r]
    # Never before a dependency has finished.
    for t, e in spans.items():
        for dep in plan.producers(t):
            assert e.start >= spans[dep].end - 1e-12, (t, dep)
    assert res.makespan >= res.lower_bound * (1 - 1e-9)
    assert 0 < res.efficiency <= 1 + 1e-9


@given(st.integers(1, 4), st.integers(1, 2), st.integers(1, 6), st.randoms(use_true_random=False))
def test_shuffled_hints_are_refused_or_run(p: int, v: int, m: int, rnd: random.Random) -> None:
    """A hint with a random local shuffle is either refused before the step or runs fine."""
    plan = StepPlan(topology=Topology(stages=p, chunks=v), microbatches=m)
    hint = {r: list(o) for r, o in make_hint("looped_bfs", plan).items()}
    r = rnd.randrange(p)
    i, j = sorted(rnd.sample(range(len(hint[r])), 2)) if len(hint[r]) > 1 else (0, 0)
    hint[r][i], hint[r][j] = hint[r][j], hint[r][i]
    try:
        validate_hint(plan, hint)
    except HintError:
        return
    from rrfp_async import Durations, LocalPipeline, StepSchedule
    from rrfp_async.loop import VirtualEventLoop
    from rrfp_async.sim import CostModelExecutor

    sched = StepSchedule.build(plan, hint)
    d = Durations.from_arrays(plan, [[1.0] * m for _ in range(p * v)])
    pipe = LocalPipeline(sched, CostModelExecutor(d), policy="strict")
    loop = VirtualEventLoop()
    try:
        stats = loop.run_until_complete(pipe.run_step(list(range(m))))
    finally:
        loop.close()
    assert [[e.task for e in s.executed] for s in stats] == [list(hint[q]) for q in range(p)]
