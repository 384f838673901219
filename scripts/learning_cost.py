"""What the torch drop-in's learning costs on the step's path (``_torch_learning``): steps of
variable-length microbatches on gloo processes (a stack of ``Linear(64, 64) + tanh``, 16
microbatches of 8-256 rows, new lengths every step), one schedule with no argument (it reads
the sizes, measures, exchanges, learns and plans in bytes) and one with ``sizes=False`` (the
fixed order's count bound, nothing learned), stepped in alternation (which one first
alternating too); the parts of the
learning timed inside the run: ``schedule`` (the sizes' broadcast and the step's plan) and
``observe`` (the two all-gathers and the fits), medians over the timed steps. Real CPU
compute, no emulated time.

    python scripts/learning_cost.py [--world 4] [--steps 20] [--budget 1.5] [--uniform]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from rrfp_async.integrations import _torch_learning

D, M = 64, 16


def _timed(cls: Any, name: str, sink: dict[str, list[float]]) -> None:
    fn = getattr(cls, name)

    def wrapper(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            sink.setdefault(name, []).append(time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def worker(
    rank: int, world: int, steps: int, budget: float | None, uniform: bool
) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    parts: dict[str, list[float]] = {}
    _timed(_torch_learning.StepLearning, "schedule", parts)
    _timed(_torch_learning.StepLearning, "observe", parts)
    torch.manual_seed(rank)  # (each rank its own stage's weights)
    mods = {
        k: nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)])
        for k in ("learn", "fixed")
    }
    scheds = {
        k: ScheduleReadinessFirst(
            PipelineStage(mods[k], rank, world, torch.device("cpu")),
            M,
            loss_fn=F.mse_loss,
            **({"memory_budget": budget} if k == "learn" else {"sizes": False}),
        )
        for k in mods
    }
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {k: [] for k in scheds}
    for s in range(steps + 3):
        lengths = torch.randint(8, 257, (M,), generator=g).tolist()
        if uniform:  # the same work, one size: only the sizes' broadcast is left
            lengths = [sum(lengths) // M] * M
        xs = [torch.randn(1, n, D, generator=g) for n in lengths]
        # Which one runs first alternates step by step (the second of a pair runs slower
        # here: its first forward waits on the previous one's tail).
        for k in sorted(scheds, reverse=s % 2 == 1):
            sched = scheds[k]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            sched.step_microbatches(
                arg_mbs=[(x,) for x in xs] if rank == 0 else None,
                target_mbs=[torch.zeros_like(x) for x in xs] if rank == world - 1 else None,
            )
            if s >= 3:  # (the first steps: before the fits, and the learning group made)
                times[k].append(time.perf_counter() - t0)
            mods[k].zero_grad(set_to_none=True)
    learned = scheds["learn"].learned_bytes
    out = {
        "step_learn": statistics.median(times["learn"]),
        "step_fixed": statistics.median(times["fixed"]),
        "schedule": statistics.median(parts["schedule"][3:]),
        "observe": statistics.median(parts.get("observe", [0.0] * 4)[3:]),
        "fitted": learned is not None and learned.ready(scheds["learn"].plan),
    }
    for sched in scheds.values():
        sched.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=None, help="memory_budget of the learning one")
    ap.add_argument("--uniform", action="store_true", help="every microbatch of a step one size")
    a = ap.parse_args()
    res = rr.spawn(worker, a.world, a.steps, a.budget, a.uniform, timeout=900)
    rows = "one size a step" if a.uniform else "8-256 rows"
    print(f"{a.world} gloo processes, {M} microbatches ({rows}), {a.steps} timed steps")
    print("rank  step learning  step fixed  ratio  schedule(ms)  observe(ms)  fitted")
    for r, o in enumerate(res):
        print(
            f"{r:4d}  {o['step_learn'] * 1e3:11.1f}  {o['step_fixed'] * 1e3:10.1f}"
            f"  {o['step_fixed'] / o['step_learn']:5.3f}  {o['schedule'] * 1e3:12.2f}"
            f"  {o['observe'] * 1e3:11.2f}  {o['fitted']}"
        )


if __name__ == "__main__":
    main()
