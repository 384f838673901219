"""What a task's own random stream costs: per forward, with and without it.

Three figures, in microseconds of this thread's CPU time per call, medians over
``--rounds`` rounds of ``--tasks`` calls each (rounds of the two executor variants
alternate, so that drift of the machine's load hits both alike):

* ``fork``: ``task_seed`` plus the fork around a forward (save the CPU generator's state,
  seed it, put the state back) and the lock, alone;
* ``torch fork_rng``: the same with torch's ``torch.random.fork_rng`` + ``torch.manual_seed``
  (what one would write by hand), for scale;
* ``F on`` / ``F off``: a forward task of a tiny stage (``nn.Linear(8, 8)``, batch 2) through
  ``TorchStageExecutor``'s task dispatch on this thread (no compute-thread hand-off), with
  the per-task streams (the default) and with ``task_rng=False``; their difference is what
  a pipeline pays per forward.

CPU only: a CUDA stage also saves, seeds and restores its devices' Philox generators (a
seed and an offset each). Usage::

    python scripts/task_rng_cost.py [--tasks 5000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import rrfp_async as rr
from rrfp_async._rng import TASK_RNG_LOCK, fork_seeded, task_seed
from rrfp_async.loop._executors import TaskContext


def _per_call(fn: Callable[[int], object], n: int) -> float:
    """Microseconds of this thread's CPU time per call of ``fn(i)`` over ``n`` calls (CPU
    time: other processes on the machine's cores change it less than the wall clock)."""
    t0 = time.thread_time()
    for i in range(n):
        fn(i)
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)

    def fork(i: int) -> None:
        with TASK_RNG_LOCK, fork_seeded(task_seed(0, 1, 2, i % 1000)):
            pass

    def torch_fork(i: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(task_seed(0, 1, 2, i % 1000))

    torch.manual_seed(0)
    mod = nn.Linear(8, 8)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=1, forward_only=True)
    x = torch.randn(2, 8)
    execs = {
        "F on": rr.TorchStageExecutor({0: mod}),
        "F off": rr.TorchStageExecutor({0: mod}, task_rng=False),
    }
    task = rr.Task(0, "F", 0)

    ctx = TaskContext(0, 1, plan, (x,))  # one step: its bookkeeping is once per step

    def forward(ex: rr.TorchStageExecutor) -> Callable[[int], object]:
        def one(i: int) -> object:
            return ex._run(task, x, ctx)

        return one

    rounds: dict[str, list[float]] = {"fork": [], "torch fork_rng": [], "F on": [], "F off": []}
    try:
        for r in range(args.rounds + 1):  # the first round warms up
            got = {
                "fork": _per_call(fork, args.tasks),
                "torch fork_rng": _per_call(torch_fork, args.tasks // 10),
            }
            order = ["F on", "F off"] if r % 2 else ["F off", "F on"]
            for name in order:
                got[name] = _per_call(forward(execs[name]), args.tasks)
            if r:
                for k, v in got.items():
                    rounds[k].append(v)
    finally:
        for ex in execs.values():
            ex.close()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    for k, v in med.items():
        lo, hi = min(rounds[k]), max(rounds[k])
        print(f"{k:>16}: {v:7.2f} us CPU per call (min {lo:.2f}, max {hi:.2f})")
    diffs = [a - b for a, b in zip(rounds["F on"], rounds["F off"], strict=True)]
    per = statistics.median(diffs)
    print(f"{'per-task cost':>16}: {per:7.2f} us CPU per forward (paired median)")


if __name__ == "__main__":
    main()
