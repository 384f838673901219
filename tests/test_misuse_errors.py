"""Misuse of the runtime is named at its source (issue 41, items 4 and 5): a typed error of
the library's tree (or, for an error the user's own module raised, a note on it) that names
the object and the fix, where a bare torch or Python error came before.

One process: ``LocalPipeline``s of ``TorchStageExecutor``s or ``CostModelExecutor``s. How a
failed step travels between processes is ``tests/distributed/test_error_hints.py``'s; the
drop-ins' cases are ``tests/integrations/test_dropin_misuse.py`` and
``tests/integrations/test_megatron_errors.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import rrfp_async as rr
from rrfp_async import ReadyView, Task
from rrfp_async.errors import ClosedError, PolicyError
from rrfp_async.loop._pipeline import unwrap_group
from rrfp_async.sim import CostModelExecutor
from tests._virtual import run_virtual

pytestmark = pytest.mark.timeout(60)

M = 2


class _Stage(nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            x.mul_(2.0)  # the slip: the received input changed in place
        return self.lin(x)


def _pipe(mods: list[nn.Module]) -> tuple[rr.LocalPipeline, list[rr.TorchStageExecutor]]:
    execs = [
        rr.TorchStageExecutor({v: m}, lambda out, mb: out.pow(2).mean(), rank=v)
        for v, m in enumerate(mods)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=len(mods)), microbatches=M)
    return rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs, policy="strict"), execs


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, generator=g) for _ in range(M)]


def _fails(pipe: rr.LocalPipeline) -> BaseException:
    try:
        rr.run(pipe.run_step(_batches()))
    except BaseException as e:
        return unwrap_group(e) if isinstance(e, BaseExceptionGroup) else e
    raise AssertionError("the step did not fail")


# ------------------------------------------------ 4. a stage changes its received input in place


def test_a_stage_that_changes_its_received_input_in_place_is_named_with_the_fix() -> None:
    # Fails without the note: torch's bare "a leaf Variable that requires grad is being
    # used in an in-place operation." named neither the stage boundary nor the fix.
    torch.manual_seed(0)
    pipe, execs = _pipe([_Stage(), _Stage(in_place=True)])
    try:
        err = _fails(pipe)
    finally:
        for ex in execs:
            ex.close()
    assert isinstance(err, RuntimeError), repr(err)  # torch's own error, type and text kept
    assert "leaf Variable that requires grad is being used in an in-place operation" in str(err)
    assert err.__traceback__ is not None
    (note,) = [str(n) for n in getattr(err, "__notes__", []) if "in place" in str(n)]
    assert "rank 1 step 0 1F0: the module of virtual stage 1 changed its input in place" in note
    assert "microbatch 0, received from virtual stage 0: a tensor of shape (2, 3)" in note
    assert "x = x.clone()" in note and "out-of-place" in note, note  # the fix


def test_an_in_place_change_of_a_parameter_is_named_as_one() -> None:
    class _Bumps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.w.add_(1.0)
            return x * self.w

    pipe, execs = _pipe([_Bumps(), _Stage()])
    try:
        err = _fails(pipe)
    finally:
        for ex in execs:
            ex.close()
    (note,) = [str(n) for n in getattr(err, "__notes__", []) if "in place" in str(n)]
    assert "rank 0 step 0 0F0" in note and "one of its parameters" in note, note
    assert "torch.no_grad()" in note, note


# ------------------------------------------------ 5. misuse of the runtime's objects


def _unit(step: int, mbs: Any) -> rr.Durations:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=len(mbs))
    return rr.Durations.from_arrays(plan, [[1.0] * len(mbs)] * 2)


def test_a_ready_view_read_after_its_step_is_a_policy_error_naming_the_fix() -> None:
    # Fails without the fix: a bare RuntimeError("the ready view is only valid during a
    # step"), naming neither the policy nor what to keep instead.
    kept: list[ReadyView] = []

    async def keeps_the_view(view: ReadyView) -> Task:
        kept.append(view)
        return view.ready[0]

    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=M)
    pipe = rr.LocalPipeline(
        rr.StepSchedule.build(plan, "1f1b"), CostModelExecutor(_unit), policy=keeps_the_view
    )
    run_virtual(pipe.run_step(list(range(M))))
    assert kept
    with pytest.raises(PolicyError) as info:
        kept[0].ready  # noqa: B018 (after the step)
    text = str(info.value)
    assert "keeps_the_view' on rank 0: its ReadyView was read" in text, text
    assert "read while no step runs" in text and "list(view.ready)" in text, text
    assert info.value.policy.endswith("keeps_the_view") and info.value.rank == 0


def test_a_step_on_closed_executors_is_a_closed_error_naming_the_executor() -> None:
    # Fails without the fix: "RuntimeError: ComputeWorker is closed" from the first task.
    pipe, execs = _pipe([_Stage(), _Stage()])
    rr.run(pipe.run_step(_batches()))  # one good step
    for ex in execs:
        ex.close()
    err = _fails(pipe)
    assert isinstance(err, ClosedError), repr(err)
    text = str(err)
    assert "rank 0 step 1 0F0: this TorchStageExecutor is closed" in text, text
    assert "build a new TorchStageExecutor" in text and "after the last step" in text, text


def test_a_durations_function_that_returns_a_dict_is_a_plan_error_naming_it() -> None:
    # Fails without the check: "AttributeError: 'dict' object has no attribute 'of'".
    def per_task(step: int, mbs: Any) -> Any:
        return {"F": [[1.0] * len(mbs)] * 2, "B": [[2.0] * len(mbs)] * 2}

    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=M)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), CostModelExecutor(per_task))
    with pytest.raises(rr.PlanError) as info:
        run_virtual(pipe.run_step(list(range(M))))
    text = str(info.value)
    assert "step 0: CostModelExecutor's durations function" in text, text
    assert "per_task" in text and "(dict)" in text, text  # the callable, and what it returned
    assert "rr.Durations.from_arrays(plan" in text, text  # the fix
    # A Durations of another shape is refused the same way, naming both shapes.
    short = CostModelExecutor(lambda step, mbs: _unit(step, mbs[:1]))
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), short)
    with pytest.raises(rr.PlanError, match="returned Durations of 2 x 1; it must return"):
        run_virtual(pipe.run_step(list(range(M))))
