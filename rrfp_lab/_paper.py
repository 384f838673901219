"""Paper scale, in simulation: every hint/policy against strict 1F1B, next to the RRFP
preprint's 1.77x (language-only) and 2.77x (multimodal).

Virtual time with a declared GPU cost model (``_costs``), not a measurement of any GPU.

* **GPUs** are PP x TP. TP enters the grid only as a cost scaling: every stage's compute is
  divided by TP (ideal tensor parallelism, no TP all-reduce cost), while a cross-stage
  message keeps its latency. Since every compute time scales alike, TP changes the ratios
  only through the share of message latency in a task's time. ``coordination_rows`` then
  prices the TP *coordination* (each TP group's followers wait for the leader's decisions,
  ``simulate(tp=...)``, latency from the fitted model of ``bench overhead --section tp``):
  the makespan with it against the makespan that assumes it free.
* **Model partition.** Text: every virtual stage is an LLM stage. Multimodal: virtual stage
  0 is the vision encoder (costed by image patches), the others LLM stages (costed by all
  tokens). With V = 2 chunks (interleaved 1F1B) each LLM chunk is half an LLM stage and, for
  multimodal, rank 0's second chunk (virtual stage P) is an empty pass-through, so every
  rank holds the same work as with V = 1: the same model, only cut finer.
* **Variability** (``NOISE``): mean-one lognormal compute jitter, stragglers (a task takes
  ``straggler_factor`` x longer with ``straggler_prob``) and a lognormal message latency,
  drawn per task from the seed, identical for every configuration of a seed (a split
  backward's ``I`` and ``W`` get their own draws).
* **Ratio** of a configuration = strict 1F1B's makespan (V = 1, the 1F1B admission bound,
  the loader's microbatch order, full backward) / the configuration's makespan, averaged
  over seeds. **Efficiency** = lower bound / makespan (``simulate.lower_bound``). Strict
  1F1B's makespan is its lower bound / its efficiency, so no schedule of the same plan can
  beat it by more than ``1 / efficiency(strict 1F1B)``, the *ceiling*; a split backward or
  finer chunks change the plan and its lower bound, but only a little.
* **Clairvoyant** rows are no policy the runtime can run: the ``bfw`` list schedule (split
  backward) computed on the *realized* durations, i.e. with perfect foresight of every
  jitter and straggler, at 2x or unbounded memory. They show roughly what a dispatch rule
  could still gain with perfect information; a greedy list schedule is no optimum, so a
  runtime configuration may beat them.
* **Lockstep predictor** (``lockstep_ceiling``): the ceiling predicted from the size
  distribution alone, ``E[max of P microbatch costs] / E[cost]``.

This module costs and simulates; the scenarios and configurations it runs are in
``_paper_scenarios``, the tables it prints in ``_paper_report`` (both
re-exported here for the command).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rrfp_async import CostModel, Microbatch, StageProfile, StepPlan, Topology, make_workload
from rrfp_async._costs import LLM_STAGE, VISION_STAGE
from rrfp_async._workloads import PAPER_IMAGE_TOKENS, multimodal_paper_sizes
from rrfp_async.policies import default_bound, list_schedule, remaining_work, strict_timeline
from rrfp_async.sim import lower_bound, simulate

from ._paper_report import TextTable, best_rows, coordination_table, report_tables, to_markdown
from ._paper_scenarios import (
    BASELINE,
    CLAIRVOYANT,
    NOISE,
    PAPER_FIGURES,
    Config,
    Noise,
    Scenario,
    condition_configs,
    condition_scenarios,
    default_configs,
    default_scenarios,
)

__all__ = [
    "BASELINE",
    "CLAIRVOYANT",
    "NOISE",
    "PAPER_FIGURES",
    "TP_CONFIGS",
    "Config",
    "Noise",
    "Scenario",
    "TextTable",
    "best_rows",
    "condition_configs",
    "condition_scenarios",
    "coordination_rows",
    "coordination_table",
    "default_configs",
    "default_scenarios",
    "lockstep_ceiling",
    "paper_cost",
    "paper_microbatches",
    "paper_table",
    "report_tables",
    "run_scenario",
    "simulate_config",
    "to_markdown",
]


def _scaled(p: StageProfile, k: float) -> StageProfile:
    return StageProfile(
        per_token=p.per_token * k,
        per_patch=p.per_patch * k,
        per_token_sq=p.per_token_sq * k,
        fixed=p.fixed * k,
    )


def paper_cost(sc: Scenario, chunks: int = 1) -> CostModel:
    """The declared cost model of ``sc`` cut into ``chunks`` chunks per rank (compute / TP,
    the same work per rank for every V; see the module docstring), with its noise."""
    vision = _scaled(VISION_STAGE, sc.vision_scale)
    profiles: list[StageProfile] = []
    for v in range(sc.pp * chunks):
        if sc.multimodal and v == 0:
            profiles.append(_scaled(vision, 1.0 / sc.tp))
        elif sc.multimodal and chunks > 1 and v % sc.pp == 0:
            profiles.append(StageProfile())  # rank 0's later chunk: a pass-through
        else:
            profiles.append(_scaled(LLM_STAGE, 1.0 / (sc.tp * chunks)))
    n = sc.noise
    return CostModel(
        profiles=tuple(profiles),
        jitter=n.jitter,
        straggler_prob=n.straggler_prob,
        straggler_factor=n.straggler_factor,
        latency=n.latency,
        latency_jitter=n.latency_jitter,
    )


def _text_sizes(n: int, rng: random.Random, sigma: float) -> list[Microbatch]:
    # The "text" workload's lognormal (median 900 tokens) with another sigma, clipped to
    # 64-16384 tokens (the built-in one clips at 4096).
    return [
        Microbatch(
            index=i, tokens=int(min(16384, max(64, rng.lognormvariate(math.log(900), sigma))))
        )
        for i in range(n)
    ]


def paper_microbatches(sc: Scenario, seed: int, order: str = "loader") -> list[Microbatch]:
    """The microbatches of ``sc`` for ``seed``, in the loader's order or sorted by
    ascending declared cost (summed over the V = 1 stages), re-indexed 0..M-1."""
    m = sc.microbatches
    if sc.workload == "multimodal_paper" and (
        sc.image_tokens != PAPER_IMAGE_TOKENS or sc.text_sigma is not None
    ):
        mbs = multimodal_paper_sizes(
            m,
            random.Random(seed),
            image_tokens=sc.image_tokens,
            text_sigma=0.7 if sc.text_sigma is None else sc.text_sigma,
        )
    elif sc.workload == "text" and sc.text_sigma is not None:
        mbs = _text_sizes(m, random.Random(seed), sc.text_sigma)
    else:
        mbs = list(make_workload(sc.workload, m, virtual_stages=sc.pp, seed=seed).microbatches)
    if order == "sorted":
        cost = paper_cost(sc)
        mbs.sort(key=lambda mb: sum(cost.forward(v, mb) for v in range(sc.pp)))
    elif order != "loader":
        raise ValueError(f"unknown microbatch order {order!r}")
    return [
        Microbatch(index=i, tokens=mb.tokens, patches=mb.patches, images=mb.images)
        for i, mb in enumerate(mbs)
    ]


def _clairvoyant(sc: Scenario, cfg: Config, seed: int) -> tuple[float, float]:
    plan = StepPlan(
        topology=Topology(stages=sc.pp, chunks=cfg.chunks),
        microbatches=sc.microbatches,
        split_backward=cfg.split,
    )
    real = paper_cost(sc, cfg.chunks).realize(plan, paper_microbatches(sc, seed), seed=seed)
    work = remaining_work(plan, real)
    cap = sc.microbatches * cfg.chunks
    bounds = [
        cap if math.isinf(cfg.memory) else min(cap, int(cfg.memory * default_bound(plan, r)))
        for r in range(sc.pp)
    ]
    order = list_schedule(plan, real, key=lambda t: (-work[t], t.mb, t.stage), bounds=bounds)
    times = strict_timeline(plan, order, real)
    return max(end for _, end in times.values()), lower_bound(plan, real)


def simulate_config(
    sc: Scenario,
    cfg: Config,
    seed: int,
    *,
    coordinated: bool = False,
    tp_latency: float | None = None,
    tp_check: float | None = None,
) -> tuple[float, float]:
    """``(makespan, lower bound)`` of one configuration of ``sc`` for ``seed``; with
    ``coordinated``, the TP groups pay their coordination (``simulate(tp=sc.tp,
    tp_latency=..., tp_check=...)``, None: the fitted model)."""
    if cfg.policy == CLAIRVOYANT:
        return _clairvoyant(sc, cfg, seed)
    tp: dict[str, Any] = {}
    if coordinated:
        tp = {"tp": sc.tp, "tp_latency": tp_latency, "tp_check": tp_check}
    n = sc.noise
    r = simulate(
        stages=sc.pp,
        microbatches=paper_microbatches(sc, seed, cfg.order),
        chunks=cfg.chunks,
        hint=cfg.hint,
        policy=cfg.policy,
        memory_factor=None if cfg.memory == 1.0 else cfg.memory,
        split_backward=cfg.split,
        cost_model=paper_cost(sc, cfg.chunks),
        jitter=n.jitter,
        straggler_prob=n.straggler_prob,
        latency=n.latency,
        latency_jitter=n.latency_jitter,
        seed=seed,
        **tp,
    )
    return r.makespan, r.lower_bound


def lockstep_ceiling(sc: Scenario, *, samples: int = 8192, seed: int = 12345) -> float:
    """A rough predictor of the ceiling from the size distribution alone.

    In 1F1B's steady state every rank holds a different microbatch and no rank may run
    ahead (one forward, one backward, in a fixed order), so each "beat" of the pipeline
    lasts about as long as the costliest of the P microbatches in flight; a schedule free
    of that lockstep needs about the mean. The predictor is ``E[max of P consecutive
    microbatches' cost] / E[cost]``, a microbatch's cost being its mean over the ranks (V =
    1), from ``samples`` fresh microbatches. It ignores noise, fill and drain and the
    critical path, so it overshoots at small M / P and for very heavy tails, and it does
    not apply when one stage is the bottleneck.
    """
    draw = replace(sc, microbatches=samples)
    cost = paper_cost(sc)
    c = [
        sum(cost.forward(v, mb) for v in range(sc.pp)) / sc.pp
        for mb in paper_microbatches(draw, seed)
    ]
    p = sc.pp
    peaks = [max(c[i : i + p]) for i in range(0, samples - p + 1, p)]
    return statistics.mean(peaks) / statistics.mean(c)


def _scenario_fields(sc: Scenario) -> dict[str, Any]:
    """The columns that say which scenario a row is about (every table's rows start so)."""
    return {
        "scenario": sc.label or f"PP{sc.pp} x M{sc.microbatches}",
        "pp": sc.pp,
        "tp": sc.tp,
        "gpus": sc.gpus,
        "microbatches": sc.microbatches,
        "workload": sc.workload,
        "noise": sc.noise.name,
    }


def run_scenario(
    sc: Scenario, configs: Sequence[Config], *, seeds: int = 2, seed0: int = 0
) -> list[dict[str, Any]]:
    """One row per configuration: mean ratio vs strict 1F1B (and its range over seeds),
    mean efficiency, and the scenario's strict-1F1B efficiency and ceiling."""
    configs = list(configs)
    if BASELINE not in configs:
        configs.insert(0, BASELINE)
    ms: dict[Config, list[float]] = {c: [] for c in configs}
    lb: dict[Config, list[float]] = {c: [] for c in configs}
    for s in range(seed0, seed0 + seeds):
        for c in configs:
            m, b = simulate_config(sc, c, s)
            ms[c].append(m)
            lb[c].append(b)
    base = ms[BASELINE]
    eff_strict = statistics.mean(b / m for b, m in zip(lb[BASELINE], base, strict=True))
    ceiling = statistics.mean(m / b for b, m in zip(lb[BASELINE], base, strict=True))
    lockstep = lockstep_ceiling(sc)
    rows = []
    for c in configs:
        ratios = [a / m for a, m in zip(base, ms[c], strict=True)]
        rows.append(
            {
                **_scenario_fields(sc),
                "schedule": c.schedule,
                "hint": c.hint,
                "chunks": c.chunks,
                "split": c.split,
                "order": c.order,
                "policy": c.policy,
                "memory": None if math.isinf(c.memory) else c.memory,
                "ratio": statistics.mean(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "efficiency": statistics.mean(b / m for b, m in zip(lb[c], ms[c], strict=True)),
                "makespan": statistics.mean(ms[c]),
                "strict_1f1b_efficiency": eff_strict,
                "ceiling": ceiling,
                "lockstep": lockstep,
                "seeds": seeds,
            }
        )
    return rows


def paper_table(
    *,
    full: bool = False,
    seeds: int = 2,
    scenarios: Sequence[Scenario] | None = None,
    configs: Sequence[Config] | None = None,
    on_scenario: Callable[[Scenario, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``run_scenario`` for every scenario (``default_scenarios(full=full)`` unless
    given) and configuration (``default_configs()`` unless given)."""
    scs = default_scenarios(full=full) if scenarios is None else list(scenarios)
    cfgs = default_configs() if configs is None else list(configs)
    rows: list[dict[str, Any]] = []
    for sc in scs:
        t = time.perf_counter()
        rows += run_scenario(sc, cfgs, seeds=seeds)
        if on_scenario is not None:
            on_scenario(sc, time.perf_counter() - t)
    return rows


TP_CONFIGS = (BASELINE, Config(hint="bfw", policy="readiness_first", memory=2.0, split=True))
"""The configurations ``coordination_rows`` prices: strict 1F1B and the strongest runtime
combination of the grid."""


def coordination_rows(
    scenarios: Sequence[Scenario],
    configs: Sequence[Config] = TP_CONFIGS,
    *,
    seeds: int = 2,
    tp_latency: float | None = None,
    tp_check: float | None = None,
) -> list[dict[str, Any]]:
    """What TP coordination costs at paper scale: per scenario and configuration, the mean
    makespan with every TP group's coordination simulated (``simulate(tp=sc.tp)``, the
    fitted latency unless ``tp_latency`` is given) against the same seeds with it free,
    and the ratio vs strict 1F1B both ways (strict 1F1B coordinated as well)."""
    from rrfp_async.sim import TP_DECISION_LATENCY, TP_STEP_CHECK

    rows = []
    for sc in scenarios:
        lat = TP_DECISION_LATENCY(sc.tp) if tp_latency is None else tp_latency
        chk = TP_STEP_CHECK(sc.tp) if tp_check is None else tp_check
        free: dict[Config, list[float]] = {}
        coord: dict[Config, list[float]] = {}
        for c in configs:
            for s in range(seeds):
                free.setdefault(c, []).append(simulate_config(sc, c, s)[0])
                coord.setdefault(c, []).append(
                    simulate_config(sc, c, s, coordinated=True, tp_latency=lat, tp_check=chk)[0]
                )
        base = configs[0]
        for c in configs:
            rows.append(
                {
                    **_scenario_fields(sc),
                    "schedule": c.schedule,
                    "policy": c.policy,
                    "memory": None if math.isinf(c.memory) else c.memory,
                    "tp_latency": lat,
                    "tp_check": chk,
                    "makespan_free": statistics.mean(free[c]),
                    "makespan_tp": statistics.mean(coord[c]),
                    "cost": statistics.mean(
                        t / f - 1 for t, f in zip(coord[c], free[c], strict=True)
                    ),
                    "ratio_free": statistics.mean(
                        b / m for b, m in zip(free[base], free[c], strict=True)
                    ),
                    "ratio_tp": statistics.mean(
                        b / m for b, m in zip(coord[base], coord[c], strict=True)
                    ),
                    "seeds": seeds,
                }
            )
    return rows
