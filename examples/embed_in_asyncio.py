"""Embed a pipeline in your own asyncio program, in real time.

Run:  python examples/embed_in_asyncio.py

The stage loops take over nothing global: they run as coroutines inside whatever loop is
running, next to your own tasks (here a heartbeat). ``rr.run`` uses uvloop when installed.
"""

from __future__ import annotations

import asyncio

import rrfp_async as rr


async def main() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=4), microbatches=8)
    mbs = rr.make_workload("text", 8, virtual_stages=4, seed=1).microbatches
    cost = rr.CostModel(default=rr.StageProfile(per_token=2e-6), jitter=0.3)
    schedule = rr.StepSchedule.build(
        plan, "1f1b", durations=cost.declared(plan, mbs), memory_factor=2.0
    )
    pipe = rr.LocalPipeline(schedule, rr.sim.CostModelExecutor(cost, seed=0), policy="backfill")
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            await asyncio.sleep(0.005)
            beats += 1

    hb = asyncio.create_task(heartbeat())
    for step in range(3):
        stats = await pipe.run_step(mbs)
        span = max(s.finished for s in stats) - min(s.started for s in stats)
        print(
            f"step {step}: {span * 1e3:.1f} ms wall, peak in-flight"
            f" {[s.peak_inflight for s in stats]}, deviations {sum(s.deviations for s in stats)}"
        )
    hb.cancel()
    print(f"the heartbeat ticked {beats} times meanwhile (real time, cost-model executor)")


if __name__ == "__main__":
    rr.run(main())
