"""``DistributedStage``'s synchronous face (``with stage:`` + ``run_step_sync``), a step run on
another event loop, and a stage's step under anyio's ``move_on_after`` (on one rank first:
the other's step fails with the cancelled rank's ``PeerStepError``).

The training test holds the sync face to the async one: the same model and microbatches,
trained with ``run_step_sync`` in a plain ``for`` loop and with ``await run_step``, end at
bitwise equal parameters, and both at plain autograd's.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest
import torch
from torch import nn

import rrfp_async as rr
from tests._pool import pooled_spawn
from tests.distributed.test_groups import _bad_inputs, _schedule, _Tagged

STEPS, M = 3, 4
DEADLINES = (0.6, 0.25)
"""Per rank: how long ``move_on_after`` lets the cancelled step run."""

# ---------------------------------------------------------------------- pure (one stage)


class _Tiny:
    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0)
        return torch.full((2,), float(task.mb))


def _single() -> rr.DistributedStage:
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    layout = rr.ProcessLayout(pp=1, rank=0)
    sched = rr.StepSchedule.build(plan, "1f1b")
    return rr.DistributedStage(
        layout, sched, _Tiny(), groups=rr.distributed.StageGroups(), verify_plan=False
    )


def _portal_threads() -> int:
    return sum("-portal-" in t.name for t in threading.enumerate())


@pytest.mark.timeout(30)
def test_the_sync_face_runs_steps_inside_its_with_block_only() -> None:
    before = _portal_threads()
    stage = _single()
    with pytest.raises(
        rr.errors.ClosedError, match=r"inside `with DistributedStage\(...\) as stage:`"
    ):
        stage.run_step_sync([0, 1])
    with pytest.raises(rr.errors.ClosedError, match="it is not open yet"):
        stage.run_step_sync([0, 1])
    with stage as s:
        assert s is stage and _portal_threads() == before + 1
        stats = [stage.run_step_sync([0, 1]) for _ in range(2)]
        assert [x.step for x in stats] == [0, 1]
        assert [str(e.task) for e in stats[0].executed] == ["0F0", "0B0", "0F1", "0B1"]
        with pytest.raises(rr.PlanError, match="a step needs at least 1 microbatch, got 0"):
            stage.run_step_sync([])  # the step's own error, not wrapped
    assert _portal_threads() == before  # the with block stopped its loop thread
    with pytest.raises(rr.errors.ClosedError, match="it was closed"):
        stage.run_step_sync([0, 1])
    with pytest.raises(rr.errors.ClosedError, match="opened once"), stage:
        pass
    assert _portal_threads() == before


@pytest.mark.timeout(30)
def test_an_error_in_the_with_block_closes_the_stage() -> None:
    before = _portal_threads()
    stage = _single()

    def training_loop() -> None:
        with stage:
            stage.run_step_sync([0, 1])
            raise KeyError("the training loop failed")

    with pytest.raises(KeyError):
        training_loop()
    assert stage._state == "closed" and _portal_threads() == before


@pytest.mark.timeout(30)
def test_run_step_sync_in_an_async_with_block_says_to_await() -> None:
    stage = _single()

    async def main() -> None:
        async with stage:
            await asyncio.to_thread(_sync_call_refused, stage)

    rr.run(main())


def _sync_call_refused(stage: rr.DistributedStage) -> None:
    with pytest.raises(
        rr.errors.ClosedError, match=r"opened with `async with`: there, run steps with"
    ):
        stage.run_step_sync([0, 1])


@pytest.mark.timeout(30)
def test_run_step_on_another_loop_names_both_loops() -> None:
    stage = _single()
    with asyncio.Runner() as runner:
        runner.run(stage.__aenter__())
        opened = runner.get_loop()
        with pytest.raises(rr.errors.ClosedError) as ei:
            rr.run(stage.run_step([0, 1]), use_uvloop=False)
        msg = str(ei.value)
        assert msg.startswith("rank 0 (global 0): run_step on event loop asyncio.")
        cls = f"{type(opened).__module__}.{type(opened).__qualname__}"
        assert f"but the stage was opened on event loop {cls} at {id(opened):#x}" in msg
        assert msg.count(" at 0x") == 2 and "(running)" in msg and "(not running)" in msg
        assert runner.run(stage.run_step([0, 1])).step == 0  # nothing happened to the stage
        runner.run(stage.__aexit__(None, None, None))


# ---------------------------------------------------------------------- (e) training


def _loss(out: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return (out - mb[:, :3]).pow(2).mean()


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 3)]


def _batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(5, 6, generator=g) for _ in range(M)] for _ in range(STEPS)]


def _train(
    layout: rr.ProcessLayout, groups: rr.distributed.StageGroups, sync: bool
) -> dict[str, Any]:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=M)
    mod = _model()[layout.pp_rank]
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    ex = rr.TorchStageExecutor({layout.pp_rank: mod}, _loss, rank=layout.rank)
    stage = rr.DistributedStage(
        layout, rr.StepSchedule.build(plan, "1f1b"), ex, groups=groups, step_timeout=60
    )
    try:
        if sync:  # the synchronous training loop
            with stage:
                for mbs in _batches():
                    stage.run_step_sync(mbs)
                    opt.step()
                    opt.zero_grad()
        else:

            async def main() -> None:
                async with stage:
                    for mbs in _batches():
                        await stage.run_step(mbs)
                        opt.step()
                        opt.zero_grad()

            rr.run(main())
    finally:
        ex.close()
    return {
        "params": {k: v.detach().clone() for k, v in mod.state_dict().items()},
        "plan_checks": stage.plan_checks,
    }


def _disagree(layout: rr.ProcessLayout, groups: rr.distributed.StageGroups) -> tuple[str, str]:
    """Rank 1 builds a plan of another size: ``run_step_sync`` raises the plan check's
    ``PlanError`` itself, on every rank."""
    m = 2 if layout.rank == 0 else 3
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=m)
    stage = rr.DistributedStage(
        layout, rr.StepSchedule.build(plan, "1f1b"), _Tagged(1), groups=groups, step_timeout=30
    )
    try:
        with stage:
            stage.run_step_sync(list(range(m)))
    except Exception as e:
        return type(e).__name__, str(e)
    return "none", ""


def _sync_worker(rank: int, world: int) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    before = _portal_threads()
    out: dict[str, Any] = {
        "sync": _train(layout, groups, True),
        "async": _train(layout, groups, False),
    }
    out["disagree"] = _disagree(layout, groups)
    out["threads_left"] = _portal_threads() - before
    return out


def _reference() -> list[dict[str, torch.Tensor]]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # like every spawned rank
    try:
        mods = _model()
        opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
        for mbs in _batches():
            for mb in mbs:  # accumulated in microbatch order, as 1F1B's backwards run
                (_loss(mods[1](mods[0](mb)), mb) / M).backward()
            opt.step()
            opt.zero_grad()
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in mods]
    finally:
        torch.set_num_threads(n)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_synchronous_training_loop_trains_like_the_async_one() -> None:
    res = pooled_spawn(_sync_worker, 2, timeout=150)
    ref = _reference()
    for rank, r in enumerate(res):
        sync, asyn = r["sync"]["params"], r["async"]["params"]
        assert sync.keys() == asyn.keys() == ref[rank].keys()
        for k in sync:
            assert torch.equal(sync[k], asyn[k]), (rank, k)  # bitwise: one implementation
            assert torch.allclose(sync[k], ref[rank][k], rtol=0, atol=1e-6), (rank, k)
        assert not torch.equal(sync["0.weight" if rank == 0 else "weight"], _initial(rank))
        assert r["sync"]["plan_checks"] == r["async"]["plan_checks"] == 1
        kind, msg = r["disagree"]
        assert kind == "PlanError", msg
        assert "the ranks disagree on the plan" in msg and "microbatches" in msg
        assert r["threads_left"] == 0


def _initial(rank: int) -> torch.Tensor:
    m = _model()[rank]
    w = m[0].weight if isinstance(m, nn.Sequential) else m.weight
    assert isinstance(w, torch.Tensor)
    return w.detach()


# ---------------------------------------------------------------------- anyio scope


def _cancelled_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    ex = _Tagged(1, delay=0.1)
    stage = rr.DistributedStage(layout, _schedule(M, "gpipe"), ex, groups=groups, step_timeout=30)
    # GPipe: rank 0 sends a forward every 0.1 s. Rank 1 gives up first, so rank 0's last
    # forwards of step 1 reach rank 1 during its step 2 (and are dropped there).
    deadline = DEADLINES[rank]
    out: dict[str, Any] = {}

    async def main() -> None:
        async with stage:
            await stage.run_step(list(range(M)))  # step 0, with the plan check
            dist.barrier()
            # Timed on the event loop's clock, the one the scope's deadline is on (uvloop's
            # ticks in whole milliseconds behind time.monotonic(): on that clock the scope
            # ended 0.13 ms "before" its 0.25 s deadline once).
            clock = asyncio.get_running_loop().time
            t0 = clock()
            out["error"] = None
            with anyio.move_on_after(deadline) as scope:
                try:
                    await stage.run_step(list(range(M)))
                except rr.PeerStepError as e:  # the other rank's cancel came first
                    out["error"] = str(e)
            out["cancelled"] = scope.cancelled_caught
            out["took"] = clock() - t0
            out["step1_ran"] = sum(s == 1 for s, _ in ex.seen)
            arrived = sum(stage.channel.arrivals(1).values())
            st = await stage.run_step(list(range(M)))  # the next step runs correctly
            out["after"] = (st.step, len(st.executed), _bad_inputs(ex, 2))
            out["late"] = sum(stage.channel.arrivals(1).values()) - arrived

    rr.run(main())
    return out


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_distributed_step_under_move_on_after_is_cancelled_and_the_next_runs() -> None:
    res = pooled_spawn(_cancelled_worker, 2, timeout=150)
    # Rank 1 gives up first; rank 0 learns it from rank 1's ABORT, before its own deadline.
    assert res[1]["cancelled"] and res[1]["error"] is None, res[1]
    assert not res[0]["cancelled"], res[0]
    assert "step 1 failed on rank 1 (global 1): the step was cancelled there" in res[0]["error"]
    assert DEADLINES[1] <= res[0]["took"] < DEADLINES[0], res[0]
    assert DEADLINES[1] <= res[1]["took"] < DEADLINES[1] + 0.5, res[1]
    for r in res:
        assert 0 < r["step1_ran"] < 2 * M  # cut short mid-step (not vacuous)
        assert r["after"] == (2, 2 * M, []), r
    assert res[1]["late"] > 0  # step 1's messages landed in rank 1's step 2 (not vacuous)


# ---------------------------------------------------------------------- refused calls


class _Slow:
    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        await asyncio.sleep(0.01)
        return torch.zeros(2)


@pytest.mark.timeout(30)
def test_a_refused_run_step_changes_nothing() -> None:
    """Bad arguments and a second call while a step runs are refused before the step counts:
    no number is consumed, the running step goes on (and no peer would be told)."""
    plan = rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2)
    layout = rr.ProcessLayout(pp=1, rank=0)
    sched = rr.StepSchedule.build(plan, "1f1b")
    stage = rr.DistributedStage(
        layout, sched, _Slow(), groups=rr.distributed.StageGroups(), verify_plan=False
    )

    async def main() -> list[int]:
        async with stage:
            with pytest.raises(rr.PlanError, match="train must be True or False, got 1"):
                await stage.run_step([0, 1], train=1)  # type: ignore[arg-type]
            with pytest.raises(rr.PlanError, match="step must be <= 9223372036854775806"):
                await stage.run_step([0, 1], step=2**63)
            running = asyncio.ensure_future(stage.run_step([0, 1]))
            await asyncio.sleep(0.005)  # inside its first task
            with pytest.raises(rr.PlanError, match=r"already running step 0.*changed nothing"):
                await stage.run_step([0, 1])
            first = await running
            assert len(first.executed) == 4
            return [first.step, (await stage.run_step([0, 1])).step]

    assert rr.run(main()) == [0, 1]
