"""The local spawn helper: results, failures, timeouts (gloo on 127.0.0.1)."""

from __future__ import annotations

import time

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
    with pytest.raises(rr.SpawnError, match=r"rank 1: ValueError: boom on purpose") as ei:
        rr.spawn(_fail_on_1, 2, timeout=60)
    assert 1 in ei.value.failures
    assert time.monotonic() - t < 30


def test_spawn_times_out_and_kills() -> None:
    t = time.monotonic()
    with pytest.raises(rr.SpawnError, match="did not finish within 4"):
        rr.spawn(_hang, 2, timeout=4)
    assert time.monotonic() - t < 20


def _die_on_1(rank: int, world: int) -> None:
    import os

    if rank == 1:
        os._exit(3)  # no report, no traceback: the parent must notice the dead process
    time.sleep(30)


def test_spawn_reports_a_dead_process() -> None:
    t = time.monotonic()
    with pytest.raises(rr.SpawnError, match="process died with exit code 3") as ei:
        rr.spawn(_die_on_1, 2, timeout=60)
    assert ei.value.failures[0] == "stopped after another rank failed"
    assert time.monotonic() - t < 30
