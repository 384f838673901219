"""The virtual-time loop and the runner."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

import rrfp_async as rr
from rrfp_async.loop import VirtualClockStall, VirtualEventLoop, loop_factory


def test_virtual_clock_jumps_to_timers() -> None:
    loop = VirtualEventLoop()

    async def main() -> list[float]:
        seen = []
        for d in (5.0, 0.25, 1000.0):
            await asyncio.sleep(d)
            seen.append(asyncio.get_running_loop().time())
        return seen

    t = time.perf_counter()
    try:
        assert loop.run_until_complete(main()) == [5.0, 5.25, 1005.25]
    finally:
        loop.close()
    assert time.perf_counter() - t < 1.0


def test_virtual_loop_orders_concurrent_timers() -> None:
    loop = VirtualEventLoop()
    order: list[str] = []

    async def sleeper(name: str, d: float) -> None:
        await asyncio.sleep(d)
        order.append(name)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(sleeper("c", 3))
            tg.create_task(sleeper("a", 1))
            tg.create_task(sleeper("b", 2))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert order == ["a", "b", "c"]


def test_virtual_loop_accepts_thread_wakeups() -> None:
    loop = VirtualEventLoop()

    async def main() -> str:
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            time.sleep(0.05)
            loop.call_soon_threadsafe(fut.set_result, "hi")

        threading.Thread(target=wake).start()
        return await fut

    try:
        assert loop.run_until_complete(main()) == "hi"
    finally:
        loop.close()


def test_virtual_loop_reports_a_stall() -> None:
    loop = VirtualEventLoop(stall_timeout=0.05)

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # never resolved, nothing scheduled

    try:
        with pytest.raises(VirtualClockStall):
            loop.run_until_complete(main())
    finally:
        loop.close()


def test_run_uses_uvloop_and_returns() -> None:
    async def main() -> str:
        return type(asyncio.get_running_loop()).__module__

    mod = rr.run(main())
    if loop_factory() is not None:
        assert mod.startswith("uvloop")
    assert rr.run(main, use_uvloop=False).startswith("asyncio")


def test_simulate_from_inside_a_running_loop() -> None:
    async def main() -> float:
        return rr.simulate(stages=2, microbatches=4).makespan

    assert rr.run(main()) == pytest.approx(rr.simulate(stages=2, microbatches=4).makespan)


def test_fast_iteration_reports_a_raising_callback_like_asyncio() -> None:
    # The closed simulation's iteration runs callbacks without Handle._run: one that raises
    # must still reach the loop's exception handler, as asyncio reports it, and the loop
    # must go on with the next callbacks and timers.
    loop = VirtualEventLoop(stall_when_idle=True)
    seen: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("boom")

    async def main() -> None:
        lp = asyncio.get_running_loop()
        lp.call_soon(boom)
        lp.call_soon(ran.append, "after")
        await asyncio.sleep(1.0)
        ran.append("slept")

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert ran == ["after", "slept"]
    assert len(seen) == 1
    assert isinstance(seen[0]["exception"], ValueError)
    assert str(seen[0]["message"]).startswith("Exception in callback")
    assert "boom" in str(seen[0]["message"])
    assert isinstance(seen[0]["handle"], asyncio.Handle)


def test_a_uvloop_that_fails_to_start_falls_back_to_asyncio(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Fails on the old code: the OSError from uvloop ended rr.run before the coroutine ran.
    uvloop = pytest.importorskip("uvloop")

    def broken() -> asyncio.AbstractEventLoop:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(uvloop, "new_event_loop", broken)

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    with caplog.at_level(logging.WARNING, logger="rrfp_async"):
        assert rr.run(which()).startswith("asyncio")
    assert [r.getMessage() for r in caplog.records] == [
        "uvloop failed to start (OSError(24, 'Too many open files')): running on asyncio's"
        " default event loop"
    ]
