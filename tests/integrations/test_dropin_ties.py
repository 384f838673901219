"""torch pipelining's tracer (``pipeline()``) with a tied weight, through the drop-in.

The tracer copies a parameter used by two stages into each (``pipe.replicated_params``) and
torch's own schedules leave the copies' gradients to the caller. The drop-in takes them as
``shared=rr.distributed.from_pipe(pipe).shared`` and reduces them at the end of every step,
adding each step's contribution once when steps accumulate.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

V, D, N_MB, BATCH, STEPS = 12, 8, 4, 8, 3


class Traced(nn.Module):
    """Embedding | head, split by ``pipe_split``; the head's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        h = torch.tanh(self.mid(self.emb(ids)))
        pipe_split()
        return self.head(h)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), target.reshape(-1))


def data(step: int) -> torch.Tensor:
    return torch.randint(0, V, (BATCH, 5), generator=torch.Generator().manual_seed(step))


def worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import pipeline

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.manual_seed(0)
    model = Traced()
    with warnings.catch_warnings():
        # torch's own tracer, on torch 2.13: "isinstance(treespec, LeafSpec) is deprecated".
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(model, mb_args=(data(0)[: BATCH // N_MB],))
    stage = pipe.build_stage(rank, torch.device("cpu"))
    sched = ScheduleReadinessFirst(
        stage,
        N_MB,
        loss_fn=loss_fn,
        scale_grads=False,
        shared=rr.distributed.from_pipe(pipe).shared,
    )
    tied = stage.submod.get_parameter("emb.weight" if rank == 0 else "head.weight")
    grads = []
    try:
        for step in range(STEPS):  # accumulated: no zero_grad
            ids = data(step)
            if rank == 0:
                sched.step(ids)
            else:
                sched.step(target=ids)
            assert tied.grad is not None
            grads.append(tied.grad.clone())
    finally:
        sched.close()
    return {"grads": grads}


def test_pipeline_replicated_params_accumulate_like_one_parameter() -> None:
    # Fails without shared= (the undeclared-tie check refuses the copies; unchecked, each
    # rank keeps its own gradient) and when accumulated steps sum the tie again
    # (2 G1 + G2 after two steps).
    r0, r1 = pooled_spawn(worker, 2, timeout=200)
    torch.manual_seed(0)
    model = Traced()
    for step in range(STEPS):
        ids = data(step)
        for chunk in ids.chunk(N_MB):
            loss_fn(model(chunk), chunk).backward()  # scale_grads=False: the summed losses
        want = model.emb.weight.grad
        assert want is not None
        for r in (r0, r1):
            torch.testing.assert_close(r["grads"][step], want, rtol=0, atol=1e-6)
