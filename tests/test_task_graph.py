"""``StepPlan.graph`` numbers the tasks for the planning code; it must say exactly what the
plan's per-task methods say, on every kind of plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rrfp_async._tasks import StepPlan, Topology


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    v = draw(st.integers(1, 3))
    forward_only = draw(st.booleans())
    split = not forward_only and draw(st.booleans())
    return StepPlan(
        topology=Topology(
            stages=draw(st.integers(1, 5)),
            chunks=v,
            placement=draw(st.sampled_from(["interleaved", "vshape"])),
        ),
        microbatches=draw(st.integers(1, 7)),
        split_backward=split,
        ordered_weights=split and draw(st.booleans()),
        forward_only=forward_only,
    )


@given(plan=plans())
def test_the_graph_says_what_the_plan_says(plan: StepPlan) -> None:
    g = plan.graph
    assert sorted(g.tasks) == sorted(plan.all_tasks())
    assert len(g.tasks) == plan.num_tasks
    assert all(g.index[t] == n for n, t in enumerate(g.tasks))
    for n, t in enumerate(g.tasks):
        assert g.rank[n] == plan.rank_of(t)
        assert tuple(g.tasks[x] for x in g.producers[n]) == plan.producers(t)
        assert tuple(g.tasks[x] for x in g.consumers[n]) == plan.consumers(t)
        dp, dc = plan.data_producer(t), plan.data_consumer(t)
        assert g.data_producer[n] == (-1 if dp is None else g.index[dp])
        assert g.data_consumer[n] == (-1 if dc is None else g.index[dc])
        assert (n < g.num_forward) == (t.kind == "F")
        assert (g.num_forward <= n < g.num_forward + g.num_backward) == (t.kind in ("B", "I"))
        assert g.kind_base[t.kind] + t.stage * plan.microbatches + t.mb == n
    for r in range(plan.stages):
        assert [g.tasks[n] for n in g.by_rank[r]] == plan.tasks_of(r)


def test_the_graph_is_built_once() -> None:
    plan = StepPlan(topology=Topology(stages=2), microbatches=3)
    assert plan.graph is plan.graph
    # Equal plans are equal whatever they cached.
    assert plan == StepPlan(topology=Topology(stages=2), microbatches=3)
