"""``rrfp-async bench``: the benchmark group and its smaller subcommands.

The two large subcommands live in their own modules (``_cmd_bench_peer``,
``_cmd_bench_overhead``) and are added to the group here. Every subcommand imports its
measuring module (the lab's, ``rrfp_lab``, which pulls in torch) inside its body, so that
``--help`` stays fast.
"""

from __future__ import annotations

import json
from typing import Any

import click

from rrfp_async.cli import (
    CleanErrorsGroup,
    console,
    hint_option,
    jitter_option,
    json_option,
    log_options,
    memory_factor_option,
    microbatches_option,
    policy_names,
    policy_option,
    repeats_option,
    seed_option,
    speedup_table,
    stages_option,
    steps_option,
    table,
    tp_option,
)

from ._cmd_bench_deepspeed import bench_deepspeed
from ._cmd_bench_hf import bench_hf
from ._cmd_bench_megatron import bench_megatron
from ._cmd_bench_overhead import bench_overhead
from ._cmd_bench_peer import bench_peer

__all__ = ["bench"]


@click.group("bench", cls=CleanErrorsGroup)
def bench() -> None:
    """Benchmarks: ratios measured side by side in one run (see BENCHMARKS.md)."""


bench.add_command(bench_peer)
bench.add_command(bench_overhead)
bench.add_command(bench_hf)
bench.add_command(bench_megatron)
bench.add_command(bench_deepspeed)


@bench.command("simulator")
@stages_option(16)
@microbatches_option(128)
@repeats_option(5)
@click.option(
    "--policies-table/--no-policies-table",
    default=True,
    show_default=True,
    help="Also print the policy x hint x memory ratio table (8 x 32, 5 seeds).",
)
@click.option(
    "--scaling/--no-scaling",
    default=True,
    show_default=True,
    help="Also print microseconds per task at 16 x 128, 32 x 256, 64 x 512 and 128 x 1024"
    " (about a minute).",
)
@click.option(
    "--scaling-repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Simulated steps per size of the scaling table (the median is shown).",
)
@log_options
def bench_simulator(
    stages: int,
    microbatches: int,
    repeats: int,
    policies_table: bool,
    scaling: bool,
    scaling_repeats: int,
) -> None:
    """Wall time of one simulated step, how it grows with the step, and simulated makespan
    ratios of the policies."""
    from .. import simulator_policy_table, simulator_scaling, simulator_wall_time

    con = console()
    t = table(
        f"simulating one {stages} x {microbatches} step (multimodal, jitter 0.2):"
        " real wall time on this machine",
        ("policy", "tasks", "median s", "max s", "us/task"),
        left={"policy"},
    )
    for r in simulator_wall_time(stages=stages, microbatches=microbatches, repeats=repeats):
        t.add_row(
            r["policy"],
            str(r["tasks"]),
            f"{r['wall_median_s']:.3f}",
            f"{r['wall_max_s']:.3f}",
            f"{r['us_per_task']:.1f}",
        )
    con.print(t)
    if scaling:
        t = table(
            "simulator scaling: one readiness_first step (multimodal, jitter 0.2, hint"
            f" breadth_first_weighted computed in the step), median of {scaling_repeats};"
            " growth = us/task over the first row's",
            ("stages x microbatches", "tasks", "median s", "max s", "us/task", "growth"),
        )
        for r in simulator_scaling(repeats=scaling_repeats):
            t.add_row(
                f"{r['stages']} x {r['microbatches']}",
                str(r["tasks"]),
                f"{r['wall_median_s']:.3f}",
                f"{r['wall_max_s']:.3f}",
                f"{r['us_per_task']:.1f}",
                f"{r['growth']:.2f}x",
            )
        con.print(t)
    if not policies_table:
        return
    t = table(
        "simulated makespan speedup, 8 stages x 32 microbatches, jitter 0.2, mean"
        " of 5 seeds (virtual time, declared cost model)",
        ("workload", "hint", "memory", "policy", "vs strict 1f1b 1x", "vs strict same hint"),
        left={"workload", "hint", "policy"},
    )
    for r in simulator_policy_table():
        t.add_row(
            r["workload"],
            r["hint"],
            f"{r['memory']:g}x",
            r["policy"],
            f"{r['vs_1f1b_strict']:.3f}x",
            f"{r['vs_same_hint_strict']:.3f}x",
        )
    con.print(t)


@bench.command("pipeline")
@stages_option(4)
@microbatches_option(16)
@steps_option(6)
@tp_option()
@hint_option()
@policy_option("Policy to compare (repeatable). Default: strict and readiness_first.")
@memory_factor_option()
@jitter_option()
@seed_option
@log_options
def bench_pipeline(
    stages: int,
    microbatches: int,
    steps: int,
    tp: int,
    hint: str,
    policies: tuple[str, ...],
    memory_factor: float | None,
    jitter: float,
    seed: int,
) -> None:
    """Step times of a real multi-process gloo pipeline training the example model."""
    from .. import pipeline_step_times

    names = policy_names(policies, ["strict", "readiness_first"])
    res = pipeline_step_times(
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        tp=tp,
        hint=hint,
        policies=names,
        memory_factor=memory_factor,
        jitter=jitter,
        seed=seed,
    )
    base = names[0]
    t = speedup_table(
        f"{stages * tp} processes (PP={stages}, TP={tp}), {microbatches} microbatches,"
        f" hint {hint}, memory x{memory_factor or 1:g}, multimodal: real CPU compute"
        " + EMULATED GPU time (declared cost model, jitter"
        f" {jitter}); gloo on 127.0.0.1; {steps} timed steps per policy, speedup ="
        f" {base}'s step i / the policy's step i, median and min–max over the paired steps",
        [(n, res["policies"][n]["median_s"], res["policies"][n]["vs_first"]) for n in names],
        steps=steps,
        microbatches=microbatches,
        base=base,
    )
    what = table(
        f"what each policy did over the {steps} timed steps (all ranks)",
        ("policy", "deviations\n(total)", "peak in-\nflight (max)", "compute s", "emulated s"),
        left={"policy"},
        whole={"policy"},
    )
    for n in names:
        r = res["policies"][n]
        what.add_row(
            n,
            str(r["deviations"]),
            str(r["peak_inflight"]),
            f"{r['compute_s']:.2f}",
            f"{r['emulated_s']:.2f}",
        )
    con = console()
    con.print(t)
    con.print()
    con.print(what)
    con.print(f"total wall time {res['wall_s']:.1f} s (spawn included)")


@bench.command("bridges")
@repeats_option(2000, minimum=10)
@log_options
def bench_bridges(repeats: int) -> None:
    """Cost of each awaitable bridge on this machine (µs per awaited operation)."""
    from .. import bridge_overheads

    rows = bridge_overheads(repeats)
    keys = [k for k in rows[0] if k != "name"] if rows else []
    t = table(
        "awaitable bridges, µs per op (median of batches), this machine",
        ("name", *keys),
        left={"name"},
    )
    for r in rows:
        t.add_row(
            str(r["name"]), *[f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        )
    console().print(t)


@bench.command("logging")
@repeats_option(9)
@log_options
def bench_logging(repeats: int) -> None:
    """Overhead of step-traced logging on a simulated 16 x 128 step (disabled and enabled)."""
    from .. import logging_overhead

    t = table(
        "simulated 16 x 128 step, wall time, median of interleaved runs",
        ("variant", "median s", "overhead vs no observer"),
        left={"variant"},
    )
    for r in logging_overhead(repeats=repeats):
        t.add_row(r["variant"], f"{r['median_s']:.4f}", f"{r['overhead']:+.2%}")
    console().print(t)


@bench.command("paper")
@click.option(
    "--full",
    is_flag=True,
    help="The whole grid: PP 4, 8, 16 x M 32, 64, 128, both workloads, mild and heavy"
    " noise, and the condition search (about 16 minutes on 2 cores).",
)
@click.option("--seeds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--conditions/--no-conditions",
    default=True,
    show_default=True,
    help="Also run the search for the conditions under which the preprint's 2.77x holds.",
)
@click.option(
    "--tp-coordination/--no-tp-coordination",
    default=True,
    show_default=True,
    help="Also price TP coordination: makespan with each TP group's decision latency (the"
    " fitted model of bench overhead --section tp) vs free, strict 1F1B and bfw.",
)
@json_option("Print the rows as JSON.")
@click.option("--markdown", is_flag=True, help="Print the tables as Markdown.")
@log_options
def bench_paper(
    full: bool,
    seeds: int,
    conditions: bool,
    tp_coordination: bool,
    as_json: bool,
    markdown: bool,
) -> None:
    """Paper scale in simulation (PP 4-16 x TP 8, up to 128 GPUs): every hint/policy vs
    strict 1F1B, next to the RRFP preprint's 1.77x / 2.77x (virtual time, declared cost
    model)."""
    from .. import (
        PAPER_FIGURES,
        condition_configs,
        condition_scenarios,
        coordination_rows,
        coordination_table,
        default_scenarios,
        paper_table,
        report_tables,
        to_markdown,
    )

    def progress(sc: Any, wall: float) -> None:
        name = sc.label or f"PP{sc.pp} x M{sc.microbatches}"
        click.echo(f"  {sc.workload}, {sc.noise.name} noise, {name}: {wall:.1f} s", err=True)

    grid = paper_table(full=full, seeds=seeds, on_scenario=progress)
    cond = (
        paper_table(
            seeds=seeds,
            scenarios=condition_scenarios(),
            configs=condition_configs(),
            on_scenario=progress,
        )
        if conditions or full
        else []
    )
    coord = coordination_rows(default_scenarios(full=full), seeds=seeds) if tp_coordination else []
    if as_json:
        doc = {"paper": PAPER_FIGURES, "grid": grid, "conditions": cond, "tp_coordination": coord}
        click.echo(json.dumps(doc, indent=1))
        return
    con = console()
    tables = report_tables(grid, cond) + ([coordination_table(coord)] if coord else [])
    for tt in tables:
        if markdown:
            click.echo(to_markdown(tt) + "\n")
            continue
        # The first three columns name the configuration, the rest are figures.
        t = table(tt.title, tt.columns, left=tt.columns[:3], whole=tt.columns[1:2])
        for row in tt.rows:
            t.add_row(*row)
        con.print(t)


@bench.command("soak")
@steps_option(500, "Steps of the local pipeline.")
@stages_option(4)
@microbatches_option(8)
@click.option("--policy", default="readiness_first", show_default=True, help="The policy.")
@click.option(
    "--fail-every",
    type=click.IntRange(min=1),
    default=None,
    help="Make every N-th step fail mid-step (an executor raises), to soak the recovery.",
)
@click.option("--asyncio", "use_asyncio", is_flag=True, help="The plain asyncio loop, not uvloop.")
@seed_option
@log_options
def bench_soak(
    steps: int,
    stages: int,
    microbatches: int,
    policy: str,
    fail_every: int | None,
    use_asyncio: bool,
    seed: int,
) -> None:
    """Run a local pipeline for many steps; resident memory, live tasks and threads must stay
    flat (exit code 1 if they do not)."""
    from .. import format_soak, soak

    policy_names((policy,), [])
    res = soak(
        steps,
        stages,
        microbatches,
        policy=policy,
        fail_every=fail_every,
        use_uvloop=not use_asyncio,
        seed=seed,
    )
    click.echo(format_soak(res))
    if not res.flat:
        raise SystemExit(1)
