"""Soak: many real-time steps of a local pipeline leave nothing behind (``cli/_bench_soak``).

The short soak runs 60 steps, every fifth failing on purpose in the middle of the step, on
uvloop and on asyncio's own loop. Between steps the live asyncio tasks, threads and
messages in flight must be exactly constant, and after warm-up resident memory and the
objects the garbage collector tracks may only wobble. The second test proves those checks
are not vacuous: the same soak with a leak injected per step (1 MiB of memory, a few
objects, an orphan task, a parked thread) must come out red, naming what grew.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rrfp_lab._soak import SoakResult, format_soak, soak

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

STEPS = 60
FAIL_EVERY = 5
RSS_BOUND_MIB = 4.0
"""A leak of 1 MiB per step grows 48 MiB after warm-up; a healthy soak ~0.1 MiB."""
GC_BOUND = 200
"""Objects: a healthy soak grows by about one per sample; a leak of 5 objects per step,
by 240 after warm-up."""


def _short_soak(**kw: Any) -> SoakResult:
    args: dict[str, Any] = {
        "steps": STEPS,
        "stages": 4,
        "microbatches": 8,
        "fail_every": FAIL_EVERY,
        "sample_every": 6,
        "rss_tolerance_mib": RSS_BOUND_MIB,
        "gc_tolerance": GC_BOUND,
    }
    return soak(**{**args, **kw})


@pytest.mark.parametrize("use_uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_soak_with_failing_steps_leaves_nothing_behind(use_uvloop: bool) -> None:
    r = _short_soak(use_uvloop=use_uvloop)
    report = format_soak(r)
    assert ("uvloop" in r.loop) is use_uvloop, r.loop
    # Not vacuous: steps really failed on purpose, the others ran out of the hint's order.
    assert r.failed_steps == STEPS // FAIL_EVERY
    assert r.deviations > 0
    assert len(r.samples) == STEPS // 6 + 1 and r.samples[-1].step == STEPS
    # Between steps: only the soak's own task, no thread of ours, nothing in flight.
    assert {s.tasks for s in r.samples} == {1}, report
    assert len({s.threads for s in r.samples}) == 1, report
    assert {s.inflight for s in r.samples} == {0}, report
    assert r.rss_growth_mib <= RSS_BOUND_MIB, report
    g = r.gc_growth
    assert g is not None and g <= GC_BOUND, report
    assert r.flat and "verdict: flat" in report, report


def _leaks() -> Iterator[tuple[str, Callable[[list[Any]], Callable[[int], None]], str]]:
    """(name, make an ``on_step`` hook that leaks into a keep-alive list, the verdict's
    words for it)."""

    def memory(keep: list[Any]) -> Callable[[int], None]:
        return lambda step: keep.append(b"x" * (1 << 20))  # touched pages: resident

    def objects(keep: list[Any]) -> Callable[[int], None]:
        # Lists: gc tracks every list (a dict of atoms only it does not).
        return lambda step: keep.extend([step] for _ in range(5))

    def task(keep: list[Any]) -> Callable[[int], None]:
        # The runner cancels it when the soak's loop closes.
        return lambda step: keep.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))

    def thread(keep: list[Any]) -> Callable[[int], None]:
        def hook(step: int) -> None:
            gate = keep[0]
            t = threading.Thread(target=gate.wait, daemon=True)
            t.start()
            keep.append(t)

        return hook

    yield "memory", memory, "resident memory grew"
    yield "objects", objects, "gc-tracked objects grew"
    yield "task", task, "live asyncio tasks not constant"
    yield "thread", thread, "live threads not constant"


@pytest.mark.parametrize(("name", "make", "words"), list(_leaks()), ids=[x[0] for x in _leaks()])
def test_soak_verdict_catches_a_leak(
    name: str, make: Callable[[list[Any]], Callable[[int], None]], words: str
) -> None:
    gate = threading.Event()
    keep: list[Any] = [gate]
    try:
        r = _short_soak(on_step=make(keep))
    finally:
        gate.set()  # let the parked threads end
    assert not r.flat
    assert any(p.startswith(words) for p in r.problems), r.problems
    assert "verdict: GROWTH" in format_soak(r)
