"""A step cancelled while a task computes on the compute thread waits for that task before
``run_step`` raises, so that none of its gradient lands after the caller's ``zero_grad``.

Stage 0's backward blocks (on its compute thread) until the test releases it, a while after
the step was cancelled. Asserted by causality: when ``run_step`` has raised, the backward has
ended (its gradient is there), and after ``zero_grad`` nothing of the cancelled step arrives.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest
import torch
from torch import nn

import rrfp_async as rr

pytestmark = pytest.mark.timeout(60)

M = 2


class _Gate(torch.autograd.Function):
    """Identity whose backward tells it started, then blocks until released."""

    started = threading.Event()
    release = threading.Event()
    ended = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Gate.started.set()
        assert _Gate.release.wait(30), "never released"
        _Gate.ended.set()
        return g


class _Stage0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On the backward path the gate runs first and blocks (the first backward of the
        # step, 0B0: the step is cancelled there); the Linear's gradient follows its release.
        return _Gate.apply(self.lin(x))  # type: ignore[no-any-return]


def _loss(out: torch.Tensor, mb: Any) -> torch.Tensor:
    return out.pow(2).mean()


def _setup() -> tuple[rr.LocalPipeline, list[rr.TorchStageExecutor], nn.Module, list[Any]]:
    torch.manual_seed(0)
    s0, s1 = _Stage0(), nn.Linear(4, 1)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=M)
    execs = [
        rr.TorchStageExecutor({0: s0}, rank=0, input_fn=lambda mb: mb),
        rr.TorchStageExecutor({1: s1}, _loss, rank=1),
    ]
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs)
    return pipe, execs, s0, [torch.randn(3, 4) for _ in range(M)]


def _reset() -> None:
    _Gate.started.clear()
    _Gate.release.clear()
    _Gate.ended.clear()


async def _wait_started() -> None:
    assert await asyncio.to_thread(_Gate.started.wait, 30), "the backward never started"


def _release_later() -> None:
    threading.Timer(0.3, _Gate.release.set).start()


@pytest.mark.parametrize("how", ["task.cancel", "anyio.CancelScope"])
def test_a_cancelled_step_waits_for_the_running_backward_before_it_raises(how: str) -> None:
    pipe, execs, s0, mbs = _setup()
    _reset()
    at_raise: dict[str, Any] = {}

    def snapshot() -> None:
        at_raise["ended"] = _Gate.ended.is_set()
        at_raise["grad"] = s0.lin.weight.grad

    async def main() -> None:
        if how == "task.cancel":
            t = asyncio.ensure_future(pipe.run_step(mbs))
            await _wait_started()
            _release_later()
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            snapshot()
        else:
            scopes: list[anyio.CancelScope] = []

            async def stepper() -> None:
                with anyio.CancelScope() as cs:
                    scopes.append(cs)
                    await pipe.run_step(mbs)
                assert cs.cancelled_caught
                snapshot()

            async with anyio.create_task_group() as tg:
                tg.start_soon(stepper)
                await _wait_started()
                _release_later()
                scopes[0].cancel()
        # The caller's recovery: discard the failed step's gradients, then wait a while:
        # nothing of the cancelled step may arrive any more.
        s0.zero_grad(set_to_none=True)
        await asyncio.sleep(0.1)
        assert s0.lin.weight.grad is None
        # And the next step runs (the gate lets it through at once).
        _Gate.release.set()
        stats = await pipe.run_step(mbs)
        assert [s.step for s in stats] == [1, 1]

    try:
        asyncio.run(main())
    finally:
        _Gate.release.set()
        for e in execs:
            e.close()
    assert at_raise["ended"], "run_step raised while the backward still ran on its thread"
    assert at_raise["grad"] is not None  # the cancelled step's gradient landed before


def test_a_task_that_outlives_the_settle_bound_is_named_in_a_note() -> None:
    pipe, execs, _, mbs = _setup()
    _reset()
    for st in pipe.stages:
        st.settle_timeout = 0.05
    notes: list[str] = []

    async def stepper() -> None:
        try:
            await pipe.run_step(mbs)
        except asyncio.CancelledError as e:  # the step's own error, with its notes
            notes.extend(getattr(e, "__notes__", []))
            raise

    async def main() -> None:
        t = asyncio.ensure_future(stepper())
        await _wait_started()
        t.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await t
        finally:
            _Gate.release.set()

    try:
        asyncio.run(main())
    finally:
        _Gate.release.set()
        for e in execs:
            e.close()
    assert any("0B0 was still running" in n for n in notes), notes


def test_an_anyio_scope_does_not_make_the_wait_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    # anyio cancels again at every await of the task inside its scope; without a shield the
    # stage's wait for its running task would be re-entered once per loop iteration
    # (thousands of times in 0.3 s). A one-stage pipeline's stage runs in the scope's own
    # task here (as a DistributedStage's does), not in a child task.

    calls = []
    real_wait = asyncio.wait

    async def counting_wait(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return await real_wait(*args, **kw)

    monkeypatch.setattr(asyncio, "wait", counting_wait)  # the task runner's asyncio.wait
    torch.manual_seed(0)
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=M)
    ex = rr.TorchStageExecutor({0: _Stage0()}, _loss, rank=0, input_fn=lambda mb: mb)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), [ex])
    stage = pipe.stages[0]
    mbs = [torch.randn(3, 4) for _ in range(M)]
    _reset()

    async def main() -> None:
        scopes: list[anyio.CancelScope] = []

        async def stepper() -> None:
            with anyio.CancelScope() as cs:
                scopes.append(cs)
                await stage.run_step(mbs)
            assert cs.cancelled_caught

        async with anyio.create_task_group() as tg:
            tg.start_soon(stepper)
            await _wait_started()
            _release_later()
            scopes[0].cancel()

    try:
        asyncio.run(main())
    finally:
        _Gate.release.set()
        ex.close()
    assert _Gate.ended.is_set()  # it was waited for
    assert 1 <= len(calls) <= 2, len(calls)


def test_an_executor_whose_settle_raises_is_named_in_a_note() -> None:
    # The wait's own failure does not replace the step's error (the cancel): it is a note.
    started = asyncio.Event()

    class _Stuck:
        async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
            started.set()
            await asyncio.sleep(30)

        async def settle(self) -> None:
            raise RuntimeError("settle broke")

    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=M)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), [_Stuck()])
    notes: list[str] = []

    async def stepper() -> None:
        try:
            await pipe.stages[0].run_step(list(range(M)))
        except asyncio.CancelledError as e:
            notes.extend(getattr(e, "__notes__", []))
            raise

    async def main() -> None:
        t = asyncio.ensure_future(stepper())
        await started.wait()  # 0F0 is on the executor (it sleeps 30 s)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())
    assert notes == ["rank 0 step 0: waiting for 0F0 raised RuntimeError('settle broke')"]
