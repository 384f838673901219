"""The torch side of the peer benchmark: one run per ``torch.distributed.pipelining``
schedule, on the same ``PeerStage`` modules and microbatches as rrfp_async's runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._peer_config import TORCH_SCHEDULES, PeerConfig, Step, WorkerRun
from ._peer_stage import LiveBytes, PeerStage, make_inputs, make_modules, peer_loss

__all__ = ["torch_runs"]

_TORCH_SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _torch_peak(order: Sequence[Any]) -> int:
    live = peak = 0
    for a in order:
        if a is None:
            continue
        kind = str(a.computation_type)
        if "FORWARD" in kind and "BACKWARD" not in kind:
            live += 1
        elif "FULL_BACKWARD" in kind or "WEIGHT" in kind:
            live -= 1
        peak = max(peak, live)
    return peak


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Every rank enters a barrier, then runs ``fn``: its seconds and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def torch_runs(cfg: PeerConfig, rank: int, steps: Sequence[Step]) -> list[WorkerRun]:
    """This rank's torch runs: one per schedule of ``cfg.torch_schedules`` (a second one
    charged at the padded length for ``cfg.padded_cost``), each timing ``sched.step`` on the
    step's microbatches padded to the longest of the run. A schedule torch refuses to build
    is a run without a function, carrying the error. With ``cfg.meter`` its modules measure
    each step's activation bytes as they run (``LiveBytes``)."""
    import torch.distributed.pipelining as tpp

    pad = max(max(st.tokens) for st in steps)
    runs: list[WorkerRun] = []
    for name in cfg.torch_schedules:
        chunks, placement = TORCH_SCHEDULES[name]
        for padded in (False, True) if name in cfg.padded_cost else (False,):
            mods = make_modules(cfg, rank, chunks, placement, padded)
            live = LiveBytes() if cfg.meter else None
            for mod in mods.values():
                mod.live = live
            tstages = [
                tpp.PipelineStage(mod, v, cfg.stages * chunks, torch.device("cpu"))
                for v, mod in sorted(mods.items())
            ]
            cls = getattr(tpp, name)
            try:
                sched = (
                    cls(tstages[0], n_microbatches=cfg.microbatches, loss_fn=peer_loss)
                    if chunks == 1
                    else cls(tstages, n_microbatches=cfg.microbatches, loss_fn=peer_loss)
                )
            except Exception as e:  # e.g. a schedule that needs more microbatches
                runs.append(
                    WorkerRun(("torch", name, padded), chunks, placement, None, error=str(e))
                )
                continue
            # Only torch schedules that build a per-rank action table have a pipeline_order.
            order = getattr(sched, "pipeline_order", None)
            run = WorkerRun(
                ("torch", name, padded), chunks, placement, None, split=name in _TORCH_SPLIT
            )
            run.peak = (
                _torch_peak(order.get(rank, []))
                if isinstance(order, dict)
                else (cfg.microbatches if name == "ScheduleGPipe" else cfg.stages - rank)
            )

            def run_torch(
                s: int,
                sched: Any = sched,
                mods: dict[int, PeerStage] = mods,
                run: WorkerRun = run,
                live: LiveBytes | None = live,
            ) -> float:
                batch = torch.cat(make_inputs(cfg, s, steps[s].tokens, pad), dim=0)
                out: list[torch.Tensor] = []
                if live is not None:
                    live.begin()
                args = (batch,) if 0 in mods else ()
                if cfg.stages * len(mods) - 1 in mods:  # the last virtual stage is here
                    t, _ = _timed(lambda: sched.step(*args, target=batch, losses=out))
                    run.losses.append(sum(float(x.detach()) for x in out) / cfg.microbatches)
                else:
                    t, _ = _timed(lambda: sched.step(*args))
                if live is not None:
                    live.end()
                    run.peak_bytes.append(live.peak)
                    run.orders.append(live.order)
                for m in mods.values():
                    m.zero_grad(set_to_none=True)
                return t

            run.fn = run_torch
            runs.append(run)
    return runs
