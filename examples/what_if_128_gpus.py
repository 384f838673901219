"""What-if: a 128-GPU job (PP=16 x DP=8) simulated from a cost model.

Run:  python examples/what_if_128_gpus.py [--microbatches 128] [--jitter 0.2]

Each data-parallel replica runs the same pipeline step; the step takes as long as its
slowest replica, so this simulates 8 replicas with different microbatch draws and reports
the slowest makespan per policy. Time is virtual (declared cost model), not measured.

Each simulation (one 16 x 128 step, 4,096 tasks) takes about 0.1 s of CPU time here
(BENCHMARKS.md, simulator section); the script prints the median wall time it measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import rrfp_async as rr


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=128)
    ap.add_argument("--jitter", type=float, default=0.2)
    args = ap.parse_args(argv)
    rows = {}
    walls: list[float] = []
    for hint, policy, mf in [
        ("1f1b", "strict", None),
        ("1f1b", "readiness_first", 2.0),
        ("1f1b", "backfill", 2.0),
        ("bfw", "strict", None),
        ("bfw", "backfill", 2.0),
    ]:
        makespans = []
        for seed in range(args.replicas):
            t = time.perf_counter()
            res = rr.simulate(
                stages=args.stages,
                microbatches=args.microbatches,
                workload="multimodal",
                jitter=args.jitter,
                seed=seed,
                hint=hint,
                policy=policy,
                memory_factor=mf,
            )
            walls.append(time.perf_counter() - t)
            makespans.append(res.makespan)
        rows[f"{hint:5} {policy:16} memory {mf or 1:g}x"] = max(makespans)
    base = next(iter(rows.values()))
    print(
        f"PP={args.stages} x DP={args.replicas} = {args.stages * args.replicas} GPUs,"
        f" {args.microbatches} microbatches per replica (simulated, virtual time)"
    )
    for k, v in rows.items():
        print(f"  {k}  step {v:.3f} s  speedup {base / v:.3f}x")
    print(f"{len(walls)} simulations, median {statistics.median(walls):.3f} s of wall time each")


if __name__ == "__main__":
    main()
