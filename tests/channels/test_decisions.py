"""The TP decision channel on its own: order, stale decisions of a failed step, CLOSE,
channels in sequence on one group, a lost leader."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _listeners() -> int:
    return sum(t.name.startswith("rrfp-decisions-listen") for t in threading.enumerate())


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from rrfp_async.channels._decisions import DecisionChannel

    group = dist.new_group(list(range(world)), backend="gloo")
    out: dict[str, Any] = {}

    async def close(ch: DecisionChannel) -> None:
        await asyncio.get_running_loop().run_in_executor(None, ch.close)

    async def main() -> None:
        # 1. Step 0 "fails" after one of three decisions on the follower: the two it did not
        #    take are still queued when step 1 begins, and must not be taken for step 1's.
        ch = DecisionChannel(group, leader=0, rank=rank, tp_rank=rank, stage=0)
        ch.begin_step(0, 3)
        if ch.is_leader:
            for i in range(3):
                ch.publish(0, i, rr.Task(0, "F", i))
            await ch.end_step()
        else:
            out["step0"] = str(await ch.receive(0, 0))
            while len(ch._rows) < 2:  # noqa: ASYNC110 (the other two arrived)
                await asyncio.sleep(0.01)
        dist.barrier()
        ch.begin_step(1, 2)
        if ch.is_leader:
            ch.publish(1, 0, rr.Task(0, "B", 7))
            ch.publish(1, 1, rr.Task(0, "F", 8))
            await ch.end_step()
        else:
            out["step1"] = [str(await ch.receive(1, 0)), str(await ch.receive(1, 1))]
        # Count before the leader may close: its CLOSE ends the follower's listener.
        dist.barrier()
        out["listeners_open"] = _listeners()
        dist.barrier()
        await close(ch)
        out["listeners_closed"] = _listeners()
        # 2. A second channel on the same group, after the first one closed.
        ch2 = DecisionChannel(group, leader=0, rank=rank, tp_rank=rank, stage=0)
        ch2.begin_step(0, 1)
        if ch2.is_leader:
            ch2.publish(0, 0, rr.Task(0, "W", 3))
            await ch2.end_step()
        else:
            out["second"] = str(await ch2.receive(0, 0))
            # A sequence gap is a divergence.
            ch2.begin_step(1, 1)
        dist.barrier()
        if ch2.is_leader:
            ch2.begin_step(1, 2)
            ch2.publish(1, 1, rr.Task(0, "F", 0))  # seq 1, where seq 0 is expected
            await ch2.end_step()
        else:
            try:
                await ch2.receive(1, 0)
            except rr.errors.DivergenceError as e:
                out["gap"] = str(e)
        await close(ch2)
        # 3. The leader closes while a follower waits: the follower's receive ends.
        ch3 = DecisionChannel(group, leader=0, rank=rank, tp_rank=rank, stage=0)
        ch3.begin_step(0, 1)
        if ch3.is_leader:
            await asyncio.sleep(0.2)
            await close(ch3)
        else:
            try:
                await asyncio.wait_for(ch3.receive(0, 0), 10)
            except rr.errors.ClosedError as e:
                out["closed"] = str(e)
            await close(ch3)
        # 4. A send that fails where it is posted names the follower.
        if rank == 0:
            ch4 = DecisionChannel(group, leader=0, rank=0, tp_rank=0, stage=0)

            class _Broken:
                def send(self, *args: Any) -> Any:
                    raise RuntimeError("Connection closed by peer")

            ch4.group = _Broken()
            try:
                ch4.publish(0, 0, rr.Task(0, "F", 0))
            except rr.errors.PeerError as e:
                out["send_failed"] = str(e)

    rr.run(main())
    return out


def test_decision_channel_order_stale_close_and_gaps() -> None:
    leader, follower = pooled_spawn(_worker, 2, timeout=100)
    assert follower["step0"] == "0F0"
    # The stale step-0 decisions were dropped by step 1's receive.
    assert follower["step1"] == ["0B7", "0F8"]
    assert follower["listeners_open"] == 1 and follower["listeners_closed"] == 0, follower
    assert leader["listeners_open"] == 0  # the leader never listens
    assert follower["second"] == "0W3"
    assert "received decision seq 1 of step 1 but expected seq 0 of step 1" in follower["gap"]
    assert "the TP leader closed" in follower["closed"]
    assert "sending decision 0 (0F0) to TP rank 1 failed" in leader["send_failed"]
