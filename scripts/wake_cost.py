"""What waking a sleeping thread costs the thread that wakes it (this machine's scheduler).

    python scripts/wake_cost.py

Prints medians of 300 wake-ups, each after 2 ms of quiet, against the same call back to
back (the other thread is then running already): a pipe write read by a blocked thread, a
``threading.Event.set``, and posting a gloo broadcast (``async_op``) on a 2-process group,
which wakes the process group's worker thread. The channel's per-message cost is bounded
by how many such wake-ups a message needs (BENCHMARKS.md, "Overheads in isolation").
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

import rrfp_async as rr


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def _pipe() -> tuple[float, float]:
    r, w = os.pipe()

    def reader() -> None:
        while os.read(r, 1) != b"q":
            pass

    t = threading.Thread(target=reader)
    t.start()
    quiet, busy = [], []
    for _ in range(300):
        time.sleep(0.002)
        a = time.perf_counter()
        os.write(w, b"x")
        quiet.append(time.perf_counter() - a)
    for _ in range(300):
        a = time.perf_counter()
        os.write(w, b"x")
        busy.append(time.perf_counter() - a)
    os.write(w, b"q")
    t.join()
    return _median_us(quiet), _median_us(busy)


def _event() -> float:
    ev, stop = threading.Event(), threading.Event()

    def waiter() -> None:
        while not stop.is_set():
            ev.wait()
            ev.clear()

    t = threading.Thread(target=waiter)
    t.start()
    quiet = []
    for _ in range(300):
        time.sleep(0.002)
        a = time.perf_counter()
        ev.set()
        quiet.append(time.perf_counter() - a)
    stop.set()
    ev.set()
    t.join()
    return _median_us(quiet)


def _broadcast(rank: int, world: int) -> tuple[float, float]:
    """One rank of the broadcast measurement (``rr.spawn``: gloo on 127.0.0.1)."""
    quiet: list[float] = []
    busy: list[float] = []
    works = []
    for gap in (0.002, 0.0):
        dist.barrier()
        for _ in range(300):
            if gap:
                time.sleep(gap)
            buf = torch.zeros(6, dtype=torch.int64)
            a = time.perf_counter()
            works.append(dist.broadcast(buf, 0, async_op=True))
            (quiet if gap else busy).append(time.perf_counter() - a)
        for w in works:
            assert w is not None
            w.wait()
        works.clear()
    return _median_us(quiet), _median_us(busy)


def main() -> None:
    quiet, busy = _pipe()
    print(
        f"pipe write to a blocked reader:   {quiet:6.1f} µs after 2 ms quiet,"
        f" {busy:6.1f} µs back to back"
    )
    print(f"threading.Event.set to a waiter:  {_event():6.1f} µs after 2 ms quiet")
    quiet, busy = rr.spawn(_broadcast, 2)[0]
    print(
        f"gloo broadcast posted (async_op): {quiet:6.1f} µs after 2 ms quiet,"
        f" {busy:6.1f} µs back to back"
    )


if __name__ == "__main__":
    main()
