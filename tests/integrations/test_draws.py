"""The watch of a drop-in's training forwards' random draws (``_draws``), and learning's stop
on every rank alike when one drew (``StepLearning(draws=)``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rrfp_async import StepPlan, Topology
from rrfp_async.distributed import TorchStageExecutor
from rrfp_async.errors import PlanError
from rrfp_async.integrations import _draws
from rrfp_async.integrations._draws import DrawWatch
from rrfp_async.integrations._torch_learning import StepLearning, item_sizes
from tests._pool import pooled_spawn


def test_a_forward_that_draws_is_seen_and_one_that_does_not_is_not() -> None:
    w = DrawWatch()
    with w.forward():
        torch.ones(3) * 2
    assert not w.drew
    with w.forward():
        torch.rand(1)
    assert w.drew
    with w.forward():  # (seen once: nothing more is copied)
        pass
    assert w.drew


def test_the_peers_own_states_are_watched_tensors_and_generators() -> None:
    gen = torch.Generator().manual_seed(3)
    state = [torch.zeros(4, dtype=torch.uint8)]
    w = DrawWatch(lambda: [state[0], gen])
    with w.forward():
        state[0] = torch.zeros(4, dtype=torch.uint8)  # (a new object, the same state)
    assert not w.drew
    with w.forward():
        torch.rand(1, generator=gen)  # (a tracker's fork: the default generator untouched)
    assert w.drew
    w2 = DrawWatch(lambda: [state[0]])
    with w2.forward():
        state[0] = torch.ones(4, dtype=torch.uint8)
    assert w2.drew


def test_a_watch_that_is_off_sees_nothing() -> None:
    w = DrawWatch()
    w.on = False
    with w.forward():
        torch.rand(1)
    assert not w.drew


def test_megatrons_tracker_is_read_only_where_megatron_built_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import types

    fake = types.ModuleType("megatron.core.tensor_parallel.random")
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.random", fake)
    assert _draws.megatron_tracker_states() == []  # (not built: not built by us either)

    class Tracker:
        def get_states(self) -> dict[str, Any]:
            return {"model-parallel-rng": torch.ones(2)}

    fake._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # type: ignore[attr-defined]
    fake._CUDA_RNG_STATE_TRACKER = Tracker()  # type: ignore[attr-defined]
    got = _draws.megatron_tracker_states()
    assert len(got) == 1 and torch.equal(got[0], torch.ones(2))  # type: ignore[arg-type]


def test_draws_need_auto_learning() -> None:
    ex = TorchStageExecutor({0: torch.nn.Linear(2, 2)}, None, task_rng=False)
    try:
        plan = StepPlan(topology=Topology(stages=2), microbatches=4)
        with pytest.raises(PlanError, match="auto learning"):
            StepLearning(
                lambda p, c: [{"tokens": 1.0}] * len(c),
                ex,
                plan=plan,
                hint="1f1b",
                memory_budget=None,
                learn_costs=False,
                source=0,
                draws=DrawWatch(),
            )
    finally:
        ex.close()


def _learning(
    rank: int, world: int, m: int, watch: DrawWatch
) -> tuple[TorchStageExecutor, StepLearning]:
    """This rank's executor and auto learning of ``m``-microbatch steps (stage 0 reads the
    sizes), its forwards watched by ``watch``."""
    plan = StepPlan(topology=Topology(stages=world), microbatches=m)
    ex = TorchStageExecutor({rank: torch.nn.Linear(2, 2)}, None, task_rng=False)
    learning = StepLearning(
        None,
        ex,
        plan=plan,
        hint="breadth_first_weighted",
        memory_budget=None,
        learn_costs=False,
        source=0,
        fixed="1f1b",
        read=item_sizes,
        draws=watch,
    )
    return ex, learning


def _learning_worker(rank: int, world: int, drawer: int) -> dict[str, Any]:
    """Each rank's learning of 6 steps of varying sizes; rank ``drawer``'s forwards draw
    (its watch sees it at step 1), the others' do not."""
    watch = DrawWatch()
    ex, learning = _learning(rank, world, 4, watch)
    offs: list[str | None] = []
    reading: list[bool] = []
    try:
        for step in range(6):
            items = [torch.zeros(2 + 3 * m + step, 2) for m in range(4)]
            learning.schedule(items if rank == 0 else [None] * 4, None)
            offs.append(learning.off)
            reading.append(learning.reads_sizes)
            if step == 1 and rank == drawer:
                with watch.forward():
                    torch.rand(1)
    finally:
        ex.close()
    return {"rank": rank, "offs": offs, "reading": reading, "watch_on": watch.on}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_one_ranks_draw_stops_learning_on_every_rank_before_the_next_step() -> None:
    res = pooled_spawn(_learning_worker, 3, 2, timeout=100)
    for r in res:
        offs = r["offs"]
        # Steps 0-1 learn; rank 2 drew during step 1: from step 2 on, off on every rank.
        assert offs[:2] == [None, None], r
        assert all(o is not None and "dropout" in o for o in offs[2:]), r
        assert r["reading"][2:] == [False] * 4, r  # (no collective any more)
        assert not r["watch_on"], r


def _mismatch_worker(rank: int, world: int) -> list[int]:
    """Rank 1 plans 3 microbatches where the others plan 4 (a mismatched configuration):
    the flag's exchange is fixed-size, and the sizes' is skipped on every rank."""
    m = 3 if rank == 1 else 4
    ex, learning = _learning(rank, world, m, DrawWatch())
    got = []
    try:
        for step in range(2):
            items = [torch.zeros(2 + 3 * i + step, 2) for i in range(m)]
            sched = learning.schedule(items if rank == 0 else [None] * m, None)
            got.append(sched.plan.microbatches)
    finally:
        ex.close()
    return got


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_microbatches_do_not_exchange_tables_of_other_sizes() -> None:
    # (red with the sizes exchanged anyway: gloo aborts the process on the size mismatch)
    res = pooled_spawn(_mismatch_worker, 2, timeout=100)
    assert res == [[4, 4], [3, 3]]
