"""What-if: a 1024-GPU job (PP=128 x TP=8), 1024 microbatches per step, simulated from a
cost model.

Run:  python examples/what_if_1024_gpus.py [--stages 128] [--tp 8] [--microbatches 1024]

Each simulation is one step of 262,144 tasks (128 stages x 1024 microbatches x forward and
backward) run by the real stage loop and policies on a virtual clock; the script prints the
wall time each one took (8.7 s and 11.5 s on the 2-core development machine, 2026-12-02;
BENCHMARKS.md, simulator section).

TP enters this example as a cost scaling only: every stage's compute is divided by the TP
degree (ideal tensor parallelism: no TP all-reduce inside a task, no cost for the TP
leader's decisions; ``rr.simulate(tp=...)`` prices those, docs/simulation.md), while a
message between pipeline stages keeps its latency.
Time is virtual (declared cost model), not measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import rrfp_async as rr


def scaled(p: rr.StageProfile, k: float) -> rr.StageProfile:
    """A stage profile whose every cost term is ``k`` times ``p``'s."""
    return replace(
        p,
        per_token=p.per_token * k,
        per_patch=p.per_patch * k,
        per_token_sq=p.per_token_sq * k,
        fixed=p.fixed * k,
    )


def tp_cost(stages: int, microbatches: int, tp: int, latency: float) -> rr.CostModel:
    """The multimodal workload's cost model with every stage's compute divided by ``tp``."""
    cost = rr.make_workload("multimodal", microbatches, virtual_stages=stages).cost
    return replace(
        cost,
        profiles=tuple(scaled(p, 1.0 / tp) for p in cost.profiles),
        default=scaled(cost.default, 1.0 / tp),
        latency=latency,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=128)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1024)
    ap.add_argument("--jitter", type=float, default=0.2)
    ap.add_argument("--latency", type=float, default=50e-6, help="seconds per message")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cost = tp_cost(args.stages, args.microbatches, args.tp, args.latency)
    print(
        f"PP={args.stages} x TP={args.tp} = {args.stages * args.tp} GPUs,"
        f" {args.microbatches} microbatches (simulated, virtual time; TP = compute / {args.tp})"
    )
    base = None
    for hint, policy, mf in [
        ("1f1b", "strict", None),
        ("bfw", "readiness_first", 2.0),
    ]:
        t = time.perf_counter()
        res = rr.simulate(
            stages=args.stages,
            microbatches=args.microbatches,
            workload="multimodal",
            cost_model=cost,
            jitter=args.jitter,
            seed=args.seed,
            hint=hint,
            policy=policy,
            memory_factor=mf,
        )
        wall = time.perf_counter() - t
        base = base or res.makespan
        tasks = sum(len(e) for e in res.executed)
        print(
            f"  {hint:5} {policy:16} memory {mf or 1:g}x  step {res.makespan:.3f} s"
            f"  speedup {base / res.makespan:.3f}x  efficiency {res.efficiency:.3f}"
            f"  ({tasks} tasks simulated in {wall:.1f} s)"
        )


if __name__ == "__main__":
    main()
