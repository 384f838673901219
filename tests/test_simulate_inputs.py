"""``simulate`` takes its step as objects beside its keywords: a ``StepSchedule``
(``schedule=``), a ``Workload`` object (``workload=``) and the TP options as one
``TPOptions`` (``tp_options=``). Each runs as the keyword form it replaces (the same
makespan and timeline), and is refused beside a keyword it replaces (the message names it).
"""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.loop import TPOptions
from rrfp_async.sim import SimResult, Workload, simulate

pytestmark = pytest.mark.timeout(60)


def _timeline(r: SimResult) -> list[list[tuple[str, float, float]]]:
    return [[(str(e.task), e.start, e.end) for e in rank] for rank in r.executed]


@pytest.mark.parametrize("deduce", [True, False])
def test_tp_options_run_as_tp_deduce(deduce: bool) -> None:
    kw: dict[str, Any] = {"stages": 4, "microbatches": 8, "tp": 8, "tp_latency": 1e-3}
    flat = simulate(**kw, tp_deduce=deduce)
    one = simulate(**kw, tp_options=TPOptions(deduce=deduce))
    assert one.makespan == flat.makespan and _timeline(one) == _timeline(flat)
    assert one.tp_decisions == flat.tp_decisions


def test_tp_options_are_refused_beside_tp_deduce() -> None:
    with pytest.raises(rr.PlanError, match=r"simulate: both tp_options= and tp_deduce= are"):
        simulate(stages=2, microbatches=4, tp_options=TPOptions(), tp_deduce=True)
    with pytest.raises(rr.PlanError, match=r"tp_options must be a TPOptions"):
        simulate(stages=2, microbatches=4, tp_options=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("hint", "chunks", "split", "bound"),
    [("1f1b", 1, False, 4), ("breadth_first_weighted", 2, False, None), ("zb_h1", 1, True, 6)],
)
def test_a_schedule_runs_as_the_keywords_it_replaces(
    hint: str, chunks: int, split: bool, bound: int | None
) -> None:
    keywords = simulate(stages=4, microbatches=8, chunks=chunks, hint=hint, max_inflight=bound)
    plan = rr.StepPlan(
        topology=rr.Topology(stages=4, chunks=chunks), microbatches=8, split_backward=split
    )
    # The keyword form plans its hint with the declared durations: give them here too.
    declared = keywords.schedule.declared if keywords.schedule is not None else None
    schedule = rr.StepSchedule.build(plan, hint, durations=declared, max_inflight=bound)
    given = simulate(schedule=schedule)
    assert given.schedule is schedule
    assert given.makespan == keywords.makespan and _timeline(given) == _timeline(keywords)
    assert given.max_inflight == keywords.max_inflight and given.hint == keywords.hint
    # The same stages and M may be said again; the schedule's plan is the step's.
    assert simulate(schedule=schedule, stages=4, microbatches=8).makespan == given.makespan


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"chunks": 2}, "chunks="),
        ({"chunks": 1}, "chunks="),
        ({"hint": "1f1b", "max_inflight": 3}, "hint=, max_inflight="),
        ({"memory_factor": 2.0}, "memory_factor="),
        ({"split_backward": False, "ordered_weights": False}, "split_backward=, ordered_weights="),
        ({"placement": "vshape"}, "placement="),
        ({"stages": 3}, "stages="),
    ],
)
def test_a_schedule_is_refused_beside_a_keyword_it_replaces(kw: dict[str, Any], named: str) -> None:
    schedule = rr.StepSchedule.build(rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4))
    with pytest.raises(rr.PlanError, match=rf"schedule= gives .*; {named} given too"):
        simulate(schedule=schedule, **kw)


def test_a_schedule_or_the_sizes_are_needed_and_agree() -> None:
    schedule = rr.StepSchedule.build(rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4))
    with pytest.raises(rr.PlanError, match=r"5 microbatches but the schedule's plan has 4"):
        simulate(schedule=schedule, microbatches=5)
    with pytest.raises(rr.PlanError, match=r"schedule must be a StepSchedule"):
        simulate(schedule=schedule.plan)  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match=r"give stages="):
        simulate(microbatches=4)
    with pytest.raises(rr.PlanError, match=r"give microbatches="):
        simulate(stages=2)


@pytest.mark.parametrize("name", ["uniform", "text", "multimodal"])
def test_a_workload_object_runs_as_its_name(name: str) -> None:
    kw: dict[str, Any] = {"stages": 3, "chunks": 2, "seed": 5, "jitter": 0.1}
    by_name = simulate(**kw, microbatches=6, workload=name)
    wl = rr.make_workload(name, 6, virtual_stages=6, seed=5)
    assert isinstance(wl, Workload)
    by_object = simulate(**kw, workload=wl)  # M is the workload's
    assert by_object.makespan == by_name.makespan
    assert _timeline(by_object) == _timeline(by_name)
    assert simulate(**kw, microbatches=6, workload=wl).makespan == by_name.makespan


def test_a_workload_object_is_refused_beside_other_microbatches() -> None:
    wl = rr.make_workload("text", 4, virtual_stages=2, seed=0)
    with pytest.raises(rr.PlanError, match=r"microbatches=5 but the workload 'text' has 4"):
        simulate(stages=2, microbatches=5, workload=wl)
    with pytest.raises(rr.PlanError, match=r"in the Workload or in microbatches=, not both"):
        simulate(stages=2, microbatches=list(wl.microbatches), workload=wl)
    with pytest.raises(rr.PlanError, match=r"or None, got 3 \(int\); or a Workload"):
        simulate(stages=2, microbatches=4, workload=3)  # type: ignore[arg-type]
