"""One ``TPOptions`` across the entry points: ``StageLoop(tp=)`` and ``LocalPipeline(tp=)``
run as their older flat keywords do, and refuse both said at once (the message names them).
"""

from __future__ import annotations

from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import Task
from rrfp_async.loop import TPOptions
from rrfp_async.sim._sim_tp import tp_executors
from tests._virtual import run_virtual
from tests.loop.test_stall_reasons import _Follower
from tests.loop.test_tp_deduce import _one_stage, _Sink, _starts, _timed

pytestmark = pytest.mark.timeout(60)

_ARRIVALS = [(2.0, "0F0"), (2.1, "0F1"), (3.5, "0B0"), (9.0, "0B1")]


def test_the_options_are_one_class_in_the_loop_and_the_distributed_namespaces() -> None:
    assert rr.distributed.TPOptions is TPOptions


@pytest.mark.parametrize("deduce", [True, False])
def test_stage_loop_tp_runs_as_the_flat_keywords(deduce: bool) -> None:
    # _one_stage gives verify_sequences=False as a flat keyword: give it in tp here.
    flat = _one_stage(_ARRIVALS, deduce_tp=deduce)
    stats_flat, end_flat = run_virtual(_timed(flat))
    one = _stage_with_tp(TPOptions(verify=False, deduce=deduce))
    stats_one, end_one = run_virtual(_timed(one))
    assert one.tp == flat.tp == TPOptions(verify=False, deduce=deduce)
    assert (one.coordinate, one.verify_sequences, one.deduce_tp) == (True, False, deduce)
    assert _starts(stats_one) == _starts(stats_flat) and end_one == end_flat
    assert one.tp_deduced == flat.tp_deduced == (4 if deduce else 0)


def _stage_with_tp(tp: TPOptions | None, **kw: Any) -> rr.StageLoop:
    flat = _one_stage([])  # the same stage, built with tp= instead of the flat keywords
    return rr.StageLoop(
        0,
        schedule=flat.schedule,
        executor=rr.sim.CostModelExecutor(
            rr.Durations.from_arrays(flat.schedule.plan, [[1.0, 1.0]])
        ),
        endpoint=_Sink(),
        coordinator=_Follower([(t, Task.parse(x)) for t, x in _ARRIVALS]),
        tp=tp,
        **kw,
    )


@pytest.mark.parametrize(
    ("flat", "named"),
    [
        ({"deduce_tp": False}, "deduce_tp="),
        ({"coordinate": True, "verify_sequences": False}, "coordinate=, verify_sequences="),
    ],
)
def test_stage_loop_refuses_tp_beside_a_flat_keyword(flat: dict[str, Any], named: str) -> None:
    with pytest.raises(rr.PlanError, match=rf"StageLoop: both tp= and {named} are given"):
        _stage_with_tp(TPOptions(), **flat)


def test_stage_loop_refuses_tp_of_another_type() -> None:
    with pytest.raises(rr.PlanError, match=r"tp must be a TPOptions"):
        _stage_with_tp({"deduce": False})  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match=r"deduce_tp must be True or False"):
        _one_stage([], deduce_tp="no")


def test_local_pipeline_tp_runs_as_deduce_tp_and_refuses_both() -> None:
    # The run itself (a simulated TP step) is compared in tests/test_simulate_tp.py.
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    schedule = rr.StepSchedule.build(plan, "1f1b")
    executor = rr.sim.CostModelExecutor(rr.Durations.from_arrays(plan, [[1.0, 1.0]] * 2))
    options = []
    for kw in ({"deduce_tp": False}, {"tp": TPOptions(deduce=False)}):
        executors, coords = tp_executors(executor, 2, 0.5)
        pipe = rr.LocalPipeline(schedule, executors, coordinators=coords, **kw)
        options.append([s.tp for s in pipe.stages])
    # Simulated TP leaders: they coordinate and compare no sequences, whatever tp says.
    assert options[0] == options[1] == [TPOptions(verify=False, deduce=False)] * 2
    with pytest.raises(rr.PlanError, match=r"LocalPipeline: both tp= and deduce_tp= are given"):
        rr.LocalPipeline(schedule, executor, tp=TPOptions(), deduce_tp=True)
