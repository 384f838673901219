"""Micro-benchmark of the awaitable bridges (``rrfp_async._bridges``) on this machine.

Design: every figure is microseconds per awaited operation, the median over a few batches
(each batch times ``n`` back-to-back awaits, so timer overhead is amortised and one noisy
batch does not move the result). The in-process figures run on the loop the caller picks
(:func:`run_bridge_bench`); the gloo figures come from one 2-process job (``spawn``) that
measures the blocking calls and the same operations awaited through ``work_future`` on both
loops. Nothing is printed: callers format the rows.
"""

from __future__ import annotations

import asyncio
import queue
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["bridge_overheads", "gloo_bridge_bench", "run_bridge_bench"]

Row = dict[str, float | str]

_BATCHES = 5


def _noop() -> None:
    return None


def _loop_name(loop: asyncio.AbstractEventLoop) -> str:
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def _time_async(make: Callable[[], Awaitable[object]], n: int) -> float:
    """Median over batches of µs per ``await make()``."""
    per_op = []
    for _ in range(_BATCHES):
        t = time.perf_counter()
        for _ in range(n):
            await make()
        per_op.append(1e6 * (time.perf_counter() - t) / n)
    return statistics.median(per_op)


def _time_sync(fn: Callable[[], object], n: int) -> float:
    per_op = []
    for _ in range(_BATCHES):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        per_op.append(1e6 * (time.perf_counter() - t) / n)
    return statistics.median(per_op)


class _Completer:
    """A long-lived thread that completes torch futures handed to it (a stand-in for gloo)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="rrfp-bench-completer")
        self._thread.daemon = True
        self._thread.start()

    def _serve(self) -> None:
        while (fut := self._q.get()) is not None:
            fut.set_result(None)

    def complete(self, fut: Any) -> None:
        self._q.put(fut)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


async def _loop_overheads(repeats: int) -> list[Row]:
    import torch

    from rrfp_async.loop import ComputeWorker, run_blocking, torch_future

    loop = asyncio.get_running_loop()
    name = _loop_name(loop)
    n = max(1, repeats // _BATCHES)

    def done_future() -> asyncio.Future[None]:
        f: asyncio.Future[None] = loop.create_future()
        f.set_result(None)
        return f

    completer = _Completer()

    def thread_completed() -> asyncio.Future[None]:
        tf: torch.futures.Future[None] = torch.futures.Future()
        af = torch_future(tf)
        completer.complete(tf)
        return af

    rows: list[Row] = []
    try:
        with ComputeWorker(name="rrfp-bench-compute") as worker:
            cases: list[tuple[str, Callable[[], Awaitable[object]]]] = [
                ("done asyncio future (baseline)", done_future),
                ("run_blocking(noop)", lambda: run_blocking(_noop)),
                ("ComputeWorker.run(noop)", lambda: worker.run(_noop)),
                ("torch_future (completed on another thread)", thread_completed),
                (
                    "loop.run_in_executor(None, noop) (reference)",
                    lambda: loop.run_in_executor(None, _noop),
                ),
            ]
            for label, make in cases:
                await make()  # warm up (thread pools, first-call costs)
                us = await _time_async(make, n)
                rows.append({"name": label, "loop": name, "us_per_op": us})
    finally:
        completer.close()
    return rows


def run_bridge_bench(use_uvloop: bool, repeats: int = 2000) -> list[Row]:
    """The in-process bridge overheads, measured on asyncio's default loop or on uvloop.

    Args:
        use_uvloop: Run on uvloop (when installed) instead of asyncio's default loop.
        repeats: Awaits per case, split over a few batches.

    Returns:
        Rows ``{"name", "loop", "us_per_op"}``; ``loop`` names the loop actually used.
    """
    from rrfp_async.loop import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
        return runner.run(_loop_overheads(repeats))


def _gloo_rank(rank: int, world: int, n: int) -> list[Row]:
    """Runs in each of the 2 spawned ranks; rank 0's rows are the result."""
    import torch
    import torch.distributed as dist

    from rrfp_async.loop import loop_factory, work_future

    peer = 1 - rank
    buf = torch.zeros(16, dtype=torch.float32)  # 64 bytes
    flag = torch.zeros(1, dtype=torch.int64)

    from ._overhead_common import blocking_round_trip

    def rtt_blocking() -> None:
        blocking_round_trip(buf, rank, peer)

    def isend() -> Awaitable[None]:
        work = dist.isend(buf, peer)
        assert work is not None
        return work_future(work)

    def irecv() -> Awaitable[None]:
        work = dist.irecv(buf, peer)
        assert work is not None
        return work_future(work)

    async def rtt_awaited() -> None:
        if rank == 0:
            await isend()
            await irecv()
        else:
            await irecv()
            await isend()

    def bcast_blocking() -> None:
        dist.broadcast(flag, 0)

    async def bcast_awaited() -> None:
        work = dist.broadcast(flag, 0, async_op=True)
        assert work is not None
        await work_future(work)

    rows: list[Row] = []

    def sync(label: str, fn: Callable[[], None]) -> None:
        fn()
        dist.barrier()
        rows.append({"name": label, "loop": "-", "us_per_op": _time_sync(fn, n)})

    async def awaited(label: str, make: Callable[[], Awaitable[None]]) -> None:
        await make()
        dist.barrier()  # briefly blocks the loop; nothing else runs on it here
        us = await _time_async(make, n)
        rows.append(
            {"name": label, "loop": _loop_name(asyncio.get_running_loop()), "us_per_op": us}
        )

    sync("gloo p2p 64 B round trip, blocking send/recv", rtt_blocking)
    sync("gloo broadcast int64[1], 2 ranks, blocking", bcast_blocking)
    for use_uvloop in (False, True):

        async def main() -> None:
            await awaited("gloo p2p 64 B round trip, work_future (wait threads)", rtt_awaited)
            await awaited("gloo broadcast int64[1], 2 ranks, work_future (future)", bcast_awaited)

        with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
            runner.run(main())
    return rows


def gloo_bridge_bench(repeats: int = 500) -> list[Row]:
    """gloo figures from one 2-process job on 127.0.0.1: blocking vs awaited via work_future.

    Args:
        repeats: Operations per case, split over a few batches.

    Returns:
        Rows ``{"name", "loop", "us_per_op"}`` (``loop`` is ``"-"`` for blocking calls).
    """
    from rrfp_async.distributed import spawn

    n = max(1, repeats // _BATCHES)
    return spawn(_gloo_rank, 2, n, timeout=120.0)[0]


def bridge_overheads(repeats: int = 2000) -> list[Row]:
    """µs per await of each bridge, on asyncio's loop and on uvloop, plus gloo figures.

    In-process cases (``repeats`` awaits each): an already-done asyncio future (baseline),
    ``run_blocking(noop)`` (a new thread per call), ``ComputeWorker.run(noop)``,
    ``torch_future`` of a torch future completed on another thread, and
    ``loop.run_in_executor(None, noop)`` (reference). gloo (2 processes, ``repeats // 4``
    operations each): a 64-byte p2p round trip with blocking send/recv vs awaited through
    ``work_future`` (one wait thread per operation), and an int64[1] broadcast, blocking vs
    awaited through ``work_future`` (the collective's future). Takes about 10-30 s.

    Args:
        repeats: Awaits per in-process case.

    Returns:
        Rows ``{"name", "loop", "us_per_op"}``, the median of a few batches.
    """
    rows = run_bridge_bench(False, repeats) + run_bridge_bench(True, repeats)
    return rows + gloo_bridge_bench(max(_BATCHES, repeats // 4))
