"""The torch drop-in's misuse is named at its source, alike on every rank (issue 41, items 1
and 2).

* A batch of fewer rows than ``n_microbatches``: rank 0 refused it with a ``PlanError`` and
  the last rank raised torch's bare ``AssertionError: Tensor size 3 is smaller than
  num_chunks`` (its split of the target), while a middle rank, which holds no batch, waited
  in the step for the watchdog. Now the step fails at once on every rank with a
  ``PlanError`` naming the rows and ``n_microbatches`` (the others' ``PeerPlanError``
  carries the origin's message), and every rank runs the next step.
* ``step()`` from two threads at once at the first step: both threads built the stage and
  ended in the step's timeout, and the next step failed too. Now the second call is refused
  at once with a ``PlanError`` naming the fix; the first runs, and so does the next step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

N = 4  # n_microbatches
TIMEOUT = 60.0  # the step watchdog: a rank left waiting would wait this long


class _Slow(nn.Module):
    """A linear stage whose forward takes ``delay`` seconds (a step that lasts a while)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return self.lin(x)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _schedule(rank: int, world: int, delay: float = 0.0, timeout: float = TIMEOUT) -> Any:
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.pipelining import ScheduleReadinessFirst

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    stage = PipelineStage(_Slow(delay), rank, world, torch.device("cpu"))
    return ScheduleReadinessFirst(stage, N, loss_fn=_loss, step_timeout=timeout)


def _step(sched: Any, rank: int, world: int, rows: int) -> list[Any]:
    """One step as torch's users call it: the batch on rank 0, the targets on the last."""
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)
    losses: list[Any] = []
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return losses


def _error(e: BaseException) -> dict[str, Any]:
    from rrfp_async import PlanError

    return {"type": type(e).__name__, "plan": isinstance(e, PlanError), "text": str(e)}


# ------------------------------------------------ 1. a batch that does not split


def _small_batch_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with _schedule(rank, world) as sched:
        t0 = time.monotonic()
        try:
            _step(sched, rank, world, rows=3)
            out["first"] = None
        except Exception as e:
            out["first"] = _error(e)
        out["seconds"] = time.monotonic() - t0
        out["next"] = len(_step(sched, rank, world, rows=8))  # every rank runs the next step
    return out


def test_a_batch_smaller_than_n_microbatches_fails_alike_on_every_rank() -> None:
    res = pooled_spawn(_small_batch_worker, 3, timeout=150)
    for r, got in enumerate(res):
        first = got["first"]
        assert first is not None, f"rank {r}: the step did not fail"
        assert first["type"] in ("PlanError", "PeerPlanError") and first["plan"], (r, first)
        text = first["text"]
        assert "step() got a batch of 3 rows, which does not split into" in text, (r, text)
        assert f"n_microbatches={N} microbatches" in text, text
        assert f"a batch of at least {N} rows" in text, text  # the fix
        assert "n_microbatches <= 3" in text, text
        assert got["seconds"] < TIMEOUT / 3, (r, got)  # no rank waited for the watchdog
    assert res[0]["first"]["type"] == "PlanError", res[0]  # the origin: the rank that holds it
    assert res[1]["first"]["type"] == "PeerPlanError", res[1]  # a middle rank: told
    assert "failed on rank 0 (global 0)" in res[1]["first"]["text"], res[1]
    assert res[2]["next"] == N and res[0]["next"] == 0  # the next step ran, its N losses


# ------------------------------------------------ 2. step() from two threads at once


def _two_threads_worker(rank: int, world: int) -> dict[str, Any]:
    # A forward of 0.5 s: the step runs well past the moment the second thread calls.
    with _schedule(rank, world, delay=0.5, timeout=20.0) as sched:
        start = threading.Barrier(2)
        got: dict[str, Any] = {}

        def call(name: str) -> None:
            start.wait()
            try:
                got[name] = ("ran", len(_step(sched, rank, world, rows=8)))
            except Exception as e:
                got[name] = ("failed", _error(e))

        threads = [threading.Thread(target=call, args=(n,), name=n) for n in ("t1", "t2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        try:
            nxt: Any = len(_step(sched, rank, world, rows=8))
        except Exception as e:
            nxt = _error(e)
    return {"threads": got, "next": nxt}


def test_step_from_two_threads_at_once_refuses_the_second_and_stays_usable() -> None:
    res = pooled_spawn(_two_threads_worker, 2, timeout=150)
    for r, got in enumerate(res):
        outcomes = sorted(got["threads"].values(), key=lambda o: o[0])
        assert [o[0] for o in outcomes] == ["failed", "ran"], (r, got)
        refused = outcomes[0][1]
        assert refused["type"] == "PlanError", (r, refused)
        text = refused["text"]
        assert f"rank {r}: ScheduleReadinessFirst.step() on thread 't" in text, text
        assert "while step() on thread 't" in text and "runs a step of this schedule" in text
        assert "torch's schedules are not thread-safe" in text, text
        assert "Call step() from one thread" in text, text  # the fix
        assert "refused and changed nothing" in text, text
        assert got["next"] == (N if r == 1 else 0), (r, got)  # the next step runs everywhere
