"""``rrfp-async bench deepspeed``: side by side with DeepSpeed's own ``PipelineEngine``."""

from __future__ import annotations

import json

import click

from rrfp_async.cli import console, stages_option, steps_option

from ._emulated_options import emulated_work_options

__all__ = ["bench_deepspeed"]


@click.command("deepspeed")
@stages_option(4, minimum=2)
@click.option("--microbatches", type=click.IntRange(min=1), default=8, show_default=True)
@steps_option(6)
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True)
@emulated_work_options(us_per_token=40.0, per="a stage", together="one after the other")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_deepspeed(
    stages: int,
    microbatches: int,
    steps: int,
    warmup: int,
    us_per_token: float,
    hidden: int,
    jitter: float,
    seed: int,
    workloads: tuple[str, ...],
    as_json: bool,
) -> None:
    """rrfp_async.deepspeed vs DeepSpeed's own PipelineEngine (its 1F1B TrainSchedule).

    Real processes on gloo (127.0.0.1), the same PipelineModule, data and optimizer steps
    for each engine, engines interleaved step by step; GPU time is EMULATED (real CPU torch
    compute plus a declared sleep per token, on the thread that computes). Prints each
    engine's median step time, its paired speedup over DeepSpeed's (median over steps) and
    its peak activation bytes (the saved-tensor meter inside the stage modules, alike for
    all), and whether the losses agree. Needs DeepSpeed (the compat environment has it).
    """
    from rrfp_lab._deepspeed_bench import DeepSpeedBenchConfig, deepspeed_benchmark, report

    results = []
    for wl in workloads or ("uniform", "variable"):
        cfg = DeepSpeedBenchConfig(
            stages=stages,
            microbatches=microbatches,
            steps=steps,
            warmup_steps=warmup,
            workload=wl,
            us_per_token=us_per_token,
            jitter=jitter,
            hidden=hidden,
            seed=seed,
        )
        res = deepspeed_benchmark(cfg)
        results.append(res)
        if not as_json:
            console().print(report(res), highlight=False, markup=False)
            console().print()
    if as_json:
        click.echo(json.dumps(results))
