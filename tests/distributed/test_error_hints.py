"""Errors show where they happen, and every peer learns what and how to fix it (issue 29).

A stage's module that raises keeps its exception on its own rank (type, message, the
user's frame in the traceback) with a note (``add_note``) naming the task and, for the
common misuses, the fix; every other rank's ``PeerStepError`` carries the type, the
message and that note. The misuses a newcomer makes: a ``(inputs, target)`` tuple
microbatch without ``input_fn`` (the first stage is called as ``module(inputs, target)``),
a split whose stage outputs do not fit the next stage's input, and, through the torch
drop-in, a training step without the targets on the last stage. (Ranks given different
numbers of microbatches: ``test_plan_digest.py``.)
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

M = 2


class _Net(nn.Module):
    """A linear stage from ``n_in`` to ``n_out`` features."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # the user's frame


def _loss(out: torch.Tensor, mb: Any) -> torch.Tensor:
    data = mb.data if isinstance(mb, rr.Microbatch) else mb
    target = data[1] if isinstance(data, tuple) else torch.zeros_like(out)
    return ((out - target) ** 2).mean()


def _worker(rank: int, world: int, case: str) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    torch.manual_seed(rank)  # stages of their own (no look-alike tie warning)
    if case == "tuple":
        mod = _Net(4, 4)
        mbs: list[Any] = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(M)]
    else:  # "shape": stage 0 returns 6 features, stage 1 takes 4
        mod = _Net(4, 6) if rank == 0 else _Net(4, 4)
        mbs = [torch.randn(3, 4) for _ in range(M)]
    ex = rr.TorchStageExecutor({rank: mod}, _loss, rank=rank)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
    stage = rr.DistributedStage(layout, rr.StepSchedule.build(plan), ex, groups=groups)
    out: dict[str, Any] = {}

    async def go() -> None:
        async with stage:
            await stage.run_step(mbs)

    try:
        rr.run(go())
        out["error"] = None
    except Exception as e:
        out["type"] = type(e).__name__
        out["text"] = str(e)
        out["notes"] = list(getattr(e, "__notes__", []))
        out["trace"] = "".join(traceback.format_exception(e))
    finally:
        ex.close()
    return out


def _hints(r: dict[str, Any]) -> list[str]:
    """The executor's notes (not the stage's "state of rank ..." dump, also a note)."""
    return [n for n in r["notes"] if not n.startswith("state of rank ")]


def test_a_tuple_microbatch_without_input_fn_names_input_fn_on_every_rank() -> None:
    # Fails without the note: rank 0 raised a bare TypeError, and rank 1's PeerStepError
    # said only "TypeError: ... takes 2 positional arguments but 3 were given".
    r0, r1 = pooled_spawn(_worker, 2, "tuple", timeout=200)
    assert r0["type"] == "TypeError", r0
    assert "positional argument" in r0["text"], r0
    (note,) = _hints(r0)
    assert "rank 0 step 0 0F0: the module of virtual stage 0" in note, note
    assert "called as module(*microbatch) with microbatch 0, a tuple of 2 values" in note
    assert "TorchStageExecutor(input_fn=lambda mb: mb[0])" in note, note
    assert r1["type"] == "PeerStepError", r1
    assert "TypeError:" in r1["text"] and "positional argument" in r1["text"], r1
    assert "input_fn=lambda mb: mb[0]" in r1["text"], r1
    assert "state of rank" not in r1["text"], r1  # the origin's state dump stays there


def test_a_stage_input_that_does_not_fit_names_both_stages_on_every_rank() -> None:
    # Fails without the note: neither rank said that stage 0's output feeds stage 1.
    r0, r1 = pooled_spawn(_worker, 2, "shape", timeout=200)
    assert r1["type"] == "RuntimeError", r1
    assert "mat1 and mat2 shapes cannot be multiplied" in r1["text"], r1
    assert "in forward\n    return self.lin(x)  # the user's frame" in r1["trace"], r1["trace"]
    (note,) = _hints(r1)
    assert "rank 1 step 0 1F0: the module of virtual stage 1 failed on its input" in note, note
    assert "from virtual stage 0, a tensor of shape (3, 6)" in note, note
    assert "the output of stage 0 must fit this stage's forward" in note, note
    assert r0["type"] == "PeerStepError", r0
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in r0["text"], r0
    assert "a tensor of shape (3, 6)" in r0["text"], r0


def _dropin_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.manual_seed(rank)
    mod = _Net(4, 4)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)

    out: dict[str, Any] = {}
    with ScheduleReadinessFirst(stage, 2, loss_fn=loss_fn) as schedule:
        try:
            schedule.step(torch.randn(4, 4)) if rank == 0 else schedule.step()  # no target
            out["error"] = None
        except Exception as e:
            out["type"] = type(e).__name__
            out["text"] = str(e)
            out["notes"] = list(getattr(e, "__notes__", []))
    return out


def test_a_training_step_without_targets_says_where_they_go() -> None:
    # Fails without the note: rank 1 raised mse_loss's bare "'NoneType' object has no
    # attribute 'size'" (torch's schedules fail the same way, with no word of step(target=)).
    r0, r1 = pooled_spawn(_dropin_worker, 2, timeout=200)
    assert r1["type"] != "PeerStepError", r1  # the last stage's own error, whole
    (note,) = _hints(r1)
    assert "loss_fn(output, target) got target=None" in note, note
    assert "step(target=y) or target_mbs=[...]" in note, note
    assert r0["type"] == "PeerStepError", r0
    assert "step(target=y)" in r0["text"], r0
