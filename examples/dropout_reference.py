"""Dropout that does not depend on the dispatch order, and the loop that reproduces it.

Every forward of a pipeline draws from a random stream of its own, derived from
``(seed, step, stage, microbatch)``: whatever order a policy runs the forwards in, each
microbatch meets the same dropout masks on every stage. This script trains a 3-stage MLP
with dropout in one process (``rr.LocalPipeline``, real time) under two policy/hint pairs
that run the tasks in different orders (strict 1F1B in the data's order; readiness-first
with the cost-aware ``breadth_first_weighted`` hint, which starts the largest microbatches
first), then trains the same model in a plain
single-process loop that wraps each stage's forward of each microbatch in ``rr.task_rng``,
and prints how far apart the three results are. With the split backward and the weight
gradients in microbatch order (``ordered_weights=True``) they are bitwise equal. Usage::

    python examples/dropout_reference.py [--steps 3] [--microbatches 6]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import rrfp_async as rr

WIDTH = 16


def build() -> list[nn.Module]:
    torch.manual_seed(0)  # the executors' default seed is torch.initial_seed(): 0
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Dropout(0.2)) for _ in range(3)]


COST = rr.CostModel(default=rr.StageProfile(per_token=1e-4))
"""The declared cost of a task (per row here), from which the cost-aware hint orders."""


def data(step: int, m: int) -> list[rr.Microbatch]:
    """Microbatches of 1 to 8 rows."""
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(1, 9, (m,), generator=g).tolist()
    return [
        rr.Microbatch(index=i, tokens=n, data=torch.randn(n, WIDTH, generator=g))
        for i, n in enumerate(rows)
    ]


def loss_fn(out: torch.Tensor, mb: rr.Microbatch) -> torch.Tensor:
    return (out - mb.data).pow(2).mean()


def pipeline(policy: str, hint: str, steps: int, m: int) -> list[nn.Module]:
    mods = build()
    plan = rr.StepPlan(
        topology=rr.Topology(stages=3), microbatches=m, split_backward=True, ordered_weights=True
    )
    execs = [rr.TorchStageExecutor({v: mods[v]}, loss_fn, rank=v) for v in range(3)]
    params = [p for mod in mods for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan), execs, policy=policy)
    try:
        for step in range(steps):
            mbs = data(step, m)
            sched = rr.StepSchedule.build(plan, hint, durations=COST.declared(plan, mbs))
            rr.run(pipe.run_step(mbs, step=step, schedule=sched))
            opt.step()
            opt.zero_grad()
    finally:
        for e in execs:
            e.close()
    return mods


def reference(steps: int, m: int, seed: int = 0) -> list[nn.Module]:
    """The same training in one loop: each stage's forward of microbatch ``i`` of step
    ``step`` inside ``rr.task_rng(seed, step, stage, i)`` (the last stage's with its loss);
    the microbatches' backwards in order, as the ordered weight gradients accumulate."""
    mods = build()
    opt = torch.optim.SGD([p for mod in mods for p in mod.parameters()], lr=0.1)
    for step in range(steps):
        mbs = data(step, m)
        for i, mb in enumerate(mbs):
            h = mb.data
            for v, mod in enumerate(mods):
                with rr.task_rng(seed, step, v, i):
                    h = mod(h)
                    if v == len(mods) - 1:
                        h = loss_fn(h, mb) / len(mbs)
            h.backward()
        opt.step()
        opt.zero_grad()
    return mods


def max_diff(a: list[nn.Module], b: list[nn.Module]) -> float:
    pairs = zip(
        (p for m in a for p in m.parameters()), (p for m in b for p in m.parameters()), strict=True
    )
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    strict = pipeline("strict", "1f1b", args.steps, args.microbatches)
    ready = pipeline("readiness_first", "breadth_first_weighted", args.steps, args.microbatches)
    ref = reference(args.steps, args.microbatches)
    print(f"strict 1f1b vs readiness_first bfw: max |diff| {max_diff(strict, ready):.3g}")
    print(f"pipeline vs single-process reference: max |diff| {max_diff(strict, ref):.3g}")


if __name__ == "__main__":
    main()
