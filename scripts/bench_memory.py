"""Speed at equal activation bytes, in the simulator, side by side in one run.

    python scripts/bench_memory.py                       # P=4/8/16, text and multimodal
    python scripts/bench_memory.py --stages 8 --microbatches 32 --workload multimodal
    python scripts/bench_memory.py --chunks 2 --stages 4 --stages 8   # interleaved

With ``--chunks 2`` the fixed order is interleaved 1F1B (in the baseline and in the
``1f1b + bytes`` row), the order the default byte budget is then taken from.

Each row simulates the same steps (sizes and realized noise fixed by the seed; jitter 0.3)
under strict 1F1B and under the configurations below, and prints the median (and smallest)
speedup over strict 1F1B across seeds, and the largest memory ratio: a rank's peak
activation bytes over what strict 1F1B holds on the same microbatches (bytes: each
microbatch's tokens on every virtual stage, the simulator's activation model). Simulated
time, not a GPU: durations come from the workload's declared cost model plus seeded noise.

* ``default``: ``simulate()`` with no memory argument: the cost-aware hint built within
  1F1B's bytes, run readiness-first under that byte budget.
* ``same hint strict``: that hint run strictly (what readiness-first adds over its own hint).
* ``greedy``: that hint under ``greedy`` (the highest-ranked ready task, backwards out of
  order too; ``readiness_first`` keeps the backwards in the hint's order).
* ``1f1b + bytes``: the 1F1B hint run readiness-first under the byte ledger.
* ``budget 1.25x / 1.5x``: ``memory_budget=1.25`` / ``1.5`` (speed bought with memory).
* ``count bound``: ``memory_factor=1`` (the count of activations: the old "same memory").
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rrfp_async.sim import simulate

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "same hint strict": {"policy": "strict"},
    "greedy": {"policy": "greedy"},
    "1f1b + bytes": {"hint": "1f1b"},
    "budget 1.25x": {"memory_budget": 1.25},
    "budget 1.5x": {"memory_budget": 1.5},
    "count bound": {"memory_factor": 1.0},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--stages", type=int, action="append")
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--workload", action="append", choices=["text", "multimodal", "uniform"])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--chunks", type=int, default=1, help="model chunks per rank")
    a = ap.parse_args()
    stages = a.stages or [4, 8, 16]
    workloads = a.workload or ["text", "multimodal"]
    print(
        "simulated steps (declared cost model + seeded noise, not a GPU);"
        f" jitter {a.jitter}, {a.seeds} seeds, {a.chunks} chunk(s) per rank; speedup over"
        " strict 1F1B (interleaved with chunks): median (min);"
        " mem: largest peak bytes / strict 1F1B's bytes"
    )
    for p in stages:
        m = a.microbatches or 4 * p
        for wl in workloads:
            speed: dict[str, list[float]] = {k: [] for k in CONFIGS}
            mem: dict[str, float] = dict.fromkeys(CONFIGS, 0.0)
            fixed = "1f1b" if a.chunks == 1 else "interleaved_1f1b"
            for seed in range(a.seeds):
                kw = {"stages": p, "microbatches": m, "workload": wl, "jitter": a.jitter}
                kw["chunks"] = a.chunks
                base = simulate(hint=fixed, policy="strict", seed=seed, **kw)
                for name, extra in CONFIGS.items():
                    if extra.get("hint") == "1f1b":
                        extra = {**extra, "hint": fixed}
                    r = simulate(seed=seed, **kw, **extra)
                    speed[name].append(base.makespan / r.makespan)
                    mem[name] = max(mem[name], r.memory_ratio)
            cells = "  ".join(
                f"{k}: {statistics.median(v):.3f}x ({min(v):.3f}) mem {mem[k]:.2f}"
                for k, v in speed.items()
            )
            ref = speed["same hint strict"]
            own = [a / b for a, b in zip(speed["default"], ref, strict=True)]
            greedy = [a / b for a, b in zip(speed["greedy"], ref, strict=True)]
            print(
                f"P={p} x {a.chunks} M={m} {wl}: {cells}  | vs its own hint run strictly:"
                " readiness_first"
                f" {statistics.median(own):.3f}x ({min(own):.3f}), greedy"
                f" {statistics.median(greedy):.3f}x ({min(greedy):.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
