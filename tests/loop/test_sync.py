"""``LocalPipeline.run_step_sync``: the async step, run from synchronous code through the
pipeline's own event loop thread (anyio's blocking portal)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async import Task, TaskContext

pytestmark = pytest.mark.timeout(60)


def _portal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "-portal-" in t.name]


class _Echo:
    """Passes ``"<task>@<step>"`` on (after ``delay`` s), records what each task received;
    raises on ``fail_on`` and sleeps ``hang`` s on ``hang_on``."""

    def __init__(
        self,
        delay: float = 0.0,
        fail_on: Task | None = None,
        hang_on: Task | None = None,
        hang: float = 0.0,
    ) -> None:
        self.delay = delay
        self.fail_on = fail_on
        self.hang_on = hang_on
        self.hang = hang
        self.seen: dict[tuple[int, Task], Any] = {}
        self.cancelled: list[Task] = []
        self.loops: set[int] = set()

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        self.loops.add(id(asyncio.get_running_loop()))
        self.seen[(ctx.step, task)] = data
        try:
            await asyncio.sleep(self.hang if task == self.hang_on else self.delay)
        except asyncio.CancelledError:
            self.cancelled.append(task)
            raise
        if task == self.fail_on:
            raise RuntimeError(f"executor fails {task} on purpose")
        return f"{task}@{ctx.step}"


def _pipe(ex: _Echo, **kw: Any) -> rr.LocalPipeline:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=3)
    return rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), ex, policy="strict", **kw)


def test_run_step_sync_runs_the_same_steps_as_the_async_face() -> None:
    before = len(_portal_threads())
    sync_ex, async_ex = _Echo(0.001), _Echo(0.001)
    with _pipe(sync_ex) as pipe:
        got = [pipe.run_step_sync([f"m{i}" for i in range(3)]) for _ in range(3)]
        assert len(_portal_threads()) == before + 1  # one loop thread, reused by every step
    assert pipe._portal is None and len(_portal_threads()) == before  # the with block ended it

    apipe = _pipe(async_ex)

    async def main() -> list[list[rr.StepStats]]:
        return [await apipe.run_step([f"m{i}" for i in range(3)]) for _ in range(3)]

    want = rr.run(main())
    assert [[s.step for s in st] for st in got] == [[0, 0], [1, 1], [2, 2]]
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g, w, strict=True):
            assert [x.task for x in gs.executed] == [x.task for x in ws.executed]
    assert sync_ex.seen == async_ex.seen  # every task got the same input in both faces
    assert len(sync_ex.loops) == 1  # every step ran on the same (the portal's) loop


def test_close_stops_the_loop_thread_and_a_later_call_starts_one() -> None:
    before = len(_portal_threads())
    pipe = _pipe(_Echo())
    pipe.close()  # nothing started yet: a no-op
    assert len(_portal_threads()) == before
    assert [s.step for s in pipe.run_step_sync([0, 1, 2])] == [0, 0]
    assert len(_portal_threads()) == before + 1
    pipe.close()
    pipe.close()  # idempotent
    assert len(_portal_threads()) == before
    assert [s.step for s in pipe.run_step_sync([0, 1, 2])] == [1, 1]
    pipe.close()
    assert len(_portal_threads()) == before


@pytest.mark.parametrize(
    ("make", "call", "error"),
    [
        (lambda: _pipe(_Echo()), ([],), rr.PlanError),  # no microbatches
        (lambda: _pipe(_Echo(fail_on=Task(1, "F", 1))), ([0, 1, 2],), RuntimeError),
        (
            lambda: _pipe(_Echo(hang_on=Task(1, "B", 0), hang=30), step_timeout=0.3),
            ([0, 1, 2],),
            rr.StepTimeoutError,
        ),
    ],
    ids=["plan", "executor", "watchdog"],
)
def test_run_step_sync_raises_the_steps_own_error(make: Any, call: Any, error: type) -> None:
    """The same class as ``await run_step`` raises (never wrapped, never a group), and the
    pipeline runs its next step."""
    pipe = make()
    try:
        with pytest.raises(error) as sync_err:
            pipe.run_step_sync(*call)
        assert type(sync_err.value) is error
        ex = pipe.stages[0].executor
        ex.fail_on = ex.hang_on = None
        assert len(pipe.run_step_sync([0, 1, 2])) == 2  # and the pipeline runs its next step
    finally:
        pipe.close()
    with pytest.raises(error) as async_err:
        rr.run(make().run_step(*call))
    assert type(async_err.value) is type(sync_err.value)
    first = str(sync_err.value).splitlines()[0]
    assert first == str(async_err.value).splitlines()[0]


def test_an_interrupt_while_waiting_cancels_the_step_before_it_propagates() -> None:
    """Ctrl-C in the synchronous caller: the step on the loop thread is cancelled and has
    unwound by the time the KeyboardInterrupt reaches the caller; the next step runs."""
    ex = _Echo(hang_on=Task(1, "F", 0), hang=20)
    pipe = _pipe(ex)
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.run_step_sync([0, 1, 2])
        took = time.monotonic() - t0
        assert ex.cancelled == [Task(1, "F", 0)]  # cancelled there, before we got here
        assert took < 5
        ex.hang_on = None
        assert [s.step for s in pipe.run_step_sync([0, 1, 2])] == [1, 1]
    finally:
        timer.cancel()
        pipe.close()
