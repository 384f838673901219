"""A torch.distributed.pipelining script, switched to readiness-first by one changed line.

    python examples/torch_pipelining_dropin.py          # 2 processes, gloo, CPU
    python examples/torch_pipelining_dropin.py --torch  # the same with torch's 1F1B
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29513 \\
        examples/torch_pipelining_dropin.py

Not under torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment), the script starts its
2 processes itself; under torchrun it joins torchrun's (``--spawn``, once needed for the
former, is still accepted and changes nothing).

Everything below ``main`` is written the way torch's pipelining documentation writes it: a
``PipelineStage`` around this rank's part of the model, a schedule, ``schedule.step(x)`` on
the first rank, ``schedule.step(target=y, losses=losses)`` on the last. The one line that
differs is marked. The script prints each step's mean loss on the last rank and, at the end,
a checksum of the parameters: run it with and without ``--torch`` and they agree (to float
rounding; bitwise with ``--strict``, which keeps torch's 1F1B order).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import rrfp_async as rr
from rrfp_async.pipelining import ScheduleReadinessFirst

D, BATCH, N_MICROBATCHES = 64, 32, 8


def build(n_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.GELU()) for _ in range(n_stages)])


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    model = build(world)
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    if args.torch:
        schedule = Schedule1F1B(stage, N_MICROBATCHES, loss_fn=loss_fn)
    else:  # <- the one changed line (`hint`/`policy` only for the bitwise comparison)
        extra = {"hint": Schedule1F1B, "policy": "strict"} if args.strict else {}
        schedule = ScheduleReadinessFirst(stage, N_MICROBATCHES, loss_fn=loss_fn, **extra)

    opt = torch.optim.SGD(model[rank].parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            print(f"step {step}  loss {torch.stack(losses).mean().item():.6f}", flush=True)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    check = torch.tensor([sum(float(p.detach().double().sum()) for p in model[rank].parameters())])
    dist.all_reduce(check)
    if rank == world - 1:
        print(f"parameter checksum {check.item():.12f}", flush=True)


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    run(rank, world, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="accepted for old command lines: without torchrun the script starts its processes",
    )
    ap.add_argument("--torch", action="store_true", help="torch's own Schedule1F1B")
    ap.add_argument("--strict", action="store_true", help="torch's 1F1B order, bitwise")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start them here
        rr.spawn(_spawned, 2, args, timeout=300)
        return
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    try:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
