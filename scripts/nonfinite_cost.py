"""What TorchStageExecutor(check_tensors=True) costs: the time its isfinite checks take, as a
share of the executor's compute time in the same steps (robust to load: both on one thread).

    python scripts/nonfinite_cost.py

The example image-text model, 4 stages in one process (LocalPipeline, strict 1F1B), 8
microbatches; 5 timed steps after one warm-up. Real CPU compute, no emulated time.
"""

from __future__ import annotations

import statistics

import torch

import rrfp_async as rr
from rrfp_lab.models import ImageTextConfig, build_stage_modules, loss_fn, make_microbatches


def main() -> None:
    torch.set_num_threads(1)
    cfg = ImageTextConfig()
    s, m = 4, 8
    mods = build_stage_modules(cfg, s, list(range(s)))
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, loss_fn, rank=v, check_tensors=True) for v in range(s)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=s), microbatches=m)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs, policy="strict")
    mbs = make_microbatches(m, cfg, seed=0)
    shares = []
    for r in range(6):
        for e in execs:
            e.compute_seconds = 0.0
            e._finite.seconds = 0.0
        rr.run(pipe.run_step(mbs))
        if r:  # (the first step warms up)
            check = sum(e._finite.seconds for e in execs)
            shares.append(check / sum(e.compute_seconds for e in execs))
    for e in execs:
        e.close()
    med, lo, hi = (100 * f(shares) for f in (statistics.median, min, max))
    tokens = sum(mb.tokens for mb in mbs)
    print(
        f"check_tensors: {med:.1f}% of compute time (min {lo:.1f}%, max {hi:.1f}%),"
        f" {tokens} tokens a step, real CPU compute"
    )


if __name__ == "__main__":
    main()
