"""Benchmarks that print ratios measured side by side in one run (not timed tests)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from ._simulate import simulate

__all__ = ["simulator_policy_table", "simulator_wall_time"]


def simulator_wall_time(
    *,
    stages: int = 16,
    microbatches: int = 128,
    repeats: int = 5,
    workload: str = "multimodal",
    jitter: float = 0.2,
    policies: Sequence[str] = ("strict", "readiness_first", "backfill", "greedy"),
) -> list[dict[str, Any]]:
    """Real seconds to simulate one step, per policy (median of ``repeats``)."""
    rows = []
    for pol in policies:
        walls = []
        res = None
        for i in range(repeats):
            t = time.perf_counter()
            res = simulate(
                stages=stages,
                microbatches=microbatches,
                workload=workload,
                jitter=jitter,
                policy=pol,
                seed=i,
            )
            walls.append(time.perf_counter() - t)
        assert res is not None
        tasks = sum(len(e) for e in res.executed)
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


def simulator_policy_table(
    *,
    stages: int = 8,
    microbatches: int = 32,
    seeds: int = 5,
    jitter: float = 0.2,
    workloads: Sequence[str] = ("text", "multimodal"),
    hints: Sequence[str] = ("1f1b", "breadth_first_weighted", "backward_first"),
    memory: Sequence[float] = (1.0, 2.0),
    policies: Sequence[str] = ("readiness_first", "backfill", "greedy"),
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
