"""The drop-in side of the peer benchmark: torch's own ``PipelineStage`` objects around the
same modules as rrfp_async's native rows, stepped by ``rr.pipelining.ScheduleReadinessFirst``
(what a torch pipelining user gets by changing one line).

It runs the same work as the native rows (``PeerStage`` without the weight-gradient sleep,
which ``TableCost`` charges after the task's compute) and declares each step's durations to
the cost-aware hint from the step's sizes, like the native rows' ``with_durations``. What
differs is the adapter: torch's chunking API, the sync face's loop thread, the stage kept open
across steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rrfp_async import Durations, StepPlan

from ._peer_config import TORCH_SCHEDULES, PeerConfig, Step, WorkerRun, resolve_torch_schedule
from ._peer_stage import TableCost, make_inputs, make_modules, peer_loss

__all__ = ["dropin_runs"]


def dropin_runs(
    cfg: PeerConfig, rank: int, steps: Sequence[Step]
) -> tuple[list[WorkerRun], list[Any]]:
    """This rank's drop-in runs (one per hint of ``cfg.dropin_hints`` x memory factor x
    policy, single-chunk hints) and their schedules (the caller closes them)."""
    runs: list[WorkerRun] = []
    schedules: list[Any] = []
    for hint in cfg.dropin_hints:
        for mf in cfg.memory_factors:
            for pol in cfg.policies:
                run, sched = _dropin_run(cfg, rank, steps, hint, pol, mf)
                runs.append(run)
                schedules.append(sched)
    return runs, schedules


def _dropin_run(
    cfg: PeerConfig, rank: int, steps: Sequence[Step], hint: str, pol: str, mf: float
) -> tuple[WorkerRun, Any]:
    import torch.distributed.pipelining as tpp
    from torch.distributed.pipelining import PipelineStage

    from rrfp_async.integrations import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

    # "torch:<schedule>": torch's order is the hint, on that schedule's chunks and placement.
    torch_name = (
        resolve_torch_schedule(hint.removeprefix("torch:")) if hint.startswith("torch:") else None
    )
    n_chunks, placement = TORCH_SCHEDULES[torch_name] if torch_name else (1, "interleaved")
    mods = make_modules(cfg, rank, n_chunks, placement, False, weight_sleep=False)
    n_virtual = cfg.stages * n_chunks
    stages = [
        PipelineStage(mod, v, n_virtual, torch.device("cpu")) for v, mod in sorted(mods.items())
    ]
    done: list[int] = []  # steps run so far: the next one's index in ``steps``

    def declared(plan: StepPlan, chunks: Sequence[Any]) -> Durations:
        # This step's sizes, as the native rows declare them; every rank reads them off the
        # step table (only the first rank has the inputs).
        st = steps[len(done)]
        per = [[cfg.us_per_token * 1e-6 / n_chunks * t for t in st.tokens]]
        return Durations.from_arrays(plan, per * plan.num_virtual)

    def sizes(plan: StepPlan, chunks: Sequence[Any]) -> list[dict[str, float]]:
        # This step's real lengths (every rank reads them off the step table).
        return [{"tokens": float(t)} for t in steps[len(done)].tokens]

    common: dict[str, Any] = {
        "loss_fn": peer_loss,
        "policy": pol,
        "step_timeout": 120,
        "emulate": TableCost(steps=tuple(steps), chunks=n_chunks),
        # Every step measured, as every row's (the drop-in learns from the same steps).
        "measure_activations": cfg.meter,
    }
    if hint == "default":
        # The one-line switch, no argument: the sizes are read off the microbatches, the
        # bytes and the tasks' times learned from the run, the default hint within 1F1B's
        # measured bytes (mf x them when mf is not 1).
        common.update(memory_budget=None if mf == 1 else float(mf))
    elif hint == "sizes":
        # The one-line switch given only the step's sizes: bytes measured and learned, the
        # tasks' times learned, the default hint within mf x 1F1B's measured bytes.
        common.update(sizes=sizes, memory_budget=float(mf))
    else:
        common.update(
            hint=getattr(tpp, torch_name) if torch_name else hint,
            memory_factor=mf,
            durations=declared,
        )
    sched: Any = (
        ScheduleInterleavedReadinessFirst(stages, cfg.microbatches, **common)
        if n_chunks > 1
        else ScheduleReadinessFirst(stages[0], cfg.microbatches, **common)
    )
    run = WorkerRun(
        ("drop-in", hint, pol, mf), n_chunks, placement, None, split=sched.split_backward
    )

    def run_dropin(s: int) -> float:
        assert s == len(done), "the drop-in's step numbers follow the benchmark's"
        xs = make_inputs(cfg, s, steps[s].tokens, None)
        first, last = 0 in mods, n_virtual - 1 in mods
        losses: list[Any] = []
        dist.barrier()
        t0 = time.perf_counter()
        sched.step_microbatches(
            arg_mbs=[(x,) for x in xs] if first else None,
            target_mbs=xs if last else None,
            losses=losses,
            n_microbatches=len(xs),
        )
        t = time.perf_counter() - t0
        done.append(s)
        if losses:
            run.losses.append(sum(float(x) for x in losses) / cfg.microbatches)
        stats = sched.last_stats
        assert stats is not None
        run.peak = max(run.peak, stats.peak_inflight)
        if cfg.meter:
            nbytes = sched.activation_bytes()
            run.peak_bytes.append(stats.held_peak(nbytes))
            run.step_bytes.append([(v, mb, b) for (v, mb), b in sorted(nbytes.items())])
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        return t

    run.fn = run_dropin
    return run, sched
