"""What the synchronous face adds per step: ``run_step_sync`` against ``await run_step``.

A trivial step (a ``LocalPipeline`` of 2 stages x 2 microbatches, 1F1B, on a cost-model
executor with zero durations: 8 tasks that only yield), run ``--calls`` times per round,
rounds alternating between the two faces; per round the median per-call time, over the
rounds the median. The async face runs the steps inside one coroutine on a loop of the same
kind as the portal's (uvloop, then asyncio). Usage::

    python scripts/sync_overhead.py [--calls 2000] [--rounds 7]

On the 2-core VM the figure is bimodal from run to run: about 70 us when the caller and the
portal's thread share a core, about 3x that when they sit on two otherwise idle cores (each
call hands off twice). ``taskset -c 0 python scripts/sync_overhead.py`` pins both to one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import rrfp_async as rr
from rrfp_async.loop._portal import SyncPortal


def _pipeline() -> rr.LocalPipeline:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    zero = rr.Durations.from_arrays(plan, [[0.0] * 2 for _ in range(plan.num_virtual)])
    return rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), rr.sim.CostModelExecutor(zero))


def _median_async(pipe: rr.LocalPipeline, calls: int, use_uvloop: bool) -> float:
    async def main() -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await pipe.run_step([0, 1])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return rr.run(main(), use_uvloop=use_uvloop)


def _median_sync(pipe: rr.LocalPipeline, portal: SyncPortal, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        portal.call(pipe.run_step, [0, 1])  # what LocalPipeline.run_step_sync does
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    for name, uv in (("uvloop", True), ("asyncio", False)):
        pipe = _pipeline()
        portal = SyncPortal(use_uvloop=uv)
        try:
            a, s = [], []
            for _ in range(args.rounds):
                a.append(_median_async(pipe, args.calls, uv))
                s.append(_median_sync(pipe, portal, args.calls))
        finally:
            portal.close()
        ma, ms = statistics.median(a) * 1e6, statistics.median(s) * 1e6
        print(
            f"{name:8s} await run_step {ma:7.1f} us  run_step_sync {ms:7.1f} us"
            f"  added {ms - ma:6.1f} us per call"
        )


if __name__ == "__main__":
    main()
