"""The torch pipelining drop-in called the ways today's users call torch's schedules.

* torchtitan's: the schedule class decided by ``issubclass(cls, PipelineScheduleSingle /
  PipelineScheduleMulti)``, built as ``cls(stages[0], n_microbatches=, loss_fn=,
  scale_grads=False)`` or ``cls(stages, n_microbatches=, loss_fn=, scale_grads=False,
  backward_requires_autograd=True)``, stepped pre-split: ``step(arg_mbs=, kwarg_mbs=,
  target_mbs=, losses=, loss_kwargs=, return_outputs=False)``, with keyword inputs that every
  stage's forward takes.
* V-shape placement (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): their orders, their
  input/weight split of the backward.

Each is compared with torch's own schedule on the same model and data: bitwise under the
strict policy (the same order), within fp32 summation order under readiness-first. The
reference is torch's whole-batch ``step`` (every torch version has it) with the microbatches
our pre-split call gets made by torch's own ``split_args_kwargs_into_chunks``; where the
installed torch has the pre-split call too (2.14+), torch's pre-split call is compared as well.
The compat tier runs this module again on torch 2.14 (``tests/compat``).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

D, BATCH = 8, 8


class Block(nn.Module):
    """A block that takes a keyword input on every stage (as torchtitan's take positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tanh(self.lin(x) * (1.0 if scale is None else scale))


def loss_fn(out: torch.Tensor, target: torch.Tensor, *, tokens: float = 1.0) -> torch.Tensor:
    # torchtitan's loss: a sum over the microbatch divided by a count given in loss_kwargs.
    return F.mse_loss(out, target, reduction="sum") / tokens


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    scale = 0.5 + torch.rand(BATCH, 1, generator=g)
    return x, y, scale


def torch_has_presplit_step() -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "arg_mbs" in inspect.signature(PipelineScheduleSingle.step).parameters


def _schedule(which: str, torch_cls: Any, stages: list[Any], n: int) -> Any:
    """The schedule class a user (or torchtitan's ``get_schedule_class``) picked, built the
    way torchtitan builds one."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

    if which == "torch":
        cls: Any = torch_cls
        extra: dict[str, Any] = {}
    else:
        multi = issubclass(torch_cls, PipelineScheduleMulti)
        cls = ScheduleInterleavedReadinessFirst if multi else ScheduleReadinessFirst
        extra = {"hint": torch_cls, "policy": "strict"} if which == "strict" else {}
        if which == "hinted":  # torch's order as the hint, readiness-first
            extra = {"hint": torch_cls}
    if issubclass(cls, PipelineScheduleMulti):
        return cls(
            stages,
            n_microbatches=n,
            loss_fn=loss_fn,
            scale_grads=False,
            backward_requires_autograd=True,
            **extra,
        )
    return cls(stages[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=False, **extra)


def worker(rank: int, world: int, which: str, schedule_name: str, n: int) -> dict[str, Any]:
    """Three training steps and an eval: the whole-batch call (the reference's) or the
    pre-split one (torchtitan's trainer), on every stage placement the schedule uses."""
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    torch.set_num_threads(1)
    torch_cls = getattr(tp, schedule_name)
    chunks = 1 if issubclass(torch_cls, tp.schedules.PipelineScheduleSingle) else 2
    n_stages = world * chunks
    vshape = schedule_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    mine = [rank, 2 * world - 1 - rank] if vshape else list(range(rank, n_stages, world))
    torch.manual_seed(0)
    model = nn.ModuleList([Block() for _ in range(n_stages)])
    stages = [PipelineStage(model[i], i, n_stages, torch.device("cpu")) for i in mine]
    sched = _schedule(which, torch_cls, stages, n)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    params = [p for i in mine for p in model[i].parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    presplit = which != "torch" or torch_has_presplit_step()
    out: dict[str, Any] = {"losses": [], "presplit": presplit}
    # Evaluation first, on the initial weights (the same in every run and in the test).
    x, y, scale = batch(9)
    ev_losses: list[Any] | None = [] if last else None
    multi = issubclass(torch_cls, tp.schedules.PipelineScheduleMulti)
    if which == "torch" and multi:
        ev = None  # torch's multi-stage eval runs backward actions (2.13): the test's reference
    elif presplit:
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks((x,), {"scale": scale}, n)
        ev = sched.eval(
            arg_mbs=arg_mbs if first else None,
            kwarg_mbs=kwarg_mbs,
            target_mbs=list(torch.tensor_split(y, n)) if last else None,
            losses=ev_losses,
        )
    else:
        # (torch 2.13's eval with a loss_fn needs the target on the last stage)
        ev = sched.eval(
            *((x,) if first else ()), target=y if last else None, losses=ev_losses, scale=scale
        )
    out["eval"] = None if ev is None else ev.detach().clone()
    out["eval_losses"] = [float(v.detach()) for v in ev_losses or []]
    for step in range(3):
        x, y, scale = batch(step)
        lk = {"tokens": float(BATCH // n * D)}
        losses: list[Any] | None = [] if last else None
        if presplit:
            arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks((x,), {"scale": scale}, n)
            target_mbs = list(torch.tensor_split(y, n)) if last else None
            ret = sched.step(
                arg_mbs=arg_mbs if first else None,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs,
                losses=losses,
                loss_kwargs=lk,
                return_outputs=False,
            )
            assert ret is None
        else:
            sched.step(
                *((x,) if first else ()),
                target=y if last else None,
                losses=losses,
                loss_kwargs=lk,
                scale=scale,
            )
        if losses is not None:
            out["losses"] += [float(v.detach()) for v in losses]
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().clone() for p in params]
    close = getattr(sched, "close", None)
    if close is not None:
        close()
    return out


def reference_eval(schedule: str, n: int) -> tuple[torch.Tensor, list[float]]:
    """The whole model's forward on the eval batch, microbatch by microbatch, in this
    process: the outputs and the losses every run's ``eval`` must give."""
    chunks = 1 if schedule == "Schedule1F1B" else 2
    torch.manual_seed(0)
    model = nn.ModuleList([Block() for _ in range(2 * chunks)])
    x, y, scale = batch(9)
    outs, losses = [], []
    with torch.no_grad():
        for xm, ym, sm in zip(
            torch.tensor_split(x, n),
            torch.tensor_split(y, n),
            torch.tensor_split(scale, n),
            strict=True,
        ):
            h = xm
            for block in model:
                h = block(h, scale=sm)
            outs.append(h)
            losses.append(float(loss_fn(h, ym)))
    return torch.cat(outs), losses


CASES = [
    ("Schedule1F1B", 4),
    ("ScheduleInterleaved1F1B", 4),
    ("ScheduleZBVZeroBubble", 4),
    ("ScheduleDualPipeV", 4),
]


@pytest.mark.parametrize(("schedule", "n"), CASES, ids=[c[0] for c in CASES])
def test_torchtitan_call_style_gives_torchs_result(schedule: str, n: int) -> None:
    world = 2
    want = pooled_spawn(worker, world, "torch", schedule, n, timeout=300)
    strict = pooled_spawn(worker, world, "strict", schedule, n, timeout=300)
    default = pooled_spawn(worker, world, "default", schedule, n, timeout=300)
    holder = [r for r in range(world) if want[r]["losses"]]
    assert len(holder) == 1 and len(want[holder[0]]["losses"]) == 3 * n
    assert len(strict[holder[0]]["eval_losses"]) == n
    h = holder[0]
    assert strict[h]["presplit"] and default[h]["presplit"]
    assert strict[h]["losses"] == want[h]["losses"]
    torch.testing.assert_close(default[h]["losses"], want[h]["losses"], rtol=0, atol=1e-6)
    for r in range(world):
        for a, b in zip(strict[r]["params"], want[r]["params"], strict=True):
            assert torch.equal(a, b), (schedule, r, (a - b).abs().max())
        for a, b in zip(default[r]["params"], want[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        if r != h:
            assert strict[r]["eval"] is None and default[r]["eval"] is None
    ev_out, ev_losses = reference_eval(schedule, n)
    for run in (want, strict, default):
        if run is want and run[h]["eval"] is None:
            continue  # (torch's multi-stage eval fails in 2.13)
        assert torch.equal(run[h]["eval"], ev_out)
        assert run[h]["eval_losses"] == ev_losses


def test_torchs_zbv_order_as_the_hint_on_three_ranks_gives_torchs_result() -> None:
    # On 3 ranks the middle rank's V-shape stages (1 and 4) are interleaved placement's too;
    # it read them as interleaved and refused torch's V-shape hint (PlanError "places stages
    # vshape, but this rank's stages are placed interleaved"): the hint decides now.
    world, n, name = 3, 4, "ScheduleZBVZeroBubble"
    want = pooled_spawn(worker, world, "torch", name, n, timeout=300)
    strict = pooled_spawn(worker, world, "strict", name, n, timeout=300)
    hinted = pooled_spawn(worker, world, "hinted", name, n, timeout=300)
    h = next(r for r in range(world) if want[r]["losses"])
    assert h == 0 and len(want[h]["losses"]) == 3 * n  # (V-shape: the loss on rank 0)
    assert strict[h]["losses"] == want[h]["losses"]
    torch.testing.assert_close(hinted[h]["losses"], want[h]["losses"], rtol=0, atol=1e-6)
    for r in range(world):
        for a, b in zip(strict[r]["params"], want[r]["params"], strict=True):
            assert torch.equal(a, b), (r, (a - b).abs().max())
        for a, b in zip(hinted[r]["params"], want[r]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def unhinted_vshape_worker(rank: int, world: int) -> dict[str, Any]:
    """V-shape stages on 3 ranks and no hint: the middle rank cannot tell its placement."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst

    torch.manual_seed(0)
    model = nn.ModuleList([Block() for _ in range(2 * world)])
    mine = [rank, 2 * world - 1 - rank]
    stages = [PipelineStage(model[i], i, 2 * world, torch.device("cpu")) for i in mine]
    sched = ScheduleInterleavedReadinessFirst(stages, 4, loss_fn=loss_fn, step_timeout=60)
    x, y, _ = batch(0)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", [])}
    finally:
        sched.close()
    return {"error": None}


def test_unhinted_vshape_on_three_ranks_fails_everywhere_naming_the_fix() -> None:
    got = pooled_spawn(unhinted_vshape_worker, 3, timeout=200)
    for r in range(3):
        assert got[r]["error"].startswith("PlanError: "), got[r]
        assert "the ranks disagree on the plan" in got[r]["error"]
        assert "rank 1 has placement='interleaved'" in got[r]["error"]
        (note,) = got[r]["notes"]
        assert "group rank(s) 1 [1, 4] fit both interleaved and V-shape placement" in note
        assert "hint=ScheduleZBVZeroBubble" in note


def test_the_classes_are_torchs_kinds() -> None:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

    assert issubclass(ScheduleReadinessFirst, PipelineScheduleSingle)
    assert not issubclass(ScheduleReadinessFirst, PipelineScheduleMulti)
    assert issubclass(ScheduleInterleavedReadinessFirst, PipelineScheduleMulti)
    assert not issubclass(ScheduleInterleavedReadinessFirst, PipelineScheduleSingle)


def misuse_worker(rank: int, world: int) -> dict[str, str]:
    """Inputs torch refuses are refused alike (same exception types, the same advice)."""
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

    torch.manual_seed(0)
    model = nn.ModuleList([Block() for _ in range(2 * world)])
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))
    sched = ScheduleReadinessFirst(stage, n_microbatches=2, loss_fn=loss_fn)
    x = torch.zeros(4, D)
    got: dict[str, str] = {}
    for name, call in {
        "mixed": lambda: sched.step(x, arg_mbs=[(x,), (x,)]),
        "mixed_kw": lambda: sched.step(kwarg_mbs=[{}, {}], scale=x),
        "mixed_target": lambda: sched.step(target=x, target_mbs=[x, x]),
        "count": lambda: sched.step(arg_mbs=[(x,)]),
        # Wrong types on purpose: the refusals under test.
        "not_list": lambda: sched.step(arg_mbs=((x,), (x,))),  # type: ignore[arg-type]
        "not_tuple": lambda: sched.step(arg_mbs=[x, x]),  # type: ignore[list-item]
        "small_batch": lambda: sched.step(torch.zeros(1, D)),
    }.items():
        try:
            call()
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
        else:
            got[name] = "no error"
    pair = [
        PipelineStage(model[i], i, 2 * world, torch.device("cpu")) for i in (rank, rank + world)
    ]
    try:
        ScheduleInterleavedReadinessFirst(
            pair, 2, loss_fn=loss_fn, backward_requires_autograd=False
        )
    except Exception as e:
        got["no_autograd"] = f"{type(e).__name__}: {e}"
    try:
        ScheduleReadinessFirst(pair[0], 2, loss_fn=loss_fn, hint="ZBVZeroBubble")
    except Exception as e:
        got["vshape_hint_on_one_stage"] = f"{type(e).__name__}: {e}"
    sched.close()
    return got


def test_inputs_torch_refuses_are_refused_alike() -> None:
    got = pooled_spawn(misuse_worker, 2, timeout=200)[0]
    assert got["mixed"].startswith("ValueError: When using pre-split inputs"), got["mixed"]
    assert got["mixed_kw"].startswith("ValueError: Unexpected keyword arguments"), got
    assert "scale" in got["mixed_kw"]
    assert got["mixed_target"].startswith("ValueError: When using pre-split inputs, pass pre"), got
    assert got["count"] == "ValueError: Expecting 2 arg_mbs but got 1", got["count"]
    assert got["not_list"].startswith("TypeError: arg_mbs must be a list"), got["not_list"]
    assert got["not_tuple"].startswith("TypeError: arg_mbs must be a list of tuples"), got
    # (issue 41: the step runs and fails on every rank, this one's the origin)
    assert got["small_batch"].startswith("PlanError: rank 0: step() got a batch of 1 row,")
    assert "n_microbatches=2" in got["small_batch"], got["small_batch"]
    assert got["no_autograd"].startswith("PlanError: backward_requires_autograd=False"), got
    assert got["vshape_hint_on_one_stage"].startswith("PlanError"), got
