"""A TP follower deduces the decisions it can (``StageLoop(deduce_tp=True)``, the default):
under a policy that chooses the ready head, the next hinted task when it is ready with local
inputs only starts without waiting for the leader's row; the row is still read and compared.

The leader is a stand-in whose rows arrive at given (virtual) times, so each test says
exactly when a task may start: causality, not wall time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

import rrfp_async as rr
from rrfp_async import Task
from rrfp_async.observability import _events as ev
from tests._virtual import run_virtual
from tests.loop.test_stall_reasons import _Follower

pytestmark = pytest.mark.timeout(60)


class _Sink:
    """An endpoint that drops what the stage sends (the ranks it sends to are not here)."""

    rank = 0
    inflight = 0

    def bind(self, sink: Any) -> None:
        pass

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        pass


def _one_stage(arrivals: list[tuple[float, str]], **kw: Any) -> rr.StageLoop:
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    s = rr.StepSchedule.build(plan, "gpipe")  # 0F0 0F1 0B0 0B1: every input local
    return rr.StageLoop(
        0,
        schedule=s,
        executor=rr.sim.CostModelExecutor(rr.Durations.from_arrays(plan, [[1.0, 1.0]])),
        endpoint=_Sink(),
        coordinator=_Follower([(t, Task.parse(x)) for t, x in arrivals]),
        verify_sequences=False,
        **kw,
    )


def _starts(stats: rr.StepStats) -> dict[str, float]:
    return {str(e.task): e.start for e in stats.executed}


def test_local_inputs_start_without_the_leaders_row_and_every_row_is_read() -> None:
    # Rows at t = 2, 2, 3.5, 9; tasks of 1 s (backwards 2 s). Deduced, the tasks run back to
    # back from 0; the step still ends only once row 3 has arrived (read and compared).
    arrivals = [(2.0, "0F0"), (2.1, "0F1"), (3.5, "0B0"), (9.0, "0B1")]
    stage = _one_stage(arrivals, observer=rr.LogObserver())
    with capture_logs() as logs:
        stats, end = run_virtual(_timed(stage))
    assert _starts(stats) == {"0F0": 0.0, "0F1": 1.0, "0B0": 2.0, "0B1": 4.0}
    assert stage.tp_deduced == stats.tp_deduced == 4
    assert end == 9.0  # the last row was waited for before run_step returned
    assert not [e for e in logs if e["event"] == ev.STALL]
    assert [e["tp_deduced"] for e in logs if e["event"] == ev.STEP_END] == [4]
    # Each row is logged as received when it is read (_confirm), in decision order.
    got = [e for e in logs if e["event"] == ev.TP_DECISION_RECEIVED]
    assert [e["task"] for e in got] == ["0F0", "0F1", "0B0", "0B1"]
    # Without deduction the first task waits for its row (t = 2): not vacuous.
    off = _one_stage(arrivals, deduce_tp=False)
    stats, _ = run_virtual(_timed(off))
    assert _starts(stats)["0F0"] == 2.0 and off.tp_deduced == 0


async def _timed(stage: rr.StageLoop) -> tuple[rr.StepStats, float]:
    st = await stage.run_step([0, 1])
    return st, asyncio.get_running_loop().time()


def test_a_task_with_an_input_message_waits_for_its_decision() -> None:
    # Rank 1 of two (1F1B: 1F0 1B0 1F1 1B1). 1F0 and 1F1 take a message from rank 0 (at
    # t = 0.5): whether it has arrived differs between TP ranks, so they wait for their
    # rows (t = 1 and t = 5). 1B0 and 1B1 have only the local 1F input: deduced, each
    # starts the moment its forward ends, before its row (t = 4.9, t = 20).
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    s = rr.StepSchedule.build(plan, "1f1b")
    assert [str(t) for t in s.hint[1]] == ["1F0", "1B0", "1F1", "1B1"]
    rows = [(1.0, "1F0"), (4.9, "1B0"), (5.0, "1F1"), (20.0, "1B1")]

    def run(deduce: bool) -> tuple[rr.StepStats, float, int]:
        stage = rr.StageLoop(
            1,
            schedule=s,
            executor=rr.sim.CostModelExecutor(rr.Durations.from_arrays(plan, [[1.0] * 2] * 2)),
            endpoint=_Sink(),
            coordinator=_Follower([(t, Task.parse(x)) for t, x in rows]),
            verify_sequences=False,
            deduce_tp=deduce,
        )

        async def main() -> tuple[rr.StepStats, float]:
            loop = asyncio.get_running_loop()
            for mb in range(2):  # rank 0's forwards arrive at t = 0.5
                loop.call_at(0.5, stage.deliver, 0, Task(1, "F", mb), None, 0)
            return await _timed(stage)

        st, end = run_virtual(main())
        return st, end, stage.tp_deduced

    st, end, n = run(True)
    # backwards take 2 s (Durations.from_arrays: backward = 2 x forward)
    assert _starts(st) == {"1F0": 1.0, "1B0": 2.0, "1F1": 5.0, "1B1": 6.0}
    assert n == 2 and end == 20.0
    st, _, n = run(False)
    assert _starts(st) == {"1F0": 1.0, "1B0": 4.9, "1F1": 6.9, "1B1": 20.0} and n == 0


def test_a_leader_row_that_differs_from_the_deduction_is_a_divergence() -> None:
    stage = _one_stage([(2.0, "0F1"), (2.1, "0F0"), (3.5, "0B0"), (9.0, "0B1")])
    with pytest.raises(
        rr.errors.DivergenceError, match=r"deduced decision 0 as 0F0 .* decided 0F1"
    ):
        run_virtual(stage.run_step([0, 1]))


def test_a_policy_that_may_not_choose_the_ready_head_is_not_deduced() -> None:
    async def mine(view: rr.ReadyView) -> Task:  # no chooses_ready_head: may pick any
        return view.ready[0]

    stage = _one_stage([(2.0, "0F0"), (2.1, "0F1"), (3.5, "0B0"), (9.0, "0B1")], policy=mine)
    stats, _ = run_virtual(_timed(stage))
    assert _starts(stats)["0F0"] == 2.0 and stage.tp_deduced == 0
