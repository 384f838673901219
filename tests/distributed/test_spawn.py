"""The local spawn helper: results, failures, timeouts (gloo on 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import rrfp_async as rr

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _allreduce(rank: int, world: int, base: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    time.sleep(30)


def _hang(rank: int, world: int) -> None:
    time.sleep(60)


def test_spawn_returns_results_in_rank_order() -> None:
    assert rr.spawn(_allreduce, 2, 10) == [21, 21]


def test_spawn_reports_the_failing_rank_fast() -> None:
    t = time.monotonic()
    with pytest.raises(rr.errors.SpawnError, match=r"rank 1: ValueError: boom on purpose") as ei:
        rr.spawn(_fail_on_1, 2, timeout=60)
    assert 1 in ei.value.failures
    assert time.monotonic() - t < 30


def test_spawn_times_out_and_kills() -> None:
    t = time.monotonic()
    with pytest.raises(rr.errors.SpawnError, match="did not finish within 4"):
        rr.spawn(_hang, 2, timeout=4)
    assert time.monotonic() - t < 20


def _die_on_1(rank: int, world: int) -> None:
    import os

    if rank == 1:
        os._exit(3)  # no report, no traceback: the parent must notice the dead process
    time.sleep(30)


def test_spawn_reports_a_dead_process() -> None:
    t = time.monotonic()
    with pytest.raises(rr.errors.SpawnError, match="process died with exit code 3") as ei:
        rr.spawn(_die_on_1, 2, timeout=60)
    assert ei.value.failures[0] == "stopped after another rank failed"
    assert time.monotonic() - t < 30


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object refuses to be pickled")


def _unpicklable_result(rank: int, world: int) -> Any:
    return _Unpicklable()


def test_spawn_names_an_unpicklable_result() -> None:
    with pytest.raises(rr.errors.SpawnError) as ei:
        rr.spawn(_unpicklable_result, 2, timeout=60)
    msg = str(ei.value)
    assert "the result of tests.distributed.test_spawn._unpicklable_result (a _Unpicklable)" in msg
    assert "cannot be sent back to the parent: pickling it failed: TypeError: this object" in msg
    assert "exit code" not in msg and "__main__" not in msg


def test_spawn_refuses_what_cannot_reach_the_processes() -> None:
    t = time.monotonic()
    with pytest.raises(
        rr.errors.SpawnError, match=r"needs a picklable, module-level function; .*<lambda>"
    ):
        rr.spawn(lambda rank, world: rank, 2)
    with pytest.raises(
        rr.errors.SpawnError, match=r"argument 0 of .*_allreduce \(a _Unpicklable\)"
    ):
        rr.spawn(_allreduce, 2, _Unpicklable())
    for n in (0, -1):
        with pytest.raises(rr.PlanError, match=r"world_size \(the number of processes\) must be"):
            rr.spawn(_allreduce, n, 1)
    with pytest.raises(rr.PlanError, match=r"must be an integer, got 2\.0"):
        rr.spawn(_allreduce, 2.0, 1)  # type: ignore[arg-type]
    assert time.monotonic() - t < 5  # refused in the parent: nothing was started


def test_spawn_from_an_interactive_main_says_so() -> None:
    code = (
        "import rrfp_async as rr\n"
        "def f(rank, world):\n"
        "    return rank\n"
        "try:\n"
        "    rr.spawn(f, 2, timeout=30)\n"
        "except rr.errors.SpawnError as e:\n"
        "    print(e)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert "defined in an interactive __main__" in out.stdout, out.stdout + out.stderr
    assert "exit code" not in out.stdout


def _claim_rank_0(rank: int, world: int) -> None:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=2)
    layout = rr.ProcessLayout(pp=2, rank=0)  # every process claims rank 0
    rr.DistributedStage(layout, rr.StepSchedule.build(plan, "1f1b"), _Noop(), step_timeout=5)
    time.sleep(30)  # rank 0 passes the check; the parent stops it after rank 1's error


class _Noop:
    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        return None


def test_every_process_claiming_rank_0_is_a_layout_error() -> None:
    with pytest.raises(rr.errors.SpawnError) as ei:
        rr.spawn(_claim_rank_0, 2, timeout=60, grace=1.0)
    msg = ei.value.failures[1]
    assert msg.startswith("PlanError: the layout places this process at global rank 0, but"), msg
    assert "torch.distributed says it is global rank 1 (of 2)" in msg
    assert "lost rank" not in str(ei.value)


def _report_then_return(rank: int, world: int, n: int) -> int:
    from rrfp_async.distributed import report_progress

    for i in range(n):
        report_progress((rank, i))
    return rank


def test_every_progress_message_reaches_on_progress_even_just_before_the_result() -> None:
    seen: list[Any] = []
    assert rr.spawn(_report_then_return, 2, 200, timeout=60, on_progress=seen.append) == [0, 1]
    assert sorted(seen) == [(r, i) for r in range(2) for i in range(200)]
