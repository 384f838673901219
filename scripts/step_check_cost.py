"""What the step check costs (``DistributedStage(verify_plan=True)``, the default): steps of
16 tiny tasks per rank (no compute) on 2 gloo processes, with the check and without it
(``verify_plan=False``), alternating blocks of 30 steps, 6 blocks each; the median step and
the paired difference per block. The check rides on the end-of-step agreement, which runs
either way (``agree_steps``): the difference is its row and the plan tag in the headers
(``scripts/per_step_cost.py`` compares it with the all-gather it replaced).

    python scripts/step_check_cost.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

import rrfp_async as rr


class Tiny:
    async def execute(self, task, data, ctx, /):
        await asyncio.sleep(0)
        return torch.zeros(2)


def worker(rank, world):
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=8)
    out = {}

    async def go():
        # one at a time: a p2p group serves one open stage
        for _block in range(6):
            for v in (True, False):
                st = rr.DistributedStage(
                    layout,
                    rr.StepSchedule.build(plan, "1f1b"),
                    Tiny(),
                    groups=groups,
                    verify_plan=v,
                )
                async with st:
                    await st.run_step(list(range(8)))
                    ts = []
                    for _ in range(30):
                        t0 = time.perf_counter()
                        await st.run_step(list(range(8)))
                        ts.append(time.perf_counter() - t0)
                out.setdefault(v, []).append(statistics.median(ts))
                st.channel.close(10.0)
                torch.distributed.barrier()

    rr.run(go())
    return out


if __name__ == "__main__":
    res = rr.spawn(worker, 2, timeout=600)
    for r, o in enumerate(res):
        on, off = o[True], o[False]
        diffs = [(a - b) * 1e6 for a, b in zip(on, off, strict=True)]
        print(
            f"rank {r}: step with check {statistics.median(on) * 1e3:.3f} ms, without"
            f" {statistics.median(off) * 1e3:.3f} ms; paired difference median"
            f" {statistics.median(diffs):.0f} us (min {min(diffs):.0f}, max {max(diffs):.0f}),"
            " 16 tiny tasks per rank, gloo, no compute"
        )
