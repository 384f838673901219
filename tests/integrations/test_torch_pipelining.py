"""The torch.distributed.pipelining drop-in against torch's own schedules.

The worker is a script written the way torch's documentation writes one (a ``PipelineStage``
around this rank's part of the model, a schedule, ``step(x)`` / ``step()`` /
``step(target=y, losses=losses)``); the only difference between the runs is the schedule
line.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

D, N_MB, BATCH = 16, 6, 12  # M = 6: dividing by it is inexact (4 would hide where it happens)


def full_model(n_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n_stages)])


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def make_schedule(which: str, stages: list[Any], n: int) -> Any:
    import torch.distributed.pipelining as tp

    from rrfp_async.pipelining import ScheduleReadinessFirst

    one: Any = stages[0] if len(stages) == 1 else stages
    if which == "torch":  # the line a user changes
        cls = tp.Schedule1F1B if len(stages) == 1 else tp.ScheduleInterleaved1F1B
        return cls(one, n, loss_fn=loss_fn)
    if which == "strict":  # our runtime, torch's order task for task
        hint = tp.Schedule1F1B if len(stages) == 1 else tp.ScheduleInterleaved1F1B
        return ScheduleReadinessFirst(one, n, loss_fn=loss_fn, hint=hint, policy="strict")
    return ScheduleReadinessFirst(one, n, loss_fn=loss_fn)  # the defaults


def worker(rank: int, world: int, which: str, chunks: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    n_stages = world * chunks
    model = full_model(n_stages)
    mine = [i for i in range(n_stages) if i % world == rank]
    stages = [PipelineStage(model[i], i, n_stages, torch.device("cpu")) for i in mine]
    schedule = make_schedule(which, stages, N_MB)
    params = [p for i in mine for p in model[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    all_losses: list[float] = []
    out = None
    for step in range(3):
        x, y = data(step)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses: list[Any] = []
            out = schedule.step(target=y, losses=losses)
            all_losses += [float(v) for v in losses]
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    close = getattr(schedule, "close", None)
    if close is not None:
        close()
    return {
        "params": [p.detach().clone() for p in params],
        "losses": all_losses,
        "out": None if out is None else out.detach().clone(),
    }


@pytest.mark.parametrize("chunks", [1, 2], ids=["1f1b", "interleaved"])
def test_same_script_one_changed_line_same_parameters_as_torch(chunks: int) -> None:
    world = 2
    want = pooled_spawn(worker, world, "torch", chunks, timeout=200)
    strict = pooled_spawn(worker, world, "strict", chunks, timeout=200)
    default = pooled_spawn(worker, world, "default", chunks, timeout=200)
    for r in range(world):
        for a, b in zip(strict[r]["params"], want[r]["params"], strict=True):
            assert torch.equal(a, b), (a - b).abs().max()  # bitwise: same order
        for a, b in zip(default[r]["params"], want[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    last = world - 1
    assert len(want[last]["losses"]) == 3 * N_MB
    assert strict[last]["losses"] == want[last]["losses"]
    torch.testing.assert_close(default[last]["losses"], want[last]["losses"])
    assert strict[last]["out"].shape == (BATCH, D)
    assert torch.equal(strict[last]["out"], want[last]["out"])
    assert strict[0]["out"] is None


def variable_worker(rank: int, world: int) -> dict[str, Any]:
    """Microbatches of different lengths (sequence models): torch's PipelineStage cannot
    take them; ``step_microbatches`` can."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    model = full_model(world)
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3 + 4 * i, D, generator=g) for i in range(5)]  # [batch, len, D]
    ys = [torch.randn_like(x) for x in xs]
    with ScheduleReadinessFirst(stage, 5, loss_fn=loss_fn) as schedule:
        losses: list[Any] = []
        outs = schedule.step_microbatches(
            arg_mbs=[(x,) for x in xs] if rank == 0 else None,
            target_mbs=ys if rank == world - 1 else None,
            losses=losses,
            n_microbatches=5,
        )
        x_eval = torch.randn(8, D, generator=g)
        ev = schedule.eval(x_eval) if rank == 0 else schedule.eval()
    return {
        "grads": [p.grad.clone() for p in model[rank].parameters()],
        "losses": [float(v) for v in losses],
        "shapes": None if outs is None else [tuple(o.shape) for o in outs],
        "eval": None if ev is None else tuple(ev.shape),
    }


def test_variable_length_microbatches_torch_cannot_take() -> None:
    world = 2
    res = pooled_spawn(variable_worker, world, timeout=200)
    model = full_model(world)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3 + 4 * i, D, generator=g) for i in range(5)]
    ys = [torch.randn_like(x) for x in xs]
    want_losses = []
    for x, y in zip(xs, ys, strict=True):
        loss = loss_fn(model(x), y)
        want_losses.append(float(loss.detach()))
        loss.backward()
    for p in model.parameters():
        assert p.grad is not None
        p.grad /= len(xs)  # scale_grads=True
    for r in range(world):
        for a, b in zip(res[r]["grads"], model[r].parameters(), strict=True):
            torch.testing.assert_close(a, b.grad, rtol=0, atol=1e-6)
    assert res[1]["shapes"] == [(2, 3 + 4 * i, D) for i in range(5)]
    torch.testing.assert_close(res[1]["losses"], want_losses)
    assert res[1]["eval"] == (8, D) and res[0]["eval"] is None


def test_unsupported_features_are_named() -> None:
    from rrfp_async.pipelining import ScheduleReadinessFirst

    with pytest.raises(
        rr.PlanError, match=r"takes the torch\.distributed\.pipelining PipelineStage"
    ):
        ScheduleReadinessFirst(nn.Linear(2, 2), 4)


def async_worker(rank: int, world: int) -> dict[str, Any]:
    """The same script from an async training loop: ``await schedule.step_async(...)``."""
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    model = full_model(world)
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))
    schedule = ScheduleReadinessFirst(
        stage, N_MB, loss_fn=loss_fn, hint=tp.Schedule1F1B, policy="strict"
    )
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.1)

    async def main() -> None:
        for step in range(3):
            x, y = data(step)
            if rank == 0:
                await schedule.step_async(x)
            else:
                await schedule.step_async(target=y, losses=[])
            opt.step()
            opt.zero_grad()
        await schedule.aclose()

    rr.run(main())
    return {"params": [p.detach().clone() for p in model[rank].parameters()]}


def test_step_async_trains_like_torch() -> None:
    want = pooled_spawn(worker, 2, "torch", 1, timeout=200)
    got = pooled_spawn(async_worker, 2, timeout=200)
    for r in range(2):
        for a, b in zip(got[r]["params"], want[r]["params"], strict=True):
            assert torch.equal(a, b), (a - b).abs().max()


class KwStage(nn.Module):
    """A block that takes a keyword input on every stage, as torchtitan's blocks take
    ``positions`` / ``attention_masks``: torch hands each microbatch's keyword inputs to every
    stage's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        # Optional, as torchtitan's masks are: a stage that never gets it runs without error
        # and computes something else.
        return torch.tanh(self.lin(x) * (1.0 if scale is None else scale))


def kw_loss(out: torch.Tensor, target: torch.Tensor, *, weight: float = 1.0) -> torch.Tensor:
    return F.mse_loss(out, target) * weight


def kw_worker(rank: int, world: int, which: str) -> dict[str, Any]:
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.ModuleList([KwStage() for _ in range(world)])
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))
    if which == "torch":
        schedule: Any = tp.Schedule1F1B(stage, N_MB, loss_fn=kw_loss)
    else:
        hint = tp.Schedule1F1B if which == "strict" else None
        policy = "strict" if which == "strict" else "readiness_first"
        schedule = ScheduleReadinessFirst(stage, N_MB, loss_fn=kw_loss, hint=hint, policy=policy)
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.1)
    all_losses: list[float] = []
    for step in range(2):
        x, y = data(step)
        # Per-sample scales, chunked with the batch like any keyword input; every rank passes
        # them (each rank's loader computes them, as torchtitan's does for positions).
        scale = 0.5 + torch.arange(BATCH, dtype=torch.float32).reshape(BATCH, 1) / BATCH
        losses: list[Any] = []
        lk = {"weight": 2.0}
        if rank == 0:
            schedule.step(x, scale=scale, loss_kwargs=lk)
        else:
            schedule.step(target=y, losses=losses, scale=scale, loss_kwargs=lk)
            all_losses += [float(torch.as_tensor(v).detach()) for v in losses]
        opt.step()
        opt.zero_grad()
    close = getattr(schedule, "close", None)
    if close is not None:
        close()
    return {"params": [p.detach().clone() for p in model[rank].parameters()], "losses": all_losses}


def test_keyword_inputs_reach_every_stage_as_in_torch() -> None:
    """Fails on a drop-in that gives keyword inputs to the first stage only (silently wrong
    before: the loss differed from torch's with no error)."""
    want = pooled_spawn(kw_worker, 2, "torch", timeout=200)
    strict = pooled_spawn(kw_worker, 2, "strict", timeout=200)
    default = pooled_spawn(kw_worker, 2, "default", timeout=200)
    assert len(want[1]["losses"]) == 2 * N_MB
    assert strict[1]["losses"] == want[1]["losses"]
    torch.testing.assert_close(default[1]["losses"], want[1]["losses"])
    for r in range(2):
        for a, b in zip(strict[r]["params"], want[r]["params"], strict=True):
            assert torch.equal(a, b), (a - b).abs().max()
        for a, b in zip(default[r]["params"], want[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def fsdp_worker(rank: int, world: int) -> dict[str, Any]:
    """A stage wrapped in FSDP2 (``fully_shard``, as torchtitan wraps every stage) under a
    split-backward order, and under 1F1B."""
    import torch.distributed.pipelining as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    part = cast(nn.Sequential, full_model(world)[rank])
    fully_shard(part[0], mesh=mesh["dp"])
    stage = PipelineStage(part, rank, world, torch.device("cpu"), group=mesh.get_group("pp"))
    out: dict[str, Any] = {}
    for name, kw in (
        ("split", {"split_backward": True}),
        ("zb_h1", {"hint": "zb_h1", "split_backward": True}),
        ("1f1b", {"hint": tp.Schedule1F1B}),
    ):
        try:
            ScheduleReadinessFirst(stage, N_MB, loss_fn=loss_fn, **kw).close()
            out[name] = "built"
        except rr.PlanError as e:
            out[name] = str(e)
    return out


def test_split_backward_is_refused_on_fsdp_stages() -> None:
    # W calls the weight-gradient nodes itself, past FSDP's unshard and reduce-scatter: it
    # failed at the first W (resharded storage) or, with the storage kept, lost gradients.
    for r in pooled_spawn(fsdp_worker, 2, timeout=200):
        for name in ("split", "zb_h1"):
            assert "split backward" in r[name] and "FSDP-wrapped modules (0)" in r[name], r
        assert r["1f1b"] == "built"
