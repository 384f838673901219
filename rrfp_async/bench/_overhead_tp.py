"""``bench overhead``, TP coordination: one TP decision through ``channels.DecisionChannel``
(leader publishes, followers receive) against a raw blocking ``dist.broadcast`` of the same
``int64[6]`` on the same group, TP = 2 and 4 processes; plus the coordination measured
inside a real ``DistributedStage`` (coordinated vs uncoordinated step time), and the share of
step time for tasks of ``compute_ms``. One ``spawn`` job per TP size (gloo on 127.0.0.1,
one torch thread per process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from .._bridges import ComputeWorker
from ._overhead_common import Row, median_of, transport_figures

__all__ = ["TP_SHARE_TARGET", "TP_TARGET_RATIO", "tp_coordination"]

TP_TARGET_RATIO = 1.25
"""Target: TP coordination per decision at most this times a raw blocking broadcast."""
TP_SHARE_TARGET = 0.01
"""Target: TP coordination under this share of step time (tasks of 5 ms or more)."""


class _SleepExecutor:
    """Each task sleeps ``seconds`` on a compute thread, the way ``TorchStageExecutor`` emulates
    GPU time (0: returns at once, no thread).

    Not ``asyncio.sleep`` on the loop: the loop's timers have millisecond resolution (epoll;
    libuv), so a 5 ms wait ends up to 1 ms late whenever anything else wakes the loop in
    between, and TP coordination, which wakes it (a decision arriving, a send), would be
    charged that rounding: a timeline of a TP = 2 stage gave 5.48 / 5.34 ms per 5 ms wait
    coordinated against 5.23 / 5.24 ms uncoordinated that way, and 5.32 / 5.32 against
    5.32 / 5.33 ms with the wait on a compute thread.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.worker = ComputeWorker(name="rrfp-bench-tp") if seconds > 0 else None

    async def execute(self, task: Any, data: Any, ctx: Any, /) -> Any:
        if self.worker is not None:
            await self.worker.run(time.sleep, self.seconds)
        return None

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _tp_rank(
    rank: int,
    world: int,
    n: int,
    batches: int,
    compute_s: float,
    microbatches: int,
    steps: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .._tasks import StepPlan, Task, Topology
    from ..channels._decisions import DecisionChannel
    from ..distributed._layout import ProcessLayout, build_groups
    from ..distributed._stage import DistributedStage
    from ..loop._runner import loop_factory
    from ..policies._schedule import StepSchedule

    layout = ProcessLayout.from_world(pp=1, tp=world)
    groups = build_groups(layout)
    group = groups.decisions
    leader = layout.tp_ranks()[0]
    buf = torch.zeros(6, dtype=torch.int64)  # the size of a decision

    def raw_batch() -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        for _ in range(n):
            dist.broadcast(buf, src=leader, group=group)
        return time.perf_counter() - t

    plan = StepPlan(topology=Topology(stages=1), microbatches=microbatches)
    sched = StepSchedule.build(plan, "1f1b")
    mbs = list(range(microbatches))

    async def main() -> dict[str, Any]:
        ch = DecisionChannel(
            group, leader=leader, rank=layout.rank, tp_rank=layout.tp_rank, stage=0
        )
        step = 0

        async def channel_batch() -> float:
            nonlocal step
            dist.barrier(group=group)
            t = time.perf_counter()
            ch.begin_step(step, n)
            if ch.is_leader:
                for seq in range(n):
                    ch.publish(step, seq, Task(0, "F", seq))
                await ch.end_step()
            else:
                for seq in range(n):
                    got = await ch.receive(step, seq)
                    if got.mb != seq:
                        raise RuntimeError(f"decision {seq} carried {got}")
            step += 1
            return time.perf_counter() - t

        raw_batch()
        await channel_batch()
        raw, chan = [], []
        for _ in range(batches):
            raw.append(raw_batch())
            chan.append(await channel_batch())
        # The stages below get channels of their own on the same group.
        await asyncio.get_running_loop().run_in_executor(None, ch.close)

        async def stage_times(seconds: float) -> tuple[list[float], list[float], int]:
            """Step times of a coordinated and an uncoordinated stage, steps alternating."""
            times: dict[bool, list[float]] = {True: [], False: []}
            decisions = 0

            executors: list[_SleepExecutor] = []

            def make(coordinate: bool) -> DistributedStage:
                executors.append(_SleepExecutor(seconds))
                return DistributedStage(
                    layout,
                    sched,
                    executors[-1],
                    groups=groups,
                    policy="readiness_first",
                    coordinate_tp=coordinate,
                    step_timeout=60.0,
                )

            async with make(True) as on, make(False) as off:
                for s in range(steps + 1):
                    for coordinate, stage in ((True, on), (False, off)):
                        dist.barrier()
                        t = time.perf_counter()
                        st = await stage.run_step(mbs, step=s)
                        if s:  # the first step of each warms up
                            times[coordinate].append(time.perf_counter() - t)
                        decisions = st.decisions
            for ex in executors:
                ex.close()
            return times[True], times[False], decisions

        noop_on, noop_off, d = await stage_times(0.0)
        busy_on, busy_off, _ = await stage_times(compute_s)
        return {
            "raw": raw,
            "channel": chan,
            "noop_on": noop_on,
            "noop_off": noop_off,
            "busy_on": busy_on,
            "busy_off": busy_off,
            "decisions": d,
            "published": ch.published,
        }

    with asyncio.Runner(loop_factory=loop_factory(True)) as runner:
        return runner.run(main())


def _slowest(per_rank: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Per batch / step, the slowest rank's time (what the stage as a whole pays)."""
    return [max(vals) for vals in zip(*(r[key] for r in per_rank), strict=True)]


def tp_coordination(
    tps: Sequence[int] = (2, 4),
    *,
    decisions: int = 200,
    compute_ms: float = 5.0,
    microbatches: int = 8,
    steps: int = 12,
    batches: int = 20,
    timeout: float = 180.0,
) -> list[Row]:
    """TP coordination per decision against a raw blocking broadcast on the same group.

    Per TP size, one ``spawn`` job of ``tp`` processes (one pipeline stage, its TP ranks,
    the dedicated decision group from ``build_groups``):

    * ``raw_us``: blocking ``dist.broadcast`` of an ``int64[6]`` (a decision's size) from
      the leader, back to back; ``channel_us``: ``DecisionChannel`` -- the leader
      ``publish``es the batch's decisions (asynchronous broadcasts) and awaits
      ``end_step``, followers ``receive`` each (``depth`` posted ahead) and check it.
      Both: the slowest rank's time from a group barrier / decisions, ``batches``
      interleaved batches; lower deciles as in ``message_cost`` (medians and paired
      ratios too); ``ratio`` = channel / raw.
    * ``stage_us``: inside a real ``DistributedStage`` (1-stage 1F1B plan, ``microbatches``
      microbatches, no-op tasks): (coordinated - uncoordinated step time) / decisions,
      slowest rank, medians of ``steps`` steps, coordinated and uncoordinated steps
      alternating.
    * ``share``: ``channel_us / (channel_us + compute_ms * 1000)`` -- the coordination of
      one decision as a fraction of a task of ``compute_ms`` plus that coordination, i.e. as
      if it were never overlapped with compute (a worst case). ``share_measured`` (the
      target's figure): median over step pairs of (coordinated - uncoordinated) /
      coordinated step time, steps alternating, with tasks that sleep
      ``compute_ms`` on a compute thread, like the emulated GPU time of
      ``TorchStageExecutor`` (a stand-in for a GPU kernel: the CPU is free meanwhile).

    Returns:
        Rows ``{tp, decisions, raw_us, channel_us, ratio, raw_median_us,
        channel_median_us, ratio_paired, contended, stage_us, stage_coord_us,
        stage_uncoord_us, compute_ms, share, step_coord_ms, step_uncoord_ms,
        share_measured, step_decisions, published, target_ratio, met_ratio, met_share}``.
    """
    from ..distributed._spawn import spawn

    n = max(1, decisions // batches)
    rows: list[Row] = []
    for tp in tps:
        if tp < 2:
            raise ValueError(f"TP coordination needs tp >= 2, got {tp}")
        res = spawn(
            _tp_rank, tp, n, batches, compute_ms / 1e3, microbatches, steps, timeout=timeout
        )
        fig = transport_figures(_slowest(res, "raw"), _slowest(res, "channel"), n)
        ch_us = fig["channel_us"]
        d = res[0]["decisions"]
        on = median_of(_slowest(res, "noop_on"))
        off = median_of(_slowest(res, "noop_off"))
        b_on, b_off = _slowest(res, "busy_on"), _slowest(res, "busy_off")
        busy_on, busy_off = median_of(b_on), median_of(b_off)
        # Paired: each coordinated step against the uncoordinated one right after it.
        measured = median_of([(x - y) / x for x, y in zip(b_on, b_off, strict=True)])
        share = ch_us / (ch_us + compute_ms * 1e3)
        rows.append(
            {
                "tp": tp,
                "decisions": n * batches,
                **fig,
                "stage_us": 1e6 * (on - off) / d,
                "stage_coord_us": 1e6 * on / d,
                "stage_uncoord_us": 1e6 * off / d,
                "compute_ms": compute_ms,
                "share": share,
                "step_coord_ms": 1e3 * busy_on,
                "step_uncoord_ms": 1e3 * busy_off,
                "share_measured": measured,
                "step_decisions": d,
                "published": res[0]["published"],
                "target_ratio": TP_TARGET_RATIO,
                "met_ratio": fig["ratio"] <= TP_TARGET_RATIO,
                "met_share": measured < TP_SHARE_TARGET,
            }
        )
    return rows
