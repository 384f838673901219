"""Per-task host overhead and thread hand-offs: our stage against torch ``Schedule1F1B``
(``bench overhead --section task``; part 5 of ``scripts/gpu_check.py`` on a GPU).

One stage, one process, ``M`` microbatches of a small MLP: the step time of a
``DistributedStage`` running ``TorchStageExecutor`` tasks, and of torch's ``Schedule1F1B``
on the same module, against the same forwards and backwards run back to back with no
scheduler (the compute alone). Idle per task = (step time - compute) / tasks: on a GPU,
the time the device waits for the host between tasks. Hand-offs per task: the thread
hand-offs of the stage's ``ComputeWorker`` (loop -> compute thread -> loop, plus the event
waits on CUDA), counted, not timed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["task_overhead", "task_overhead_isolated"]

Row = dict[str, Any]


def _loss(out: torch.Tensor, mb: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def task_overhead(
    device: str = "cpu", *, microbatches: int = 16, width: int = 256, repeats: int = 7
) -> Row:
    """The figures of the module docstring, in this process (it needs an initialized
    default process group, of one rank).

    Args:
        device: Where the module and the microbatches live (``cuda:0`` on a GPU).
        microbatches: Microbatches per step.
        width: The MLP's width.
        repeats: Steps per schedule (the first is a warm-up).

    Returns:
        ``compute_ms``, ``ours_ms``, ``torch_ms`` (medians), ``idle_ours_us``,
        ``idle_torch_us`` per task, ``handoffs_per_task`` (ours), ``losses_agree``.
    """
    import torch.distributed.pipelining as tpp

    from rrfp_async import StepPlan, Topology
    from rrfp_async.distributed import DistributedStage, ProcessLayout, TorchStageExecutor
    from rrfp_async.loop import ComputeWorker, run
    from rrfp_async.policies import StepSchedule

    dev = torch.device(device)
    m = microbatches
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)).to(dev)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randn(64, width, generator=g).to(dev) for _ in range(m)]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def compute() -> float:
        sync()
        t = time.perf_counter()
        for mb in mbs:
            torch.autograd.backward(_loss(mod(mb), mb) / m)
        sync()
        return time.perf_counter() - t

    base = statistics.median(compute() for _ in range(repeats))
    mod.zero_grad(set_to_none=True)

    layout = ProcessLayout.from_world(pp=1)
    sched = StepSchedule.build(StepPlan(topology=Topology(stages=1), microbatches=m), "1f1b")
    worker = ComputeWorker(device=dev if dev.type == "cuda" else None)
    ex = TorchStageExecutor({0: mod}, _loss, worker=worker)
    ours: list[float] = []
    hops = [0, 0]

    async def main() -> None:
        async with DistributedStage(layout, sched, ex, device=dev) as stage:
            for s in range(repeats):
                sync()
                h0 = worker.handoffs
                t = time.perf_counter()
                await stage.run_step(mbs, step=s)
                sync()
                ours.append(time.perf_counter() - t)
                hops[0] += worker.handoffs - h0
                hops[1] += 2 * m
                mod.zero_grad(set_to_none=True)

    try:
        run(main())
        l_ours = dict(ex.losses)
    finally:
        ex.close()

    tstage = tpp.PipelineStage(mod, 0, 1, dev)
    tsched = tpp.Schedule1F1B(tstage, n_microbatches=m, loss_fn=_loss)
    batch = torch.cat(mbs)
    theirs: list[float] = []
    out: list[torch.Tensor] = []
    for _ in range(repeats):
        out = []
        sync()
        t = time.perf_counter()
        tsched.step(batch, target=batch, losses=out)
        sync()
        theirs.append(time.perf_counter() - t)
        mod.zero_grad(set_to_none=True)
    l_torch = {i: float(x.detach()) for i, x in enumerate(out)}

    t_ours, t_torch = statistics.median(ours[1:]), statistics.median(theirs[1:])
    tasks = 2 * m
    return {
        "device": str(dev),
        "microbatches": m,
        "compute_ms": base * 1e3,
        "ours_ms": t_ours * 1e3,
        "torch_ms": t_torch * 1e3,
        "idle_ours_us": max(0.0, t_ours - base) / tasks * 1e6,
        "idle_torch_us": max(0.0, t_torch - base) / tasks * 1e6,
        "handoffs_per_task": hops[0] / max(hops[1], 1),
        "losses_agree": len(l_ours) == m
        and all(abs(l_ours[i] - l_torch[i]) <= 1e-4 * max(1.0, abs(l_torch[i])) for i in l_ours),
    }


def _task_rank(rank: int, world: int, kwargs: dict[str, Any]) -> Row:
    return task_overhead(**kwargs)


def task_overhead_isolated(timeout: float = 180.0, **kwargs: Any) -> list[Row]:
    """:func:`task_overhead` in a fresh 1-rank process (one torch thread, like a rank)."""
    from rrfp_async.distributed import spawn

    return [spawn(_task_rank, 1, kwargs, timeout=timeout)[0]]
