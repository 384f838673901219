"""Step-traced logs: decision events, context binding, disabled cost, failure dumps."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from structlog.testing import capture_logs

import rrfp_async as rr
from rrfp_async.observability import _events as ev
from rrfp_async.observability._logging import LogObserver, configure_logging


def test_decision_events_name_ready_sets_and_choices() -> None:
    with capture_logs() as logs:
        rr.simulate(
            stages=2, microbatches=2, hint="gpipe", policy="readiness_first", observer=LogObserver()
        )
    decisions = [e for e in logs if e["event"] == ev.DECISION]
    assert len(decisions) == 8  # one per task
    first = decisions[0]
    assert first["task"] == "0F0" and first["hinted"] == "0F0"
    assert first["ready"] == {"0F0": 0, "0F1": 1}
    assert first["deviation"] is False and first["policy"] == "readiness_first"
    # Rank 1's first decision: only 1F0 has arrived.
    r1 = [e for e in decisions if e["task"].startswith("1")]
    assert r1[0]["task"] == "1F0" and set(r1[0]["ready"]) == {"1F0"}
    names = {e["event"] for e in logs}
    assert {
        ev.STEP_START,
        ev.STEP_END,
        ev.TASK_START,
        ev.TASK_END,
        ev.TASK_READY,
        ev.MESSAGE,
        ev.STALL,
    } <= names
    stalls = [e for e in logs if e["event"] == ev.STALL]
    assert any("message 0F0 from rank 0" in e["reason"] for e in stalls)


def test_deviation_is_logged() -> None:
    fw = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    with capture_logs() as logs:
        rr.simulate(
            stages=2,
            microbatches=4,
            forward=fw,
            hint="1f1b",
            policy="readiness_first",
            memory_factor=2.0,
            observer=LogObserver(),
        )
    devs = [e for e in logs if e["event"] == ev.DECISION and e["deviation"]]
    assert devs, "readiness_first with 2x memory runs forwards ahead of the hint"
    assert all(e["task"] != e["hinted"] and e["task"] in e["ready"] for e in devs)


def test_json_lines_carry_rank_stage_step_task() -> None:
    buf = io.StringIO()
    configure_logging(format="json", level="debug", stream=buf)
    rr.simulate(stages=2, microbatches=1, observer=LogObserver())
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert lines
    for line in lines:
        assert {"rank", "stage", "step", "event", "level", "timestamp"} <= set(line)
    # Every task starts and ends once, logged on its own stage in step 0.
    tasks = {"0F0", "1F0", "1B0", "0B0"}
    for name in (ev.TASK_START, ev.TASK_END):
        events = [x for x in lines if x["event"] == name]
        assert sorted(x["task"] for x in events) == sorted(tasks)
        assert all(rr.Task.parse(x["task"]).stage == x["stage"] == x["rank"] for x in events)
        assert all(x["step"] == 0 for x in events)


def _task_owner(res: rr.sim.SimResult) -> dict[rr.Task, int]:
    assert res.schedule is not None
    return {t: rank for rank, tasks in res.schedule.hint.items() for t in tasks}


@pytest.mark.parametrize(
    ("stages", "chunks", "hint"), [(4, 1, "1f1b"), (2, 2, "interleaved")], ids=["1f1b", "chunks"]
)
def test_task_events_name_their_own_stage_and_the_virtual_clock(
    stages: int, chunks: int, hint: str
) -> None:
    """In one process a message is delivered, and its consumer becomes ready, inside the
    *sending* stage's coroutine, whose bound context names the sender: the events must still
    name the stage they happened on, and say when on the virtual clock."""
    buf = io.StringIO()
    configure_logging(format="json", level="debug", stream=buf)
    res = rr.simulate(
        stages=stages,
        chunks=chunks,
        microbatches=8,
        hint=hint,
        jitter=0.3,
        latency=0.01,
        observer=LogObserver(),
    )
    owner = _task_owner(res)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    task_events = [x for x in lines if "task" in x]
    # Not vacuous: the receive path's events are among them, from every rank.
    assert {ev.MESSAGE, ev.TASK_READY, ev.DECISION, ev.TASK_START, ev.TASK_END} <= {
        x["event"] for x in task_events
    }
    assert {x["stage"] for x in task_events if x["event"] == ev.MESSAGE} == set(range(stages))
    wrong = [x for x in task_events if x["stage"] != owner[rr.Task.parse(x["task"])]]
    assert not wrong, (
        f"{len(wrong)} of {len(task_events)} task events name another stage: {wrong[0]}"
    )
    assert all(x["rank"] == x["stage"] for x in lines)
    # The clock is the simulated one: a task starts and ends when the simulation says.
    assert all(isinstance(x["clock"], float) for x in task_events)
    ran = {e.task: e for ex in res.executed for e in ex}
    for x in task_events:
        if x["event"] == ev.TASK_START:
            assert x["clock"] == ran[rr.Task.parse(x["task"])].start
        elif x["event"] == ev.TASK_END:
            assert x["clock"] == ran[rr.Task.parse(x["task"])].end
    assert max(x["clock"] for x in lines) == pytest.approx(res.makespan)


def test_events_name_their_stage_without_bound_context() -> None:
    """``capture_logs`` merges no context variables: the observer's own keys must suffice."""
    with capture_logs() as logs:
        res = rr.simulate(stages=3, microbatches=4, observer=LogObserver())
    owner = _task_owner(res)
    assert logs
    for e in logs:
        assert {"rank", "stage", "step", "clock"} <= set(e), e
        if "task" in e:
            assert e["stage"] == owner[rr.Task.parse(e["task"])], e


def test_console_format_and_levels() -> None:
    buf = io.StringIO()
    configure_logging(format="console", level="info", stream=buf)
    rr.simulate(stages=2, microbatches=1, observer=LogObserver())
    out = buf.getvalue()
    assert ev.STEP_START in out and ev.STEP_END in out and ev.DECISION not in out
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging(level="loud")
    with pytest.raises(ValueError, match="unknown log format"):
        configure_logging(format="xml")  # type: ignore[arg-type]


def test_disabled_logging_turns_the_observer_off() -> None:
    configure_logging(format="json", level="warning", stream=io.StringIO())
    obs = LogObserver()
    assert obs.active is False
    configure_logging(format="json", level="info", stream=io.StringIO())
    assert obs.active is True


def test_failure_dump_is_logged_and_attached() -> None:
    async def sleepy(view: rr.ReadyView) -> rr.Task:
        await asyncio.sleep(100)
        return view.ready[0]

    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=1)
    sched = rr.StepSchedule.build(plan, "1f1b")
    d = rr.Durations.from_arrays(plan, [[1.0]])
    from rrfp_async.channels import LocalChannel

    stage = rr.StageLoop(
        0,
        schedule=sched,
        executor=rr.sim.CostModelExecutor(d),
        endpoint=LocalChannel(1).endpoint(0),
        policy=sleepy,
        step_timeout=3.0,
        observer=rr.observability.MultiObserver(rr.observability.TraceRecorder(), rr.LogObserver()),
    )
    loop = rr.sim.VirtualEventLoop()
    with capture_logs() as logs:
        try:
            with pytest.raises(rr.StepTimeoutError) as ei:
                loop.run_until_complete(stage.run_step([0]))
        finally:
            loop.close()
    dumps = [e for e in logs if e["event"] == ev.STAGE_DUMP]
    assert len(dumps) == 1 and dumps[0]["log_level"] == "error"
    assert "StepTimeoutError" in dumps[0]["error"] and "ready: 0F0" in dumps[0]["dump"]
    assert any("state of rank 0 when the step failed" in n for n in ei.value.__notes__)
