"""``rrfp-async bench megatron``: side by side with megatron-core's own schedules."""

from __future__ import annotations

import json
from typing import Any

import click

from rrfp_async.cli import (
    console,
    json_option,
    log_options,
    memory_factor_option,
    microbatches_option,
    policy_names,
    policy_option,
    progress,
    stages_option,
    steps_option,
    table,
)

from ._emulated_options import emulated_work_options

__all__ = ["bench_megatron"]


@click.command("megatron")
@stages_option(4, minimum=2)
@microbatches_option(16)
@steps_option(5)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@emulated_work_options(us_per_token=2.0, per="a rank's model share", together="in the same run")
@policy_option("The drop-in's policy (repeatable). Default: strict and readiness_first.")
@memory_factor_option(
    help_text="The drop-in's admission bound as a multiple of megatron's order's"
    " (repeatable). Default: 1 and 2.",
    repeatable=True,
)
@click.option(
    "--no-cost-aware",
    is_flag=True,
    help="Leave out the rows with the cost-aware hint (breadth_first_weighted + each step's"
    " declared durations).",
)
@click.option(
    "--meter/--no-meter",
    default=True,
    show_default=True,
    help="Measure every row's activation bytes on every step (the saved-tensor meter, on"
    " for all rows alike); --no-meter: no bytes, and no meter's cost in any row's time.",
)
@json_option("Print {'runs': [...]} as JSON.")
@log_options
def bench_megatron(
    stages: int,
    microbatches: int,
    steps: int,
    warmup: int,
    us_per_token: float,
    hidden: int,
    jitter: float,
    seed: int,
    workloads: tuple[str, ...],
    policies: tuple[str, ...],
    memory_factors: tuple[float, ...],
    no_cost_aware: bool,
    meter: bool,
    as_json: bool,
) -> None:
    """The megatron-core drop-in vs megatron's own 1F1B and interleaved (VPP 2) schedules.

    Real processes on gloo (127.0.0.1) with megatron-core mapped to the CPU, the same model
    chunks for every configuration: real CPU compute plus EMULATED GPU time (each stage
    sleeps a declared, seeded duration per token), configurations interleaved step by step.
    Every row's peak activation bytes per rank are measured on every step by one saved-tensor
    meter (--no-meter: none). Needs megatron-core (pip install rrfp-async[megatron]).
    """
    from .. import MegatronBenchConfig

    base = MegatronBenchConfig()
    try:
        cfg = MegatronBenchConfig(
            stages=stages,
            microbatches=microbatches,
            steps=steps,
            warmup_steps=warmup,
            us_per_token=us_per_token,
            hidden=hidden,
            jitter=jitter,
            seed=seed,
            workloads=workloads or base.workloads,
            policies=tuple(policy_names(policies, list(base.policies))),
            memory_factors=memory_factors or base.memory_factors,
            cost_aware=not no_cost_aware,
            meter=meter,
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    from .. import megatron_benchmark

    total = cfg.warmup_steps + cfg.steps
    with progress(total, enabled=not as_json) as update:
        update(f"starting {cfg.stages} processes (megatron-core's import takes a while)", False)

        def on_step(s: Any) -> None:
            update(f"step {s + 1}/{total} done (every configuration)", True)

        res = megatron_benchmark(cfg, on_progress=on_step)
    if as_json:
        click.echo(json.dumps({"runs": res["runs"]}, indent=2, default=str))
        return
    con = console()
    for workload in cfg.workloads:
        t = table(
            f"{workload} microbatches: {cfg.stages} gloo processes on 127.0.0.1,"
            f" {cfg.microbatches} microbatches, {cfg.us_per_token:g} µs/token: real CPU compute +"
            f" EMULATED GPU time"
            + (f" (jitter {cfg.jitter})" if workload == "variable" else "")
            + f"; {cfg.steps} timed steps after {cfg.warmup_steps} warm-up, configurations"
            " interleaved step by step",
            (
                "configuration",
                f"step s\n(median\nof {cfg.steps})",
                "vs megatron\n1F1B\n(min–max)",
                "vs megatron\ninterleaved\n(min–max)",
                "effic.",
                "in\nflight",
                "peak\nMiB",
                "bytes\nvs\nmegatron\n1F1B",
            ),
            left={"configuration"},
        )
        for r in (x for x in res["runs"] if x["workload"] == workload):
            vpp = f"VPP {r['chunks']}" if r["chunks"] > 1 else "1 chunk"
            if r["system"] == "megatron":
                name = f"megatron {r['schedule']} ({vpp})"
            else:
                memory = f"{r['memory_factor']:g}x" if r["policy"] != "strict" else ""
                name = " ".join(
                    x for x in ("drop-in", vpp, r["policy"], f"hint {r['schedule']}", memory) if x
                )
            cells = []
            for k in ("1f1b", "interleaved"):
                lo, hi = r[f"spread_{k}"]
                cells.append(f"{r[f'vs_megatron_{k}']:.2f}x\n{lo:.2f}–{hi:.2f}")
            t.add_row(
                name,
                f"{r['step_s']:.4f}",
                *cells,
                f"{r['efficiency']:.2f}",
                str(r["peak_inflight"]),
                *_bytes_cells(r),
            )
        t.caption = (
            "vs megatron: median (min–max) of megatron's step i / the row's step i;"
            " effic. = lower bound (emulated durations only) / step; hint megatron ="
            " megatron's own order of that schedule, bfw = breadth_first_weighted with each"
            " step's declared durations, default = no hint: learned from the run (sizes,"
            " bytes, task times; within megatron's order's bytes); memory = admission bound"
            " (x megatron's order's);"
            f" losses equal megatron's within {res['loss_max_diff']:.1e}; in flight = the most"
            " activations in flight on a rank (megatron's: its order's); "
            + (
                "peak MiB: the most activation bytes any rank held in a timed step, measured"
                " on every step of every row by the saved-tensor meter (its cost in every"
                " row's time alike; megatron's rows inside their chunks, the drop-in's by its"
                " executor); bytes vs megatron 1F1B: the row's peak / megatron 1F1B's, same"
                " workload; a VPP 2 row counts half of what its chunks measured (each stands"
                " for half the rank's model)"
                if cfg.meter
                else "no bytes measured (--no-meter)"
            )
        )
        con.print(t)


def _bytes_cells(r: dict[str, Any]) -> tuple[str, str]:
    """The row's peak bytes (MiB) and its ratio to megatron 1F1B's; dashes without them."""
    if r.get("peak_bytes") is None:
        return "–", "–"
    return f"{r['peak_bytes'] / 2**20:.2f}", f"{r['bytes_vs_megatron_1f1b']:.2f}x"
