"""Tied parameters across processes, steps of any size and forward-only steps.

Two ranks: an embedding on rank 0 whose weight is also the output projection on rank 1 (as
GPT-2 ties ``wte`` and ``lm_head``). Each process builds both from the same seed and keeps
its own stage, so each holds its own copy of the tied weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

V = 30


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> Any:
        return (torch.tanh(self.lin(self.emb(ids))), ids.shape[1])


class Head(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.norm = nn.LayerNorm(8)  # constant-initialised: never taken for a tie

    def forward(self, h: torch.Tensor, length: int) -> torch.Tensor:
        assert isinstance(length, int)
        return self.norm(h) @ self.weight.t()


def build() -> tuple[Embed, Head]:
    torch.manual_seed(0)
    e = Embed()
    return e, Head(nn.Parameter(e.emb.weight.detach().clone()))


def batches(step: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, V, (2, 3 + (i + step) % 4), generator=g) for i in range(n)]


def loss_fn(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), ids.reshape(-1))


SPEC = {"wte": [(0, "emb.weight"), (1, "weight")]}
SIZES = (4, 2, 5)  # microbatches per step: steps of other sizes without reopening


def reference() -> dict[str, torch.Tensor]:
    """One process, one tied parameter object: what both ranks must end with."""
    torch.manual_seed(0)
    e = Embed()
    h = Head(e.emb.weight)
    params = [*e.parameters(), h.norm.weight, h.norm.bias]
    opt = torch.optim.SGD(params, lr=0.5)
    for step, n in enumerate(SIZES):
        for ids in batches(step, n):
            (loss_fn(h(*e(ids)), ids) / n).backward()
        opt.step()
        opt.zero_grad()
    return {"wte": e.emb.weight.detach().clone(), "norm": h.norm.weight.detach().clone()}


def as_dtensors(mod: nn.Module, rank: int) -> None:
    """Every parameter of ``mod`` as a DTensor on this rank's 1-device mesh (the pipeline
    ranks' meshes, as torchtitan builds them: PP x a data-parallel dimension of size 1);
    rank 1's matrices sharded (on one device a shard holds every value)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    for m in mod.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            where = Shard(0) if p.dim() > 1 and rank == 1 else Replicate()
            setattr(m, name, nn.Parameter(DTensor.from_local(p.detach(), mesh, [where])))


def worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    e, h = build()
    mod: nn.Module = e if rank == 0 else h
    if mode == "dtensor":
        as_dtensors(mod, rank)
    ex = rr.TorchStageExecutor(
        {rank: mod}, loss_fn, rank=rank, shared=SPEC if mode == "declared" else None
    )
    layout = rr.ProcessLayout.from_world(pp=2)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=SIZES[0])
    opt = torch.optim.SGD(mod.parameters(), lr=0.5)
    out: dict[str, Any] = {}

    async def go() -> None:
        async with rr.DistributedStage(
            layout,
            rr.StepSchedule.build(plan),
            ex,
            step_timeout=60,
            check_ties=mode != "unchecked",
        ) as st:
            for step, n in enumerate(SIZES):
                await st.run_step(batches(step, n))
                opt.step()
                opt.zero_grad()
            ev = await st.run_step(batches(9, 3), train=False)
            out["eval"] = None if ev.outputs is None else [tuple(o.shape) for o in ev.outputs]
            out["eval_losses"] = ev.losses

    try:
        rr.run(go())
    except rr.PlanError as err:
        out["error"] = str(err)
    finally:
        ex.close()
    w = e.emb.weight if rank == 0 else h.weight
    out["wte"] = w.detach().clone()
    out["norm"] = h.norm.weight.detach().clone()
    return out


def test_declared_tie_trains_like_one_parameter() -> None:
    # Fails when DistributedStage does not sum the tie's gradients over the two ranks.
    r0, r1 = pooled_spawn(worker, 2, "declared", timeout=150)
    ref = reference()
    assert "error" not in r0 and "error" not in r1
    torch.testing.assert_close(r0["wte"], ref["wte"], rtol=0, atol=1e-6)
    torch.testing.assert_close(r1["wte"], ref["wte"], rtol=0, atol=1e-6)
    torch.testing.assert_close(r1["norm"], ref["norm"], rtol=0, atol=1e-6)
    # the forward-only step after training: outputs of 3 microbatches, in order, on rank 1
    assert r0["eval"] is None
    assert [s[:2] for s in r1["eval"]] == [(2, 3 + (i + 9) % 4) for i in range(3)]
    assert r1["eval_losses"] is not None and len(r1["eval_losses"]) == 3


def test_an_undeclared_tie_is_an_error_on_every_rank_naming_both() -> None:
    r0, r1 = pooled_spawn(worker, 2, "undeclared", timeout=150)
    for r in (r0, r1):
        msg = r.get("error", "")
        assert "'emb.weight' of virtual stage 0 on global rank 0" in msg, msg
        assert "'weight' of virtual stage 1 on global rank 1" in msg, msg
        assert "norm" not in msg.split("tied weights do:")[1].split(".")[0]


def test_an_undeclared_tie_of_dtensor_parameters_is_found() -> None:
    # torchtitan's parameters are DTensors; the check fingerprints each rank's local shard
    # (it failed with ".tolist() is not supported for tensor subclasses, got DTensor").
    r0, r1 = pooled_spawn(worker, 2, "dtensor", timeout=150)
    for r in (r0, r1):
        msg = r.get("error", "")
        assert "'emb.weight' of virtual stage 0 on global rank 0" in msg, msg
        assert "'weight' of virtual stage 1 on global rank 1" in msg, msg
        assert "norm" not in msg.split("tied weights do:")[1].split(".")[0]


def test_without_the_check_an_undeclared_tie_drifts() -> None:
    # What the check protects against: each rank trains its own copy.
    r0, r1 = pooled_spawn(worker, 2, "unchecked", timeout=150)
    assert "error" not in r0
    assert not torch.allclose(r0["wte"], r1["wte"], atol=1e-4)


def same_seed_worker(rank: int, world: int) -> dict[str, Any]:
    """Every rank seeds alike and builds its stage: two look-alike Linears, 'lin.weight' on
    both ranks, equal values, no tie."""
    import logging

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mod = nn.Sequential()
    mod.add_module("lin", nn.Linear(8, 8))
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("rrfp_async.distributed._ties")
    log.addHandler(Keep())
    ex = rr.TorchStageExecutor(
        {rank: mod}, (lambda out, mb: out.pow(2).mean()) if rank == 1 else None, rank=rank
    )
    layout = rr.ProcessLayout.from_world(pp=2)
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    out: dict[str, Any] = {}
    try:
        with rr.DistributedStage(layout, rr.StepSchedule.build(plan), ex, step_timeout=60) as st:
            out["step"] = st.run_step_sync([torch.randn(3, 8), torch.randn(3, 8)]).step
    except rr.PlanError as err:
        out["error"] = str(err)
    finally:
        ex.close()
    out["warnings"] = seen
    return out


def test_stages_built_alike_from_one_seed_train_with_a_warning() -> None:
    """Equal values under one name (the same code built both stages from the same seed) are
    no tie: the step runs and a warning says what was seen (refused as a tie before, with
    check_ties=False the only way out); a shared weight under two names stays refused
    (test_an_undeclared_tie_is_an_error_on_every_rank_naming_both)."""
    r0, r1 = pooled_spawn(same_seed_worker, 2, timeout=150)
    for r in (r0, r1):
        assert "error" not in r, r["error"]
        assert r["step"] == 0
        (w,) = r["warnings"]
        assert "'lin.weight' of virtual stages 0 (global rank 0) and 1 (global rank 1)" in w
        assert "same seed" in w and "declare the tie" in w
