"""Every message of a common mistake names the mistake and the fix (issue 38, item 4), and a
command never says it wrote a file it did not write.

One test per mistake; each asserts both halves of its message: what was wrong (the argument,
the type that came) and what to do instead (the call or install that works). The Megatron
path's end to end (a real ``data_iterator`` that runs dry under the drop-in) is
``tests/integrations/test_megatron_errors.py``.
"""

# mypy: disable-error-code="dict-item"
# (the checker would refuse what this file tests: bad inputs, of the wrong type on purpose.)

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn

import rrfp_async as rr
from rrfp_async.integrations._megatron_data import InOrder, Microbatch
from rrfp_async.policies import get_policy

# --- a) `rrfp-async trace FILE --png OUT` without matplotlib --------------------------------


def _trace(tmp_path: Path) -> Path:
    from rrfp_async.cli._main import main

    trace = tmp_path / "t.json"
    args = ["simulate", "-p", "2", "-m", "4", "--policy", "strict", "--trace", str(trace)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return trace


def test_trace_png_without_matplotlib_fails_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rrfp_async.cli._main import main

    trace = _trace(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # a plain install
    png, out = tmp_path / "x.png", tmp_path / "merged.json"
    res = CliRunner().invoke(main, ["trace", str(trace), "--png", str(png), "-o", str(out)])
    assert res.exit_code != 0, res.output
    assert "--png needs matplotlib" in res.output  # the mistake
    assert "pip install 'rrfp-async[plot]'" in res.output  # the fix (pyproject's extra)
    assert "leave out --png" in res.output  # or the other fix
    assert "wrote" not in res.output  # a file not written is never said to be written
    assert not png.exists() and not out.exists()  # refused before anything was written
    assert "Traceback" not in res.output


def test_trace_png_without_matplotlib_json_is_one_error_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from rrfp_async.cli._main import main

    trace = _trace(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = CliRunner().invoke(
        main, ["trace", str(trace), "--png", str(tmp_path / "x.png"), "--json"]
    )
    assert res.exit_code == 1, res.output
    err = json.loads(res.stdout)["error"]
    assert err["type"] == "ExtraMissingError"
    assert "pip install 'rrfp-async[plot]'" in err["message"]


def test_trace_says_wrote_only_for_files_it_wrote(tmp_path: Path) -> None:
    """With matplotlib (the dev environment), both files exist and are named once each."""
    pytest.importorskip("matplotlib")
    from rrfp_async.cli._main import main

    trace = _trace(tmp_path)
    png, out = tmp_path / "x.png", tmp_path / "merged.json"
    res = CliRunner().invoke(main, ["trace", str(trace), "--png", str(png), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert png.stat().st_size > 0 and out.stat().st_size > 0
    assert res.output.count("wrote ") == 2
    assert f"wrote {png}" in res.output and f"wrote {out}" in res.output


# --- b) TorchStageExecutor(module) instead of {stage: module} -------------------------------


@pytest.mark.parametrize(
    "modules",
    [nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)), [nn.Linear(2, 2)]],
    ids=["module", "sequential", "list"],
)
def test_torch_executor_wants_a_dict_of_stages(modules: Any) -> None:
    with pytest.raises(rr.PlanError) as e:
        rr.TorchStageExecutor(modules)
    msg = str(e.value)
    assert "TorchStageExecutor takes a dict {stage_index: module}" in msg  # the mistake
    assert f"got a {type(modules).__name__}" in msg
    assert "pass {0: module}" in msg  # the fix


def test_torch_executor_names_a_key_that_is_no_stage_index() -> None:
    with pytest.raises(rr.PlanError) as e:
        rr.TorchStageExecutor({"0": nn.Linear(2, 2)})
    assert "'0' (str)" in str(e.value) and "an int >= 0" in str(e.value)


# --- c) DistributedStage(layout, plan, ...) with a StepPlan ---------------------------------


class _Tiny:
    async def execute(self, task: rr.Task, data: Any, ctx: Any) -> Any:
        return None


def _plan() -> rr.StepPlan:
    return rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)


def test_dist_stage_refuses_a_step_plan_for_the_schedule() -> None:
    layout = rr.ProcessLayout(pp=1, rank=0)
    with pytest.raises(rr.PlanError) as e:
        rr.DistributedStage(layout, _plan(), _Tiny())  # type: ignore[arg-type]
    msg = str(e.value)
    assert "rank 0" in msg
    assert "schedule" in msg and "StepPlan" in msg  # the argument and what came
    assert "StepSchedule.build(plan, hint)" in msg  # the fix


def test_dist_stage_refuses_what_is_no_layout() -> None:
    sched = rr.StepSchedule.build(_plan(), "1f1b")
    with pytest.raises(rr.PlanError) as e:
        rr.DistributedStage(1, sched, _Tiny())  # type: ignore[arg-type]
    msg = str(e.value)
    assert "layout must be a ProcessLayout" in msg and "got 1 (int)" in msg
    assert "ProcessLayout.from_world(pp=...)" in msg


@pytest.mark.parametrize(
    "executor", [{0: nn.Linear(2, 2)}, nn.Linear(2, 2)], ids=["modules_dict", "module"]
)
def test_dist_stage_refuses_modules_for_the_executor(executor: Any) -> None:
    layout = rr.ProcessLayout(pp=1, rank=0)
    sched = rr.StepSchedule.build(_plan(), "1f1b")
    with pytest.raises(rr.PlanError) as e:
        rr.DistributedStage(layout, sched, executor)
    msg = str(e.value)
    assert "rank 0" in msg and "executor" in msg
    assert "rr.TorchStageExecutor({stage_index: module}, loss_fn)" in msg


# --- d) ProcessLayout.from_world() without a process group ----------------------------------


def test_layout_from_world_without_a_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a default process group")
    with pytest.raises(rr.PlanError) as e:
        rr.ProcessLayout.from_world(pp=2)
    msg = str(e.value)
    assert "torch.distributed is not initialized" in msg  # the mistake
    assert "dist.init_process_group" in msg and "torchrun" in msg and "rr.spawn" in msg


# --- e) memory_factor="2" -------------------------------------------------------------------


def test_memory_factor_of_the_wrong_type_says_what_is_valid() -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    with pytest.raises(rr.errors.HintError) as e:
        rr.StepSchedule.build(plan, "1f1b", memory_factor="2")  # type: ignore[arg-type]
    msg = str(e.value)
    assert "memory_factor must be a number" in msg and "got '2' (str)" in msg
    assert "memory_factor=2.0" in msg  # the fix, for a number written as text
    assert "> 0" in msg and "1.0 keeps" in msg  # what is valid


# --- f) a policy registered in the parent, asked for in an rr.spawn child -------------------


def test_unknown_policy_names_the_known_ones_and_the_process_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(rr.errors.PolicyError) as e:
        get_policy("my_policy")
    msg = str(e.value)
    assert "unknown policy 'my_policy'" in msg and "'readiness_first'" in msg
    assert "processes started by rr.spawn or torchrun" in msg
    assert "register it at import time of the module that defines the worker" in msg
    assert "pass the policy object itself" in msg


def test_unknown_policy_in_a_spawned_rank_says_it_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")  # what rr.spawn and torchrun set in each rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(rr.errors.PolicyError) as e:
        get_policy("my_policy")
    msg = str(e.value)
    assert "rank 1 of 2" in msg and "does not see the parent's registry" in msg


# --- g) a Megatron data_iterator that runs dry -----------------------------------------------


def test_megatron_data_iterator_that_runs_dry() -> None:
    src = InOrder(iter(["a", "b"]))
    mbs = [Microbatch([src], m) for m in range(4)]  # num_microbatches=4, 2 items
    it = mbs[1].iterators[0]
    assert it is not None and next(it) == "b"
    it = mbs[3].iterators[0]
    assert it is not None
    with pytest.raises(rr.PlanError) as e:
        next(it)
    msg = str(e.value)
    assert "data_iterator ran out after 2 of num_microbatches=4 microbatches" in msg
    assert "microbatch 2" in msg  # the first one it could not read
    assert "give it at least num_microbatches" in msg


async def test_megatron_dry_iterator_is_no_stop_iteration_in_a_coroutine() -> None:
    """PEP 479: a StopIteration that leaves a coroutine is a bare RuntimeError; the data
    layer must raise its own error before one can."""
    src = InOrder(iter([]))
    it = Microbatch([src], 0).iterators[0]
    assert it is not None

    async def forward() -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, next, it)

    with pytest.raises(rr.PlanError, match="ran out after 0 of num_microbatches=1"):
        await asyncio.wait_for(forward(), 10)  # (before the fix: a hung future)
