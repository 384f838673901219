"""The in-process channel."""

from __future__ import annotations

import asyncio

import pytest

import rrfp_async as rr
from rrfp_async.channels import LocalChannel


def test_a_bad_message_fails_the_receiving_stage() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=1)
    sched = rr.StepSchedule.build(plan, "1f1b")
    d = rr.Durations.from_arrays(plan, [[1.0], [1.0]])
    ch = LocalChannel(2, latency=lambda step, task: 0.5)
    stage = rr.StageLoop(
        1, schedule=sched, executor=rr.sim.CostModelExecutor(d), endpoint=ch.endpoint(1)
    )

    async def main() -> None:
        run = asyncio.ensure_future(stage.run_step([0]))
        ch.endpoint(0).send(1, 0, rr.Task(1, "F", 0), "a")
        ch.endpoint(0).send(1, 0, rr.Task(1, "F", 0), "again")  # a duplicate
        with pytest.raises(rr.errors.ProtocolError, match="arrived twice"):
            await run

    loop = rr.sim.VirtualEventLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert ch.inflight == 0


def test_latency_and_inflight_count() -> None:
    ch = LocalChannel(2, latency=lambda step, task: 1.0 + task.mb)
    seen: list[tuple[float, str]] = []

    class Sink:
        def deliver(self, step: int, task: rr.Task, payload: object, src: int) -> None:
            seen.append((asyncio.get_running_loop().time(), str(task)))

        def fail(self, exc: BaseException) -> None:
            raise AssertionError(exc)

    ch.endpoint(1).bind(Sink())

    async def main() -> None:
        ch.endpoint(0).send(1, 0, rr.Task(1, "F", 1), None)
        ch.endpoint(0).send(1, 0, rr.Task(1, "F", 0), None)
        assert ch.inflight == 2
        await asyncio.sleep(5)

    loop = rr.sim.VirtualEventLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [(1.0, "1F0"), (2.0, "1F1")]
    with pytest.raises(rr.errors.ProtocolError, match="does not exist"):
        asyncio.run(_send_to_nowhere(ch))


async def _send_to_nowhere(ch: LocalChannel) -> None:
    ch.endpoint(0).send(5, 0, rr.Task(0, "F", 0), None)
