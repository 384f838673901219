"""Benchmarks that print ratios measured side by side in one run (not timed tests)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from rrfp_async import PlanError
from rrfp_async.observability import LogFormat, paired_ratio
from rrfp_async.sim import simulate

__all__ = [
    "logging_overhead",
    "pipeline_step_times",
    "simulator_policy_table",
    "simulator_scaling",
    "simulator_wall_time",
]

SCALING_SIZES: tuple[tuple[int, int], ...] = ((16, 128), (32, 256), (64, 512), (128, 1024))
"""The (stages, microbatches) of ``simulator_scaling``: 4,096 to 262,144 tasks."""


def _timed_steps(
    stages: int, microbatches: int, repeats: int, workload: str, jitter: float, policy: str
) -> tuple[list[float], int]:
    """Wall seconds of ``repeats`` simulated steps (seeds 0, 1, ...) and the tasks of one."""
    walls = []
    tasks = 0
    for seed in range(repeats):
        # Each step starts from the same heap: the previous result is dropped and collected
        # first (outside the timing). Kept alive, a 128 x 1024 result (~350 MB) made the next
        # step's collector passes scan it too, charging one step for another's objects.
        gc.collect()
        t = time.perf_counter()
        res = simulate(
            stages=stages,
            microbatches=microbatches,
            workload=workload,
            jitter=jitter,
            policy=policy,
            seed=seed,
        )
        walls.append(time.perf_counter() - t)
        tasks = sum(len(e) for e in res.executed)
        del res
    return walls, tasks


def simulator_wall_time(
    *,
    stages: int = 16,
    microbatches: int = 128,
    repeats: int = 5,
    workload: str = "multimodal",
    jitter: float = 0.2,
    policies: Sequence[str] = ("strict", "readiness_first", "lateness_aware", "backfill"),
) -> list[dict[str, Any]]:
    """Real seconds to simulate one step, per policy (median of ``repeats``)."""
    rows = []
    for pol in policies:
        walls, tasks = _timed_steps(stages, microbatches, repeats, workload, jitter, pol)
        med = statistics.median(walls)
        rows.append(
            {
                "policy": pol,
                "tasks": tasks,
                "wall_median_s": med,
                "wall_max_s": max(walls),
                "us_per_task": 1e6 * med / tasks,
            }
        )
    return rows


def simulator_scaling(
    *,
    sizes: Sequence[tuple[int, int]] = SCALING_SIZES,
    repeats: int = 3,
    workload: str = "multimodal",
    jitter: float = 0.2,
    policy: str = "readiness_first",
) -> list[dict[str, Any]]:
    """Real seconds and microseconds per task of one simulated step at growing sizes.

    Each size is simulated ``repeats`` times (seeds 0, 1, ...) with the default hint
    (``breadth_first_weighted``: computing it is part of the step's cost) and the median
    wall time is reported; ``growth`` is a row's microseconds per task over the first
    row's (1.0 for a simulator whose cost is linear in the tasks). The sizes run one after
    the other in this process, so their ratios are measured side by side.
    """
    rows: list[dict[str, Any]] = []
    for stages, microbatches in sizes:
        walls, tasks = _timed_steps(stages, microbatches, repeats, workload, jitter, policy)
        med = statistics.median(walls)
        us = 1e6 * med / tasks
        rows.append(
            {
                "stages": stages,
                "microbatches": microbatches,
                "tasks": tasks,
                "wall_median_s": med,
                "wall_max_s": max(walls),
                "us_per_task": us,
                "growth": us / rows[0]["us_per_task"] if rows else 1.0,
            }
        )
    return rows


def simulator_policy_table(
    *,
    stages: int = 8,
    microbatches: int = 32,
    seeds: int = 5,
    jitter: float = 0.2,
    workloads: Sequence[str] = ("text", "multimodal"),
    hints: Sequence[str] = ("1f1b", "breadth_first_weighted", "backward_first"),
    memory: Sequence[float] = (1.0, 2.0),
    policies: Sequence[str] = ("readiness_first", "lateness_aware", "backfill"),
) -> list[dict[str, Any]]:
    """Mean makespan ratio of each (hint, memory, policy) against strict 1F1B at 1x memory,
    over ``seeds`` draws of sizes and noise; also each row's own strict baseline."""
    rows = []
    for wl in workloads:
        base = {}
        for s in range(seeds):
            base[s] = simulate(
                stages=stages,
                microbatches=microbatches,
                workload=wl,
                jitter=jitter,
                seed=s,
                hint="1f1b",
                policy="strict",
            ).makespan
        for hint in hints:
            for mf in memory:
                strict = [
                    simulate(
                        stages=stages,
                        microbatches=microbatches,
                        workload=wl,
                        jitter=jitter,
                        seed=s,
                        hint=hint,
                        policy="strict",
                        memory_factor=mf,
                    ).makespan
                    for s in range(seeds)
                ]
                for pol in ("strict", *policies):
                    ms = (
                        strict
                        if pol == "strict"
                        else [
                            simulate(
                                stages=stages,
                                microbatches=microbatches,
                                workload=wl,
                                jitter=jitter,
                                seed=s,
                                hint=hint,
                                policy=pol,
                                memory_factor=mf,
                            ).makespan
                            for s in range(seeds)
                        ]
                    )
                    rows.append(
                        {
                            "workload": wl,
                            "hint": hint,
                            "memory": mf,
                            "policy": pol,
                            "vs_1f1b_strict": statistics.mean(
                                base[s] / m for s, m in enumerate(ms)
                            ),
                            "vs_same_hint_strict": statistics.mean(
                                a / m for a, m in zip(strict, ms, strict=True)
                            ),
                        }
                    )
    return rows


def pipeline_step_times(
    *,
    stages: int = 4,
    microbatches: int = 16,
    steps: int = 6,
    warmup_steps: int = 1,
    policies: Sequence[str] = ("strict", "readiness_first"),
    hint: str = "breadth_first_weighted",
    memory_factor: float | None = None,
    memory_budget: float | int | str | None = None,
    jitter: float = 0.3,
    tp: int = 1,
    seed: int = 0,
    timeout: float = 600.0,
    trace_step: int | None = None,
    on_progress: Callable[[Any], None] | None = None,
    log_format: LogFormat | None = None,
    log_level: str = "info",
    measure_activations: bool = False,
) -> dict[str, Any]:
    """Step times of a real multi-process pipeline (gloo, 127.0.0.1), per policy, in one run.

    Trains the example image-text model with the multimodal emulated-GPU cost (real CPU
    compute of a tiny model plus sleeps from the declared cost model) on ``stages * tp``
    processes. Every policy meets the same microbatches and the same emulated noise. A
    step's time is the slowest rank's time from a common barrier to its last task.

    Args:
        trace_step: Record this step (counting warm-up) and return its merged trace per
            policy under ``"trace"``.
        on_progress: Called with ``(policy, step)`` after each step (from rank 0).
        log_format: Configure step-traced logs in the workers.
        log_level: Their level.
        measure_activations: Measure each forward's activation bytes (saved-tensor hooks;
            every policy pays the meter alike) and report ``measured_ratio``.
        (the others: see ``TrainConfig``)

    Returns:
        ``{"config": TrainConfig, "wall_s": float, "policies": {policy: {...}}}``; per
        policy: ``step_s`` (each timed step), ``median_s``, ``mean_s``, ``vs_first`` (the
        ``PairedRatio`` of the first policy's step ``i`` over this one's: its speedup over
        the first policy, step by step, ``same_order`` when neither deviated from the
        hint), ``deviations`` (total over the timed steps and all ranks),
        ``peak_inflight`` (largest of any rank and timed step), ``memory_ratio`` (the
        largest, over ranks and timed steps, of the peak activation bytes over what strict
        1F1B holds on that step's microbatches; declared bytes: tokens), ``measured_ratio``
        (with ``measure_activations``: the largest, over ranks and timed steps, of the
        measured peak activation bytes over the first policy's on the same rank and step),
        ``compute_s`` and
        ``emulated_s`` (all ranks, all steps) and ``trace`` (the traced step, merged).
    """
    twice = sorted({p for p in policies if list(policies).count(p) > 1})
    if twice:
        raise PlanError(
            f"policy {', '.join(map(repr, twice))} named twice: the figures are per policy"
            " name. For a null test (a policy against itself), run examples/"
            "train_image_text.py --policy strict --policy strict"
        )
    from rrfp_async.distributed import spawn
    from rrfp_async.observability import TraceData

    from ._demo_train import TrainConfig, image_text_cost, train_worker

    cfg = TrainConfig(
        pp=stages,
        tp=tp,
        microbatches=microbatches,
        steps=steps,
        warmup_steps=warmup_steps,
        policies=tuple(policies),
        hint=hint,
        memory_factor=memory_factor,
        memory_budget=memory_budget,
        cost=image_text_cost(jitter=jitter),
        seed=seed,
        return_params=False,
        trace_steps=() if trace_step is None else (trace_step,),
        progress=on_progress is not None,
        log_format=log_format,
        log_level=log_level,
        measure_activations=measure_activations,
    )
    t = time.perf_counter()
    results = spawn(train_worker, stages * tp, cfg, timeout=timeout, on_progress=on_progress)
    wall = time.perf_counter() - t
    out: dict[str, Any] = {"config": cfg, "wall_s": wall, "policies": {}}
    first: tuple[list[float], int, str] | None = None
    base_bytes = [r[0].measured_peak_bytes for r in results]
    for i, pol in enumerate(policies):
        hint_of = pol.partition("@")[2] or hint
        per_rank = [r[i] for r in results]
        step = [max(r.step_times[s] for r in per_rank) for s in range(steps)]
        traces = [r.trace for r in per_rank if r.trace is not None]
        deviations = sum(s.deviations for r in per_rank for s in r.stats)
        if first is None:
            first = (step, deviations, hint_of)
        out["policies"][pol] = {
            "step_s": step,
            "median_s": statistics.median(step),
            "mean_s": statistics.mean(step),
            # Step i of every policy ran the same microbatches and emulated noise: compare
            # them step by step. Both ran the hint's order in every step (no deviation):
            # the same order, so the ratio is noise.
            "vs_first": paired_ratio(
                first[0], step, same_order=first[1] == deviations == 0 and first[2] == hint_of
            ),
            "deviations": deviations,
            "peak_inflight": max(s.peak_inflight for r in per_rank for s in r.stats),
            "memory_ratio": max(
                (
                    s.peak_bytes / s.reference_bytes
                    for r in per_rank
                    for s in r.stats
                    if s.peak_bytes is not None and s.reference_bytes
                ),
                default=None,
            ),
            "measured_ratio": max(
                (
                    mine / theirs
                    for r, base in zip(per_rank, base_bytes, strict=True)
                    for mine, theirs in zip(r.measured_peak_bytes, base, strict=True)
                    if theirs
                ),
                default=None,
            ),
            "compute_s": sum(r.compute_seconds for r in per_rank),
            "emulated_s": sum(r.emulated_seconds for r in per_rank),
            "trace": TraceData.merge(traces) if traces else None,
        }
    return out


def logging_overhead(
    *, stages: int = 16, microbatches: int = 128, repeats: int = 9
) -> list[dict[str, Any]]:
    """Wall time of a simulated step without any observer, with a ``LogObserver`` while
    logging is disabled (level warning), and with every transition logged as JSON to a null
    stream; runs interleaved, medians compared in one run."""
    import io
    import os

    from rrfp_async.observability import LogObserver, configure_logging

    devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below
    variants = {
        "no observer": (None, "warning"),
        "LogObserver, logging disabled": (LogObserver, "warning"),
        "LogObserver, debug JSON to /dev/null": (LogObserver, "debug"),
    }
    walls: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for i in range(repeats):
            for name, (obs_cls, level) in variants.items():
                configure_logging(format="json", level=level, stream=devnull)
                obs = obs_cls() if obs_cls is not None else None
                t = time.perf_counter()
                simulate(
                    stages=stages,
                    microbatches=microbatches,
                    workload="multimodal",
                    jitter=0.2,
                    seed=i,
                    observer=obs,
                )
                walls[name].append(time.perf_counter() - t)
    finally:
        configure_logging(format="console", level="warning", stream=io.StringIO())
        devnull.close()
    base = statistics.median(walls["no observer"])
    return [
        {
            "variant": k,
            "median_s": statistics.median(v),
            "overhead": statistics.median(v) / base - 1.0,
        }
        for k, v in walls.items()
    ]
