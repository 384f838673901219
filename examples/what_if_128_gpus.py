"""What-if: a 128-GPU job (PP=16 x DP=8) simulated from a cost model, on one CPU core.

40 simulated steps (5 configurations x 8 replicas, 16 stages x 128 microbatches each): about
10 s of CPU time on the 2-core development machine (15.5 s wall with other jobs running
beside it, load average 5.5; measured with the simulator of this commit).

Run:  python examples/what_if_128_gpus.py [--microbatches 128] [--jitter 0.2]

Each data-parallel replica runs the same pipeline step; the step takes as long as its
slowest replica, so this simulates 8 replicas with different microbatch draws and reports
the slowest makespan per policy. Time is virtual (declared cost model), not measured.
"""

from __future__ import annotations

import argparse

import rrfp_async as rr


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=128)
    ap.add_argument("--jitter", type=float, default=0.2)
    args = ap.parse_args(argv)
    rows = {}
    for hint, policy, mf in [
        ("1f1b", "strict", None),
        ("1f1b", "readiness_first", 2.0),
        ("1f1b", "backfill", 2.0),
        ("bfw", "strict", None),
        ("bfw", "backfill", 2.0),
    ]:
        worst = max(
            rr.simulate(
                stages=args.stages,
                microbatches=args.microbatches,
                workload="multimodal",
                jitter=args.jitter,
                seed=seed,
                hint=hint,
                policy=policy,
                memory_factor=mf,
            ).makespan
            for seed in range(args.replicas)
        )
        rows[f"{hint:5} {policy:16} memory {mf or 1:g}x"] = worst
    base = next(iter(rows.values()))
    print(
        f"PP={args.stages} x DP={args.replicas} = {args.stages * args.replicas} GPUs,"
        f" {args.microbatches} microbatches per replica (simulated, virtual time)"
    )
    for k, v in rows.items():
        print(f"  {k}  step {v:.3f} s  speedup {base / v:.3f}x")


if __name__ == "__main__":
    main()
