"""Non-finite values are reported (issue 30 item 2): a NaN or an infinity in a loss (checked
by default), an activation or a gradient (``check_tensors=True``) is named with its rank,
step, task and microbatch; ``nonfinite="raise"`` fails the step on every rank.

One process, a 2-stage ``LocalPipeline`` (one executor, one compute thread per stage);
``tests/distributed/test_error_hints.py`` covers how a failed step travels between
processes, which a ``NonFiniteError`` does like any task error.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr

pytestmark = pytest.mark.timeout(60)

M, BAD = 4, 2  # microbatches; the one whose input holds an infinity


class _Stage(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, generator=g) for _ in range(M)]
    xs[BAD][0, 1] = float("inf")  # a corrupt sample: inf * weight - inf ... -> NaN, inf
    return xs


def _step(**kw: Any) -> tuple[list[rr.TorchStageExecutor], BaseException | None]:
    mods = [_Stage(0), _Stage(1)]
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, lambda out, mb: out.pow(2).mean(), rank=v, **kw)
        for v in range(2)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=M)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "gpipe"), execs, policy="strict")
    err: BaseException | None = None
    try:
        rr.run(pipe.run_step(_batches()))
    except rr.RRFPError as e:
        err = e
    for ex in execs:
        ex.close()
    return execs, err


def test_a_non_finite_loss_is_named_by_default(caplog: pytest.LogCaptureFixture) -> None:
    # Fails on the old code: the NaN loss went by without a word (no record, no warning).
    with caplog.at_level(logging.WARNING, logger="rrfp_async"):
        execs, err = _step()
    assert err is None  # warned, not raised: the step ran
    (event,) = execs[1].nonfinite_events
    assert (event.rank, event.step, event.task, event.microbatch, event.what) == (
        1,
        0,
        "1F2",
        BAD,
        "loss",
    )
    assert event.detail in ("nan", "inf")
    want = f"rank 1 step 0 1F2: non-finite loss in microbatch {BAD} ({event.detail})"
    assert [r.getMessage() for r in caplog.records] == [want]
    assert execs[0].nonfinite_events == []  # the first stage has no loss; tensors unchecked


def test_check_tensors_names_the_first_non_finite_activation() -> None:
    execs, err = _step(check_tensors=True)
    assert err is None
    (first,) = execs[0].nonfinite_events
    assert (first.task, first.what) == ("0F2", "activation")
    assert first.detail.startswith("leaf 0 of shape (2, 3): ") and first.detail.endswith(" values")
    # The last stage: its input gradient of microbatch 2 (B) and the loss.
    found = [(e.task, e.what) for e in execs[1].nonfinite_events]
    assert ("1F2", "loss") in found and ("1B2", "input gradient") in found, found
    assert all(e.microbatch == BAD for e in execs[1].nonfinite_events)


def test_raise_fails_the_step_naming_the_task() -> None:
    _, err = _step(nonfinite="raise")
    assert isinstance(err, rr.errors.NonFiniteError), err
    assert "rank 1 step 0 1F2: non-finite loss in microbatch 2" in str(err)
    assert "nonfinite='raise'" in str(err)


def test_off_checks_nothing_and_bad_modes_are_refused() -> None:
    execs, err = _step(nonfinite="off", check_tensors=True)
    assert err is None and all(e.nonfinite_events == [] for e in execs)
    with pytest.raises(rr.PlanError, match="nonfinite must be 'off', 'warn' or 'raise'"):
        rr.TorchStageExecutor({0: nn.Linear(1, 1)}, nonfinite="loud")  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="check_tensors must be a bool"):
        rr.TorchStageExecutor({0: nn.Linear(1, 1)}, check_tensors=1)  # type: ignore[arg-type]


def test_a_loss_read_after_its_step_is_warned_even_under_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # CUDA losses are read once per step, after it: too late to fail the step, never silent.
    from rrfp_async.distributed._nonfinite import FiniteCheck

    check = FiniteCheck("raise", False, 3)
    with caplog.at_level(logging.WARNING, logger="rrfp_async"):
        check.loss(7, rr.Task(1, "F", 2), float("nan"), late=True)
    assert [str(e) for e in check.events] == [
        "rank 3 step 7 1F2: non-finite loss in microbatch 2 (nan)"
    ]
    assert [r.getMessage() for r in caplog.records] == [str(check.events[0])]
    with pytest.raises(rr.errors.NonFiniteError):  # read during its step: the step fails
        check.loss(7, rr.Task(1, "F", 3), float("inf"))
