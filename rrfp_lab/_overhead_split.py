"""``bench overhead``, I + W vs B: the compute of a split backward against a full one, on a
middle stage of the example model through ``TorchStageExecutor`` tasks (real CPU compute, no
emulated time).
"""

from __future__ import annotations

import time
from typing import Any

from ._overhead_common import Row, median_of

__all__ = ["SPLIT_TARGET_RATIO", "split_backward_cost", "split_backward_cost_isolated"]

SPLIT_TARGET_RATIO = 1.1
"""Target: I + W compute at most this times B compute."""


def split_backward_cost(
    *,
    microbatches: int = 8,
    repeats: int = 5,
    stages: int = 4,
    stage: int | None = None,
    seed: int = 0,
) -> list[Row]:
    """``I`` + ``W`` compute against ``B`` compute on one stage of the example model.

    Runs in this process (call :func:`split_backward_cost_isolated` for a fresh process with
    one torch thread). Builds the model split into ``stages`` virtual stages, takes stage
    ``stage`` (default ``stages // 2``, a middle one), and for each of ``microbatches``
    real image-text microbatches runs, through ``TorchStageExecutor.execute``: ``F`` then
    ``B`` on an executor of a plain plan, and ``F`` then ``I`` then ``W`` on an executor of a
    ``split_backward=True`` plan (same modules, same inputs: the previous stages' real
    activations, a fixed random output gradient). Real CPU compute, no emulated time.

    Compute per task is the CPU time of the executor's compute thread across the task
    (``time.thread_time`` read on that thread before and after: immune to other processes
    taking the core); ``*_clock`` is the executor's own ``compute_seconds`` (wall clock on
    the compute thread), ``*_wall`` the await of ``execute`` (hand-off to the thread
    included).

    With ``_split_measure.measure_split_backward`` (the executor's own measurement:
    the task handlers called directly, CPU clock), it runs too with the same arguments and
    its ratio is the headline (``source``); the figures above stay as ``ratio_tasks``.

    Returns:
        One row ``{stage, stages, microbatches, tokens, f_ms, b_ms, i_ms, w_ms, iw_ms,
        ratio, source, ratio_tasks, [helper_ratio, helper_ratio_wall, split_mode],
        b_clock_ms, iw_clock_ms, ratio_clock, b_wall_ms, iw_wall_ms, ratio_wall,
        target_ratio, met}``: ms per step (sum over the microbatches), median of
        ``repeats``; ``ratio_tasks``: median over rounds of the round's I + W / B (CPU time
        of the executor tasks).
    """

    from rrfp_async import StepPlan, Task, Topology
    from rrfp_async.distributed import TorchStageExecutor
    from rrfp_async.loop import TaskContext
    from rrfp_lab.models.image_text import (
        ImageTextConfig,
        build_stage_modules,
        loss_fn,
        make_microbatches,
    )

    from ._split_measure import stage_inputs

    v = stages // 2 if stage is None else stage
    if not 0 <= v < stages:
        raise ValueError(f"stage {v} is outside 0..{stages - 1}")
    cfg = ImageTextConfig()
    modules = build_stage_modules(cfg, stages, list(range(stages)), None)
    mbs = make_microbatches(microbatches, cfg, seed=seed)
    inputs, grads = stage_inputs(modules, mbs, v, seed=seed)
    top = Topology(stages=stages)
    plain = StepPlan(topology=top, microbatches=microbatches)
    split = StepPlan(topology=top, microbatches=microbatches, split_backward=True)
    mod = {v: modules[v]}
    ex_b = TorchStageExecutor(mod, loss_fn, rank=0)
    ex_s = TorchStageExecutor(mod, loss_fn, rank=0)
    params = list(modules[v].parameters())

    async def timed(
        ex: TorchStageExecutor, task: Task, data: Any, ctx: Any
    ) -> tuple[float, float, float]:
        """(CPU s of the compute thread, executor's compute_seconds, wall s of the await)."""
        c0 = ex.compute_seconds
        cpu0 = await ex.worker.run(time.thread_time)  # the worker is one thread
        t0 = time.perf_counter()
        await ex.execute(task, data, ctx)
        wall = time.perf_counter() - t0
        cpu1 = await ex.worker.run(time.thread_time)
        return cpu1 - cpu0, ex.compute_seconds - c0, wall

    keys = ("f", "b", "i", "w", "iw", "b_clock", "iw_clock", "b_wall", "iw_wall")

    async def main() -> dict[str, list[float]]:
        acc: dict[str, list[float]] = {k: [] for k in keys}
        for rep in range(repeats + 1):  # the first round warms up
            ctx_b = TaskContext(0, rep, plain, mbs)
            ctx_s = TaskContext(0, rep, split, mbs)
            tot = dict.fromkeys(keys, 0.0)
            for m in range(microbatches):
                f, _, _ = await timed(ex_b, Task(v, "F", m), inputs[m], ctx_b)
                b, bc, bw = await timed(ex_b, Task(v, "B", m), grads[m], ctx_b)
                await timed(ex_s, Task(v, "F", m), inputs[m], ctx_s)
                i, ic, iw1 = await timed(ex_s, Task(v, "I", m), grads[m], ctx_s)
                w, wc, iw2 = await timed(ex_s, Task(v, "W", m), None, ctx_s)
                for key, val in (
                    ("f", f),
                    ("b", b),
                    ("i", i),
                    ("w", w),
                    ("iw", i + w),
                    ("b_clock", bc),
                    ("iw_clock", ic + wc),
                    ("b_wall", bw),
                    ("iw_wall", iw1 + iw2),
                ):
                    tot[key] += val
            for p in params:
                p.grad = None
            if rep:
                for key in acc:
                    acc[key].append(tot[key])
        return acc

    from rrfp_async.loop import run

    try:
        acc = run(main())
    finally:
        ex_b.close()
        ex_s.close()
    med = {k: 1e3 * median_of(vals) for k, vals in acc.items()}

    # Paired within each round (B and I + W interleaved microbatch by microbatch), then the
    # median over rounds: a noisy round moves both sides of its own ratio.
    def paired(num: str, den: str) -> float:
        return median_of(x / y for x, y in zip(acc[num], acc[den], strict=True))

    ratio_tasks = paired("iw", "b")
    ratio, source, helper = (
        ratio_tasks,
        "executor tasks",
        _split_helper(
            stages=stages, stage=v, microbatches=microbatches, repeats=repeats, seed=seed
        ),
    )
    if "helper_ratio" in helper:
        ratio, source = helper["helper_ratio"], "measure_split_backward"
    return [
        {
            "stage": v,
            "stages": stages,
            "microbatches": microbatches,
            "tokens": sum(mb.tokens for mb in mbs),
            "f_ms": med["f"],
            "b_ms": med["b"],
            "i_ms": med["i"],
            "w_ms": med["w"],
            "iw_ms": med["iw"],
            "ratio": ratio,
            "source": source,
            "ratio_tasks": ratio_tasks,
            **helper,
            "b_clock_ms": med["b_clock"],
            "iw_clock_ms": med["iw_clock"],
            "ratio_clock": paired("iw_clock", "b_clock"),
            "b_wall_ms": med["b_wall"],
            "iw_wall_ms": med["iw_wall"],
            "ratio_wall": paired("iw_wall", "b_wall"),
            "target_ratio": SPLIT_TARGET_RATIO,
            "met": ratio <= SPLIT_TARGET_RATIO,
        }
    ]


def _split_helper(**kwargs: Any) -> dict[str, Any]:
    """``measure_split_backward``'s figures (CPU-time ratio, and whether the graph split or
    the recompute fallback ran)."""
    from ._split_measure import measure_split_backward

    h = measure_split_backward(**kwargs, threads=None)
    return {
        "helper_ratio": float(h["ratio_cpu"]),
        "helper_ratio_wall": float(h["ratio"]),
        "split_mode": "recompute fallback" if h["split"] == 0.0 else "graph split",
    }


def _split_rank(rank: int, world: int, kwargs: dict[str, Any]) -> list[Row]:
    return split_backward_cost(**kwargs)


def split_backward_cost_isolated(timeout: float = 180.0, **kwargs: Any) -> list[Row]:
    """:func:`split_backward_cost` in a fresh process with one torch thread (like the
    pipeline ranks), so the CLI process's thread pool and heap do not bias it."""
    from rrfp_async.distributed import spawn

    return spawn(_split_rank, 1, kwargs, timeout=timeout)[0]
