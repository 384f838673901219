"""A torch pipelining program as its users write it, with the schedule class swapped and no
``close()``: run under torchrun by ``tests/integrations/test_dropin_exit.py`` and
``scripts/dropin_exits.py``, which require every rank to exit 0.

    torchrun --nproc-per-node 2 tests/integrations/exit_jobs/torch_job.py MODE

MODE picks how the program ends or what it steps (each is a way users' programs are seen
to end): ``tutorial`` (torch's pipelining tutorial's shape: a manually split transformer,
one GPipe-style step, ``dist.destroy_process_group()``), ``loop`` (the README's diff: steps
with an optimizer, then destroy), ``no_destroy`` (the program just ends), ``by_name``
(``destroy_process_group`` imported by name before rrfp_async, so no hook sees it),
``collected`` (the schedule dropped and garbage-collected, a new one built and stepped),
``async`` (``step_async`` inside ``asyncio.run``, no ``aclose``), ``interleaved`` (two
stages per rank, looped placement) and ``vshape`` (two stages per rank, V placement, torch's
ZB-V hint).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from typing import Any

import torch

if sys.argv[1:] == ["by_name"]:
    from torch.distributed import destroy_process_group as destroy_by_name

import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

from rrfp_async.distributed._lifetime import open_stages
from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

MODE = sys.argv[1]
D, BATCH, N_MB = 32, 16, 4
# The schedule lives to the end of the program, as a user's module-level schedule does: its
# stage is open at exit (at destroy_process_group, or at interpreter exit with no destroy),
# so the exit hooks, not garbage collection, must close it.
KEEP: list[object] = []


class Decoder(nn.Module):
    """Embedding, blocks, norm, head; a stage keeps its part (the rest set to None)."""

    def __init__(self, vocab: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.emb: nn.Module | None = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleDict({str(i): nn.Linear(D, D) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(D)
        self.head: nn.Module | None = nn.Linear(D, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for block in self.blocks.values():
            h = torch.tanh(block(h))
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def part(model: Decoder, index: int, n: int) -> Decoder:
    """Stage ``index`` of ``n``: its blocks, the embedding first, norm and head last."""
    per = len(model.blocks) // n
    for i in list(model.blocks):
        if not index * per <= int(i) < (index + 1) * per:
            del model.blocks[i]
    if index != 0:
        model.emb = None
    if index != n - 1:
        model.norm = model.head = None
    return model


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randint(0, 64, (BATCH, 8))
    y = torch.randint(0, 64, (BATCH, 8))
    if MODE in ("interleaved", "vshape"):
        n = 2 * world
        indices = [rank, n - 1 - rank] if MODE == "vshape" else [rank, rank + world]
        stages = [
            PipelineStage(part(Decoder(layers=n), i, n), i, n, torch.device("cpu")) for i in indices
        ]
        extra: dict[str, Any] = {"hint": ScheduleZBVZeroBubble} if MODE == "vshape" else {}
        schedule: ScheduleReadinessFirst | ScheduleInterleavedReadinessFirst = (
            ScheduleInterleavedReadinessFirst(stages, N_MB, loss_fn=loss_fn, **extra)
        )
        first, last = 0 in indices, n - 1 in indices
    else:
        stage = PipelineStage(part(Decoder(), rank, world), rank, world, torch.device("cpu"))
        schedule = ScheduleReadinessFirst(stage, N_MB, loss_fn=loss_fn)
        first, last = rank == 0, rank == world - 1

    def step() -> None:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        if MODE == "async":
            asyncio.run(schedule.step_async(*args, target=y if last else None, losses=losses))
        else:
            schedule.step(*args, target=y if last else None, losses=losses)
        if last:
            print(f"rank {rank} loss {torch.stack(losses).mean().item():.4f}", flush=True)

    steps = 3 if MODE == "loop" else 1
    for _ in range(steps):
        step()
    if MODE == "collected":
        del schedule
        gc.collect()
        print(f"rank {rank} open after collect {len(open_stages())}", flush=True)
        stage = PipelineStage(part(Decoder(), rank, world), rank, world, torch.device("cpu"))
        schedule = ScheduleReadinessFirst(stage, N_MB, loss_fn=loss_fn)
        step()
    KEEP.append(schedule)
    print(f"rank {rank} done {MODE}", flush=True)
    if MODE == "by_name":
        destroy_by_name()
    elif MODE != "no_destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
