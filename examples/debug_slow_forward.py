"""A multi-process job with one slow task, written out for debugging (docs/debugging.md).

4 processes (gloo on 127.0.0.1), one pipeline stage each (a tanh(Linear)), 8 microbatches,
2 steps. Every forward takes 20 ms of EMULATED GPU time (a sleep on the compute thread)
except one: ``--slow-rank`` / ``--slow-mb`` (default rank 1, microbatch 3) takes ``--slow-ms``
(default 400). The microbatch index travels with the activations (a ``(tensor, int)`` value),
so the slow task is injected by name. Each rank writes what a real job would give you:

* ``OUT/rank{r}.log``: its debug-level JSON logs, one record per line (``jq``-friendly);
* ``OUT/traces/rank{r}.json``: its trace of the last step (``DistributedStage(trace_dir=)``).

Then::

    jq -c 'select(.event=="stall" and .step==1) | [.rank, .reason]' OUT/rank2.log
    rrfp-async trace OUT/traces --png OUT/timeline.png

Run: ``python examples/debug_slow_forward.py --out /tmp/slowfw [--policy strict]``: not
under torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment) it starts its 4 processes
itself; under ``torchrun --nproc-per-node 4`` it joins torchrun's.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import rrfp_async as rr

P, M, WIDTH, STEPS = 4, 8, 8, 2
BASE = 0.02


class Stage(nn.Module):
    """tanh(Linear), with a forward that sleeps (emulated GPU time) ``slow`` seconds for the
    chosen microbatch on the chosen rank, ``BASE`` otherwise."""

    def __init__(self, rank: int, slow: tuple[int, int, float]) -> None:
        super().__init__()
        torch.manual_seed(rank)
        self.rank = rank
        self.slow = slow
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, idx: int) -> tuple[torch.Tensor, int]:
        rank, mb, seconds = self.slow
        time.sleep(seconds if (self.rank, idx) == (rank, mb) else BASE)
        return torch.tanh(self.lin(x)), idx


def loss_fn(out: tuple[torch.Tensor, int], mb: Any) -> torch.Tensor:
    return out[0].pow(2).mean()


def worker(rank: int, world: int, out: str, policy: str, slow: tuple[int, int, float]) -> int:
    d = Path(out)
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    with open(d / f"rank{rank}.log", "w") as log:
        rr.configure_logging(format="json", level="debug", stream=log)
        ex = rr.TorchStageExecutor({rank: Stage(rank, slow)}, loss_fn, rank=rank)
        plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
        stage = rr.DistributedStage(
            layout,
            rr.StepSchedule.build(plan, "1f1b"),
            ex,
            groups=groups,
            policy=policy,
            observer=rr.LogObserver(rank=rank),
            trace_dir=d / "traces",  # one argument: every rank writes its trace there
            emulated_gpu_time=True,  # the forwards sleep for their GPU time: the traces say so
            step_timeout=60.0,
        )
        g = torch.Generator().manual_seed(0)
        mbs = [(torch.randn(2, WIDTH, generator=g), i) for i in range(M)]

        async def main() -> None:
            async with stage:
                for _ in range(STEPS):  # step 0 warms up; the trace holds step 1
                    await stage.run_step(mbs)

        try:
            rr.run(main())
        finally:
            ex.close()
    return rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the logs and traces")
    ap.add_argument("--policy", default="strict")
    ap.add_argument("--slow-rank", type=int, default=1)
    ap.add_argument("--slow-mb", type=int, default=3)
    ap.add_argument("--slow-ms", type=float, default=400.0)
    args = ap.parse_args()
    if not 0 <= args.slow_rank < P or not 0 <= args.slow_mb < M:
        ap.error(f"--slow-rank must be in [0, {P}) and --slow-mb in [0, {M})")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    slow = (args.slow_rank, args.slow_mb, args.slow_ms / 1e3)
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start them here
        rr.spawn(worker, P, args.out, args.policy, slow, timeout=300)
    else:
        dist.init_process_group("gloo")  # torchrun's env:// rendezvous
        try:
            if dist.get_world_size() != P:
                raise SystemExit(f"run under torchrun --nproc-per-node {P}")
            worker(dist.get_rank(), P, args.out, args.policy, slow)
            dist.barrier()  # nobody tears the group down while a peer still communicates
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    print(
        f"wrote {args.out}/rank{{0..{P - 1}}}.log and {args.out}/traces/rank{{0..{P - 1}}}.json"
        f" ({P} processes, policy {args.policy}, {args.slow_rank}F{args.slow_mb} slow:"
        f" {args.slow_ms:.0f} ms; EMULATED GPU time)"
    )


if __name__ == "__main__":
    main()
