"""A stage's p2p group and event loop: two stages in one process, a stage next to torch
pipelining on the default group, a p2p group shared by two open stages (refused), and a
step run on another event loop than the stage's (refused at once, not after the watchdog).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

import rrfp_async as rr
from tests._pool import pooled_spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


class _Tagged:
    """Each task's output is ``[pipeline id, step, stage, microbatch]`` padded to ``width``
    floats (so two pipelines send messages of different sizes); records every input."""

    def __init__(self, pid: int, width: int = 4, delay: float = 0.0) -> None:
        self.pid = pid
        self.width = width
        self.delay = delay
        self.seen: dict[tuple[int, str], Any] = {}

    async def execute(self, task: rr.Task, data: Any, ctx: rr.TaskContext, /) -> Any:
        self.seen[(ctx.step, str(task))] = data.tolist()[:4] if torch.is_tensor(data) else data
        await asyncio.sleep(self.delay)
        out = torch.zeros(self.width)
        out[:4] = torch.tensor([self.pid, ctx.step, task.stage, task.mb], dtype=torch.float32)
        return out


def _bad_inputs(ex: _Tagged, step: int) -> list[str]:
    """The inputs of ``step`` that did not come from this pipeline's tasks of that step."""
    bad = []
    for (s, task), data in ex.seen.items():
        if s != step or not isinstance(data, list):
            continue
        t = rr.Task.parse(task)
        if data[0] != ex.pid or data[1] != step or data[3] != t.mb:
            bad.append(f"{task}@{step} got {data}")
    return bad


def _schedule(microbatches: int, hint: str) -> rr.StepSchedule:
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=microbatches)
    return rr.StepSchedule.build(plan, hint)


# ---------------------------------------------------------------------- (a) two stages


def _two_stages(rank: int, world: int) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=2)
    ga, gb = rr.build_groups(layout), rr.build_groups(layout)
    ea, eb = _Tagged(1, width=4, delay=0.002), _Tagged(2, width=300, delay=0.001)
    a = rr.DistributedStage(layout, _schedule(4, "1f1b"), ea, groups=ga, step_timeout=30)
    b = rr.DistributedStage(layout, _schedule(3, "gpipe"), eb, groups=gb, step_timeout=30)
    out: dict[str, Any] = {"groups_differ": ga.p2p is not gb.p2p and ga.p2p is not None}

    async def main() -> None:
        async with a, b:
            for step in range(3):  # both stages' steps at once, on one loop
                sa, sb = await asyncio.gather(a.run_step(list(range(4))), b.run_step([0, 1, 2]))
                out.setdefault("executed", []).append((len(sa.executed), len(sb.executed)))
                out.setdefault("bad", []).extend(_bad_inputs(ea, step) + _bad_inputs(eb, step))
            # ... and one after the other
            out["after"] = [(await s.run_step(list(range(n)))).step for s, n in ((a, 4), (b, 3))]

    rr.run(main())
    return out


def test_two_stages_in_one_process_run_interleaved_steps() -> None:
    res = pooled_spawn(_two_stages, 2, timeout=120)
    for r in res:
        assert r["groups_differ"]
        assert r["executed"] == [(8, 6)] * 3
        assert r["bad"] == []
        assert r["after"] == [3, 3]


# ---------------------------------------------------------------------- (b) torch pipelining


def _torch_next_to_a_stage(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed.pipelining as tpp

    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    ex = _Tagged(1, width=8)
    stage = rr.DistributedStage(layout, _schedule(4, "1f1b"), ex, groups=groups)
    torch.manual_seed(0)
    full = [torch.nn.Linear(6, 6) for _ in range(2)]
    x = torch.randn(8, 6)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with stage:  # open: its listener threads keep a receive posted
            await stage.run_step(list(range(4)))
            # torch's 1F1B on the default group, in the same processes, run synchronously
            # on this thread while the stage's threads wait for their next message.
            tstage = tpp.PipelineStage(full[rank], rank, 2, torch.device("cpu"))
            sched = tpp.Schedule1F1B(
                tstage, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).mean()
            )
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=torch.zeros(8, 6), losses=losses)
            out["torch_losses"] = [float(v.detach()) for v in losses]
            out["grad"] = full[rank].weight.grad.clone()
            st = await stage.run_step(list(range(4)))  # and the stage still works
            out["after"] = (st.step, len(st.executed), _bad_inputs(ex, st.step))

    rr.run(main())
    return out


def test_a_stage_next_to_torch_schedule_1f1b_on_the_default_group() -> None:
    res = pooled_spawn(_torch_next_to_a_stage, 2, timeout=120)
    assert [r["after"] for r in res] == [(1, 8, []), (1, 8, [])]
    # torch's step ran to completion, and computed what plain autograd computes
    torch.manual_seed(0)
    full = [torch.nn.Linear(6, 6) for _ in range(2)]
    x = torch.randn(8, 6)
    ref_losses = []
    for mb in x.chunk(4):
        loss = full[1](full[0](mb)).pow(2).mean()
        ref_losses.append(float(loss.detach()))
        (loss / 4).backward()
    assert res[1]["torch_losses"] == pytest.approx(ref_losses, rel=1e-5)
    for r in range(2):
        grad = full[r].weight.grad
        assert grad is not None
        assert torch.allclose(res[r]["grad"], grad, atol=1e-6)


# ---------------------------------------------------------------------- (c) shared groups


def _shared_groups(rank: int, world: int) -> dict[str, Any]:
    import threading

    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    sched = _schedule(2, "1f1b")
    out: dict[str, Any] = {}

    def stage(g: rr.distributed.StageGroups) -> rr.DistributedStage:
        return rr.DistributedStage(layout, sched, _Tagged(1), groups=g, verify_plan=False)

    async def main() -> None:
        async with stage(groups) as first:
            try:
                async with stage(groups):
                    out["second"] = "opened"
            except rr.PlanError as e:
                out["second"] = str(e)
            threads = threading.active_count()
            try:
                with stage(groups):  # the sync face refuses too, and leaves no thread behind
                    out["sync"] = "opened"
            except rr.PlanError as e:
                out["sync"] = str(e)
            out["threads_left"] = threading.active_count() - threads
            await first.run_step([0, 1])  # the open stage is unharmed
        async with stage(groups) as again:  # closed: its group is free again
            out["again"] = (await again.run_step([0, 1])).step
        # Groups built by hand without a p2p group: both stages would use the default group.
        bare = rr.distributed.StageGroups(control=groups.control)
        async with stage(bare) as d:
            try:
                async with stage(rr.distributed.StageGroups(control=groups.control)):
                    out["default"] = "opened"
            except rr.PlanError as e:
                out["default"] = str(e)
            await d.run_step([0, 1])

    rr.run(main())
    return out


def test_a_p2p_group_used_by_an_open_stage_is_refused() -> None:
    res = pooled_spawn(_shared_groups, 2, timeout=120)
    for rank, r in enumerate(res):
        head = f"rank {rank} (global {rank}) of the pipeline of global ranks [0, 1]:"
        for key in ("second", "sync"):
            msg = r[key]
            assert msg.startswith(head), msg
            assert "the p2p group of these StageGroups is already used by another open" in msg
            assert "call rr.build_groups(layout) once per stage" in msg
        assert r["threads_left"] == 0
        assert r["again"] == 0
        assert "the default process group (these StageGroups have no p2p group)" in r["default"]


# ---------------------------------------------------------------------- (d) another loop


def _other_loop(rank: int, world: int) -> dict[str, Any]:
    layout = rr.ProcessLayout.from_world(pp=2)
    groups = rr.build_groups(layout)
    stage = rr.DistributedStage(
        layout, _schedule(2, "1f1b"), _Tagged(1), groups=groups, step_timeout=10
    )
    out: dict[str, Any] = {}
    with asyncio.Runner() as runner:  # the stage's loop, kept between calls
        runner.run(stage.__aenter__())
        runner.run(stage.run_step([0, 1]))
        t0 = time.monotonic()
        try:
            rr.run(stage.run_step([0, 1]))  # a fresh loop per step: the natural sync mistake
        except rr.RRFPError as e:
            out["error"] = (type(e).__name__, str(e))
        out["seconds"] = time.monotonic() - t0
        out["loop"] = f"at {id(runner.get_loop()):#x}"
        st = runner.run(stage.run_step([0, 1]))  # the refused call left the stage usable
        out["after"] = st.step
        runner.run(stage.__aexit__(None, None, None))
    return out


def test_run_step_on_another_event_loop_is_refused_at_once() -> None:
    res = pooled_spawn(_other_loop, 2, timeout=120)
    for rank, r in enumerate(res):
        kind, msg = r["error"]
        assert kind == "ClosedError", msg
        assert r["seconds"] < 2.0  # at once, not after the 10 s watchdog
        assert msg.startswith(f"rank {rank} (global {rank}): run_step on event loop uvloop.Loop")
        # both loops, told apart: this one (running) and the stage's (not running now)
        assert "(running), but the stage was opened on event loop" in msg
        assert f"{r['loop']} (not running)" in msg
        assert "one `rr.run` around the whole training loop" in msg
        assert "stage.run_step_sync(...)" in msg
        assert r["after"] == 1
