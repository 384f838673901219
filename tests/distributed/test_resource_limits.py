"""A rank out of file descriptors or threads fails with ``ResourceError``, and so do its peers
(issue 41, deliverable 4).

Before: a rank at its descriptor limit died with SIGABRT inside ``build_groups``
(``new_group``: gloo's ``std::terminate``), or raised gloo's bare ``RuntimeError``, while its
peer waited inside ``new_group``; a thread that could not start was a bare ``RuntimeError``.
"""

from __future__ import annotations

import os
import resource
import threading
from typing import Any

import pytest
import torch

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

M = 2


def _stage(rank: int, world: int, groups: Any) -> Any:
    layout = rr.ProcessLayout.from_world(pp=world)
    ex = rr.TorchStageExecutor({rank: torch.nn.Linear(2, 2)}, lambda o, mb: o.sum(), rank=rank)
    plan = rr.StepPlan(topology=rr.Topology(stages=world), microbatches=M)
    return rr.DistributedStage(
        layout, rr.StepSchedule.build(plan), ex, groups=groups, step_timeout=20
    )


def _outcome(e: BaseException) -> dict[str, Any]:
    return {
        "type": type(e).__name__,
        "text": str(e),
        "resource": getattr(e, "resource", None),
        "rank": getattr(e, "rank", None),
        "limit": getattr(e, "limit", None),
    }


def _fd_worker(rank: int, world: int, headroom: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    if rank == 1:  # just above what it has open: the groups' sockets cannot all be had
        in_use = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + headroom, hard))
        out["limit_set"] = in_use + headroom
    try:
        stage = _stage(rank, world, None)  # groups=None: the stage builds them
        with stage:
            stage.run_step_sync([torch.randn(3, 2) for _ in range(M)])
        out["type"] = None
    except Exception as e:
        out.update(_outcome(e))
    return out


@pytest.mark.parametrize("headroom", [2, 4])
def test_a_rank_at_its_fd_limit_raises_a_resource_error_and_its_peer_names_it(
    headroom: int,
) -> None:
    # Red before: headroom 4 killed rank 1 with SIGABRT (exit -6, "terminate called after
    # throwing an instance of 'gloo::EnforceNotMet'"), 2 raised gloo's RuntimeError
    # ("socket: Too many open files"); rank 0 waited inside new_group.
    r0, r1 = pooled_spawn(_fd_worker, 2, headroom, timeout=200)
    assert r1["type"] == "ResourceError", r1
    assert r1["resource"] == "file descriptors" and r1["rank"] == 1, r1
    assert r1["limit"] == r1["limit_set"], r1
    assert f"limit of {r1['limit_set']} (soft RLIMIT_NOFILE)" in r1["text"], r1
    assert "global rank 1 (this rank)" in r1["text"], r1
    assert "ulimit -n" in r1["text"] and "fewer stages" in r1["text"], r1
    assert r0["type"] == "ResourceError", r0
    assert r0["rank"] == 1 and "global rank 1 is short of file descriptors" in r0["text"], r0
    assert "RLIMIT_NOFILE" in r0["text"] and "ulimit -n" in r0["text"], r0


def _thread_worker(rank: int, world: int, prefix: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    layout = rr.ProcessLayout.from_world(pp=world)
    stage = _stage(rank, world, rr.build_groups(layout))
    out: dict[str, Any] = {}
    if rank == 1:
        start = threading.Thread.start

        def refuse(self: threading.Thread) -> None:
            if self.name.startswith(prefix):
                raise RuntimeError("can't start new thread")
            start(self)

        threading.Thread.start = refuse  # type: ignore[method-assign]
    try:
        with stage:
            stage.run_step_sync([torch.randn(3, 2) for _ in range(M)])
        out["type"] = None
    except Exception as e:
        out.update(_outcome(e))
        out["cause"] = repr(e.__cause__)
    return out


@pytest.mark.parametrize("prefix", ["rrfp-recv", "rrfp-send"])
def test_a_stage_thread_that_cannot_start_is_a_resource_error_and_the_peer_names_the_rank(
    prefix: str,
) -> None:
    # Red before: rank 1 raised the bare RuntimeError("can't start new thread").
    r0, r1 = pooled_spawn(_thread_worker, 2, prefix, timeout=200)
    assert r1["type"] == "ResourceError", r1
    assert r1["resource"] == "threads", r1
    assert "can't start new thread" in r1["text"] and "Python threads" in r1["text"], r1
    assert "rank 1 (global 1)" in r1["text"], r1
    assert "RuntimeError" in r1["cause"], r1
    assert r0["type"] is not None, r0  # the peer fails, naming rank 1
    assert "rank 1" in r0["text"], r0
