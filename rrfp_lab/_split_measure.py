"""``measure_split_backward``: the compute time of ``B`` against ``I`` + ``W`` on one stage
of the example model (``rrfp-async bench overhead --section split``), and the stage inputs
such a measurement feeds. Lab code: it drives the executor's task handlers directly, on
this thread, with no pipeline around them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rrfp_async import PlanError, StepPlan, Task
from rrfp_async.distributed import TorchStageExecutor

__all__ = ["measure_split_backward", "stage_inputs"]


def stage_inputs(
    modules: Mapping[int, nn.Module], microbatches: Sequence[Any], stage: int, *, seed: int = 0
) -> tuple[list[Any], list[torch.Tensor | None]]:
    """Inputs of virtual stage ``stage`` (the earlier stages run on each microbatch's
    ``data``, no grad) and a small seeded random gradient of its output (None on the last
    stage, whose backward starts from the loss): what a stage-level measurement feeds F and
    B."""
    g = torch.Generator().manual_seed(seed)
    inputs: list[Any] = []
    grads: list[torch.Tensor | None] = []
    last = max(modules)
    with torch.no_grad():
        for mb in microbatches:
            x: Any = mb.data
            for s in range(stage):
                x = modules[s](x)
            # As a received activation: the flag says it wants its gradient.
            inputs.append(x if stage == 0 else x.detach().requires_grad_(x.is_floating_point()))
            if stage == last:
                grads.append(None)
            else:
                out = modules[stage](x)
                grads.append(torch.randn(out.shape, generator=g, dtype=out.dtype) * 1e-2)
    return inputs, grads


def measure_split_backward(
    *,
    stages: int = 4,
    stage: int | None = None,
    microbatches: int = 8,
    repeats: int = 5,
    seed: int = 0,
    threads: int | None = 1,
    config: Any = None,
) -> dict[str, float]:
    """Compute time of ``B`` against ``I`` + ``W`` on one stage of the example model.

    A benchmark, not a test. Builds the image-text model (``config``, default
    ``ImageTextConfig()``) split into ``stages`` virtual stages, takes stage ``stage``
    (default: a middle one) and ``microbatches`` microbatches of ``make_microbatches``: the
    stage input is the previous stages' real activation, the output gradient a fixed random
    tensor (the loss on the last stage). Each round runs, microbatch by microbatch, F then B
    on one executor and F then I then W on another (same module, same inputs), calling the
    task handlers on this thread (no worker hand-off, no emulated time). The first round
    warms up.

    Args:
        stages: Virtual stages of the split.
        stage: The stage measured (default ``stages // 2``).
        microbatches: Microbatches per round.
        repeats: Timed rounds.
        seed: Data seed.
        threads: torch intra-op threads while measuring (pipeline ranks use 1); None keeps
            the current setting.
        config: An ``ImageTextConfig`` (default: the example model's).

    Returns:
        Seconds per round (sum over the microbatches), median over the rounds: ``b``, ``i``,
        ``w``, ``iw`` (I + W per round) and ``ratio`` (``iw / b``), on the wall clock; the
        same on this thread's CPU clock as ``b_cpu``, ``iw_cpu``, ``ratio_cpu`` (less
        sensitive to other processes on shared cores); and ``stage``, ``stages``,
        ``microbatches``, ``tokens``, ``split`` (1.0: the graph split, 0.0: the recompute
        fallback).
    """
    import statistics

    from rrfp_async import Topology
    from rrfp_async.loop import TaskContext
    from rrfp_lab.models.image_text import (
        ImageTextConfig,
        build_stage_modules,
        loss_fn,
        make_microbatches,
    )

    cfg = ImageTextConfig() if config is None else config
    v = stages // 2 if stage is None else stage
    if not 0 <= v < stages:
        raise PlanError(f"stage {v} is outside 0..{stages - 1}")
    if repeats < 1 or microbatches < 1:
        raise PlanError("measure_split_backward needs repeats >= 1 and microbatches >= 1")
    n_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        modules = build_stage_modules(cfg, stages, list(range(stages)))
        mbs = make_microbatches(microbatches, cfg, seed=seed)
        inputs, grads = stage_inputs(modules, mbs, v, seed=seed)
        top = Topology(stages=stages)
        plain = StepPlan(topology=top, microbatches=microbatches)
        split = StepPlan(topology=top, microbatches=microbatches, split_backward=True)
        ex_b = TorchStageExecutor({v: modules[v]}, loss_fn)
        ex_s = TorchStageExecutor({v: modules[v]}, loss_fn)
        params = list(modules[v].parameters())
        keys = ("b", "i", "w", "b_cpu", "iw_cpu")
        rounds: dict[str, list[float]] = {k: [] for k in keys}
        split_used = True
        try:
            for rep in range(repeats + 1):
                ctx_b = TaskContext(0, rep, plain, mbs)
                ctx_s = TaskContext(0, rep, split, mbs)
                tot = dict.fromkeys(keys, 0.0)
                for m in range(microbatches):
                    data = mbs[m] if v == 0 else inputs[m]
                    ex_b.task_handler("F")(Task(v, "F", m), data, ctx_b)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    ex_b.task_handler("B")(Task(v, "B", m), grads[m], ctx_b)
                    tot["b"] += time.perf_counter() - t0
                    tot["b_cpu"] += time.thread_time() - c0
                    ex_s.task_handler("F")(Task(v, "F", m), data, ctx_s)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    ex_s.task_handler("I")(Task(v, "I", m), grads[m], ctx_s)
                    t1 = time.perf_counter()
                    split_used = split_used and not ex_s.weight_recomputes(v, m)
                    ex_s.task_handler("W")(Task(v, "W", m), None, ctx_s)
                    tot["i"] += t1 - t0
                    tot["w"] += time.perf_counter() - t1
                    tot["iw_cpu"] += time.thread_time() - c0
                for p in params:
                    p.grad = None
                if rep:
                    for k in keys:
                        rounds[k].append(tot[k])
        finally:
            ex_b.close()
            ex_s.close()
    finally:
        torch.set_num_threads(n_threads)
    med = {k: statistics.median(vals) for k, vals in rounds.items()}
    iw = statistics.median(i + w for i, w in zip(rounds["i"], rounds["w"], strict=True))
    return {
        "b": med["b"],
        "i": med["i"],
        "w": med["w"],
        "iw": iw,
        "ratio": iw / med["b"],
        "b_cpu": med["b_cpu"],
        "iw_cpu": med["iw_cpu"],
        "ratio_cpu": med["iw_cpu"] / med["b_cpu"],
        "stage": float(v),
        "stages": float(stages),
        "microbatches": float(microbatches),
        "tokens": float(sum(mb.tokens for mb in mbs)),
        "split": 1.0 if split_used else 0.0,
    }
