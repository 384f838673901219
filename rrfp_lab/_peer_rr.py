"""The rrfp_async side of the peer benchmark: one run per hint x memory factor x policy, a
``DistributedStage`` over a ``TorchStageExecutor`` of the same ``PeerStage`` modules (without
their weight-gradient sleep, which ``TableCost`` charges after the task's compute).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from rrfp_async import Durations, StepPlan

from ._peer_config import PeerConfig, Step, WorkerRun, step_plan
from ._peer_stage import PeerStage, TableCost, make_inputs, make_modules, peer_loss

if TYPE_CHECKING:
    from rrfp_async.distributed import ProcessLayout, StageGroups

__all__ = ["rr_runs"]


def rr_runs(
    cfg: PeerConfig,
    rank: int,
    steps: Sequence[Step],
    layout: ProcessLayout,
    groups: StageGroups,
    loop: asyncio.AbstractEventLoop,
) -> tuple[list[WorkerRun], list[Callable[[], None]]]:
    """This rank's rrfp_async runs, each stepping a ``DistributedStage`` on ``loop``, and the
    closers of their executors (the caller closes them after the last step)."""
    from rrfp_async.distributed import DistributedStage, TorchStageExecutor
    from rrfp_async.policies import StepSchedule

    runs: list[WorkerRun] = []
    closers: list[Callable[[], None]] = []
    for hint in cfg.hints:
        name, split = _rr_split(hint)
        chunks, placement = _rr_chunks(name)
        plan = step_plan(cfg, chunks, placement, split)
        mods = make_modules(cfg, rank, chunks, placement, False, weight_sleep=False)
        executor = TorchStageExecutor(
            mods,
            peer_loss,
            rank=rank,
            emulate=TableCost(steps=tuple(steps), chunks=chunks),
            measure_activations=cfg.meter,
        )
        closers.append(executor.close)
        for mf in cfg.memory_factors:
            for pol in cfg.policies:
                run = WorkerRun(("rrfp_async", hint, pol, mf), chunks, placement, None, split=split)
                first = StepSchedule.build(plan, name, memory_factor=mf)

                def run_rr(
                    s: int,
                    pol: str = pol,
                    plan: StepPlan = plan,
                    chunks: int = chunks,
                    executor: TorchStageExecutor = executor,
                    mods: dict[int, PeerStage] = mods,
                    run: WorkerRun = run,
                    first: StepSchedule = first,
                ) -> float:
                    st = steps[s]
                    declared = Durations.from_arrays(
                        plan,
                        [[cfg.us_per_token * 1e-6 / chunks * t for t in st.tokens]]
                        * plan.num_virtual,
                    )
                    xs = make_inputs(cfg, s, st.tokens, None)

                    async def go() -> tuple[float, Any]:
                        # The channel opens and closes outside the timed part; the per-step
                        # hint (a cost-aware one reads this step's sizes) is inside it.
                        async with DistributedStage(
                            layout, first, executor, groups=groups, policy=pol, step_timeout=120
                        ) as ds:
                            sch = first.with_durations(declared)
                            # The plan check (once per stage) stays out of the timed step.
                            await ds.check_plan(sch, step=s)
                            dist.barrier()
                            t0 = time.perf_counter()
                            stats = await ds.run_step(xs, step=s, schedule=sch)
                            return time.perf_counter() - t0, stats

                    t, stats = loop.run_until_complete(go())
                    run.peak = max(run.peak, stats.peak_inflight)
                    if cfg.meter:
                        nbytes = executor.activation_bytes()
                        run.peak_bytes.append(stats.held_peak(nbytes))
                        run.step_bytes.append([(v, mb, b) for (v, mb), b in sorted(nbytes.items())])
                    if executor.losses:
                        run.losses.append(sum(executor.losses.values()) / cfg.microbatches)
                    for m in mods.values():
                        m.zero_grad(set_to_none=True)
                    return t

                run.fn = run_rr
                runs.append(run)
    return runs, closers


def _rr_split(hint: str) -> tuple[str, bool]:
    """``"name:split"`` runs the hint on a split backward (I/W); ``zb_h1`` always splits."""
    name, _, flag = hint.partition(":")
    return name, flag == "split" or name in ("zb_h1", "zbh1")


def _rr_chunks(hint: str) -> tuple[int, str]:
    return (2, "interleaved") if hint in _TWO_CHUNK_HINTS else (1, "interleaved")


_TWO_CHUNK_HINTS = ("interleaved_1f1b", "interleaved", "looped_bfs")
