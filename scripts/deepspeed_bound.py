"""What the DeepSpeed drop-in can gain at DeepSpeed's bytes, in the simulator.

    python scripts/deepspeed_bound.py                      # P=4 x M=16 and P=8 x M=32
    python scripts/deepspeed_bound.py --stages 4 --microbatches 16 --seeds 20

DeepSpeed's ``TrainSchedule`` is 1F1B with ``P - s`` warm-up forwards on stage ``s`` (one more
than Megatron's; ``rrfp_async.deepspeed.deepspeed_order`` reads it from DeepSpeed, this
script writes it out so that it runs without DeepSpeed). It is, task for task, the
runtime's own ``1f1b`` hint (checked here; the compat tier checks it against DeepSpeed), so
the default's byte budget, what strict ``1f1b`` holds, is DeepSpeed's bytes.

Each seed simulates the same step (the multimodal workload's sizes and declared costs,
seeded lognormal noise, jitter 0.3) under DeepSpeed's order run strictly within its own
count of activations (the baseline; its per-rank peak bytes are **DeepSpeed's bytes**) and
under:

* ``ds order, readiness-first``: DeepSpeed's order run readiness-first within its count
  (``install(sizes=False)``; also what a model with dropout runs);
* ``default at DS bytes``: the cost-aware hint (``breadth_first_weighted``) planned and run
  within each rank's DeepSpeed bytes, the drop-in's default once its fits are ready;
* ``budget 1.5x DS``: within 1.5x DeepSpeed's bytes (speed bought with memory).

It prints the median (smallest) speedup over the baseline across seeds and the largest ratio
of a rank's peak bytes to DeepSpeed's. Simulated time, not a GPU: the durations are the
declared cost model plus seeded noise, planned on the declared ones.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rrfp_async import StepPlan, Task, Topology
from rrfp_async.policies import HINTS
from rrfp_async.sim import simulate


def deepspeed_1f1b(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
    """DeepSpeed's ``TrainSchedule`` order: stage ``s`` warms up with ``min(P - s, M)``
    forwards, then alternates a backward and a forward, then the remaining backwards."""
    p, m = plan.stages, plan.microbatches
    out: dict[int, list[Task]] = {}
    for s in range(p):
        w = min(p - s, m)
        order = [Task(s, "F", k) for k in range(w)]
        for k in range(m - w):
            order += [Task(s, "B", k), Task(s, "F", w + k)]
        order += [Task(s, "B", k) for k in range(m - w, m)]
        out[s] = order
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, action="append")
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jitter", type=float, default=0.3)
    a = ap.parse_args()
    print(
        "simulated steps (declared cost model + seeded noise, not a GPU); multimodal,"
        f" jitter {a.jitter}, {a.seeds} seeds; speedup over DeepSpeed's order run strictly:"
        " median (min); bytes: largest rank peak / DeepSpeed's"
    )
    for p in a.stages or [4, 8]:
        m = a.microbatches or 4 * p
        plan = StepPlan(topology=Topology(stages=p), microbatches=m)
        ours = HINTS["1f1b"](plan, None)
        assert {r: list(t) for r, t in ours.items()} == deepspeed_1f1b(plan, None)
        rows: dict[str, list[float]] = {}
        mem: dict[str, float] = {}
        for seed in range(a.seeds):
            kw: dict[str, Any] = {
                "stages": p,
                "microbatches": m,
                "workload": "multimodal",
                "jitter": a.jitter,
                "seed": seed,
            }
            base = simulate(hint=deepspeed_1f1b, policy="strict", memory_factor=1.0, **kw)
            ds_bytes = [int(b) for b in base.peak_bytes]
            runs = {
                "ds order, readiness-first": simulate(hint=deepspeed_1f1b, memory_factor=1.0, **kw),
                "default at DS bytes": simulate(memory_budget=ds_bytes, **kw),
                "budget 1.5x DS": simulate(memory_budget=[int(1.5 * b) for b in ds_bytes], **kw),
            }
            for name, r in runs.items():
                rows.setdefault(name, []).append(base.makespan / r.makespan)
                ratio = max(x / b for x, b in zip(r.peak_bytes, ds_bytes, strict=True))
                mem[name] = max(mem.get(name, 0.0), ratio)
        cells = "  ".join(
            f"{k}: {statistics.median(v):.3f}x ({min(v):.3f}) bytes {mem[k]:.2f}"
            for k, v in rows.items()
        )
        print(f"P={p} M={m}: {cells}", flush=True)


if __name__ == "__main__":
    main()
