"""The ``rrfp-async`` command line (click for parsing, rich for tables)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ._errors import RRFPError
from ._simulate import SimResult, simulate
from .policies._hints import HINTS
from .policies._policy import available_policies

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rrfp-async")
def main() -> None:
    """Readiness-first pipeline-parallel training steps on asyncio."""


def _comparison_table(results: dict[str, SimResult], base: str, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("policy", no_wrap=True)
    for col in ("makespan s", "bound s", "effic.", "speedup", "peak", "devs", "wall s"):
        table.add_column(col, justify="right", no_wrap=True)
    b = results[base].makespan
    for name, r in results.items():
        table.add_row(
            name,
            f"{r.makespan:.4f}",
            f"{r.lower_bound:.4f}",
            f"{r.efficiency:.3f}",
            f"{b / r.makespan:.3f}x",
            str(max(r.peak_inflight)),
            str(sum(r.deviations)),
            f"{r.wall_time:.3f}",
        )
    table.caption = (
        f"speedup: vs {base}; bound: critical path / busiest rank lower bound; peak: most"
        " activations in flight on any rank; devs: decisions off the hint order"
    )
    return table


def _console() -> Console:
    c = Console()
    if not c.is_terminal:
        c = Console(width=120)
    return c


@main.command("simulate")
@click.option("--stages", "-p", type=click.IntRange(min=1), required=True, help="Pipeline ranks P.")
@click.option(
    "--microbatches", "-m", type=click.IntRange(min=1), required=True, help="Microbatches M."
)
@click.option(
    "--chunks",
    "-v",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Model chunks per rank V.",
)
@click.option(
    "--hint",
    default="1f1b",
    show_default=True,
    help=f"Hint: {', '.join(sorted(HINTS))} (or an alias: bf, bfw, interleaved).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policy to compare (repeatable). Default: strict and readiness_first.",
)
@click.option(
    "--memory-factor",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Scale of the default admission bound (1F1B's in-flight count).",
)
@click.option(
    "--workload",
    type=click.Choice(["uniform", "text", "multimodal"]),
    default="uniform",
    show_default=True,
)
@click.option(
    "--jitter",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Sigma of the lognormal compute noise.",
)
@click.option(
    "--latency",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Mean message latency, seconds.",
)
@click.option(
    "--split-backward/--no-split-backward",
    default=None,
    help="Split backwards into I and W (default: only for zb_h1).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def simulate_cmd(
    stages: int,
    microbatches: int,
    chunks: int,
    hint: str,
    policies: tuple[str, ...],
    memory_factor: float | None,
    workload: str,
    jitter: float,
    latency: float,
    split_backward: bool | None,
    seed: int,
    as_json: bool,
) -> None:
    """Simulate one step under several policies (same sizes, same noise) and compare.

    Time is virtual: the real stage-loop code runs on a discrete-event clock with a
    declared GPU cost model; nothing here measures this machine.
    """
    names = list(policies) or ["strict", "readiness_first"]
    known = available_policies()
    for n in names:
        if n not in known:
            raise click.BadParameter(
                f"unknown policy {n!r}; choose from {known}", param_hint="--policy"
            )
    results: dict[str, SimResult] = {}
    try:
        for n in names:
            results[n] = simulate(
                stages=stages,
                microbatches=microbatches,
                chunks=chunks,
                hint=hint,
                policy=n,
                memory_factor=memory_factor,
                workload=workload,
                jitter=jitter,
                latency=latency,
                split_backward=split_backward,
                seed=seed,
            )
    except RRFPError as e:
        raise click.ClickException(str(e)) from e
    base = names[0]
    if as_json:
        out: dict[str, Any] = {
            "config": {
                "stages": stages,
                "microbatches": microbatches,
                "chunks": chunks,
                "hint": hint,
                "memory_factor": memory_factor,
                "workload": workload,
                "jitter": jitter,
                "latency": latency,
                "seed": seed,
                "time": "virtual (cost model)",
            },
            "results": {n: r.to_dict() for n, r in results.items()},
            "speedup": {n: results[base].makespan / r.makespan for n, r in results.items()},
        }
        click.echo(json.dumps(out, indent=2))
        return
    console = _console()
    title = (
        f"{stages} stages x {microbatches} microbatches, chunks {chunks}, hint"
        f" {results[base].hint}, workload {workload}, jitter {jitter}"
        f" (simulated, virtual time)"
    )
    console.print(_comparison_table(results, base, title))
    if len(names) >= 2:
        a, b = results[names[0]], results[names[1]]
        console.print(
            f"{names[0]} / {names[1]} makespan ratio: [bold]{a.makespan / b.makespan:.3f}x[/bold]"
            f"   efficiency {a.efficiency:.3f} vs {b.efficiency:.3f}"
        )


@main.group("bench")
def bench() -> None:
    """Benchmarks: ratios measured side by side in one run (see BENCHMARKS.md)."""


@bench.command("simulator")
@click.option("--stages", "-p", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--microbatches", "-m", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "--policies-table/--no-policies-table",
    default=True,
    show_default=True,
    help="Also print the policy x hint x memory ratio table (8 x 32, 5 seeds).",
)
def bench_simulator(stages: int, microbatches: int, repeats: int, policies_table: bool) -> None:
    """Wall time of one simulated step, and simulated makespan ratios of the policies."""
    from ._bench import simulator_policy_table, simulator_wall_time

    console = _console()
    t = Table(
        title=f"simulating one {stages} x {microbatches} step (multimodal, jitter 0.2):"
        " real wall time on this machine",
        title_justify="left",
    )
    for c in ("policy", "tasks", "median s", "max s", "us/task"):
        t.add_column(c, justify="right" if c != "policy" else "left")
    for r in simulator_wall_time(stages=stages, microbatches=microbatches, repeats=repeats):
        t.add_row(
            r["policy"],
            str(r["tasks"]),
            f"{r['wall_median_s']:.3f}",
            f"{r['wall_max_s']:.3f}",
            f"{r['us_per_task']:.1f}",
        )
    console.print(t)
    if not policies_table:
        return
    t = Table(
        title="simulated makespan speedup, 8 stages x 32 microbatches, jitter 0.2, mean"
        " of 5 seeds (virtual time, declared cost model)",
        title_justify="left",
    )
    for c in ("workload", "hint", "memory", "policy", "vs strict 1f1b 1x", "vs strict same hint"):
        t.add_column(c, justify="left" if c in ("workload", "hint", "policy") else "right")
    for r in simulator_policy_table():
        t.add_row(
            r["workload"],
            r["hint"],
            f"{r['memory']:g}x",
            r["policy"],
            f"{r['vs_1f1b_strict']:.3f}x",
            f"{r['vs_same_hint_strict']:.3f}x",
        )
    console.print(t)


@bench.command("pipeline")
@click.option("--stages", "-p", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--microbatches", "-m", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--hint", default="1f1b", show_default=True)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policy to compare (repeatable). Default: strict and readiness_first.",
)
@click.option("--memory-factor", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
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
    from ._bench import pipeline_step_times

    names = list(policies) or ["strict", "readiness_first"]
    try:
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
    except RRFPError as e:
        raise click.ClickException(str(e)) from e
    console = _console()
    t = Table(
        title=f"{stages * tp} processes (PP={stages}, TP={tp}), {microbatches} microbatches,"
        f" hint {hint}, memory x{memory_factor or 1:g}, multimodal: real CPU compute"
        " + EMULATED GPU time (declared cost model, jitter"
        f" {jitter}); gloo on 127.0.0.1",
        title_justify="left",
    )
    for c in (
        "policy",
        "median step s",
        "mean step s",
        "speedup",
        "deviations",
        "peak",
        "compute s",
        "emulated s",
    ):
        t.add_column(c, justify="left" if c == "policy" else "right")
    base = res["policies"][names[0]]["median_s"]
    for n in names:
        r = res["policies"][n]
        t.add_row(
            n,
            f"{r['median_s']:.4f}",
            f"{r['mean_s']:.4f}",
            f"{base / r['median_s']:.3f}x",
            str(r["deviations"]),
            str(r["peak_inflight"]),
            f"{r['compute_s']:.2f}",
            f"{r['emulated_s']:.2f}",
        )
    console.print(t)
    console.print(f"total wall time {res['wall_s']:.1f} s (spawn included)")


@bench.command("bridges")
@click.option("--repeats", type=click.IntRange(min=10), default=2000, show_default=True)
def bench_bridges(repeats: int) -> None:
    """Cost of each awaitable bridge on this machine (µs per awaited operation)."""
    from ._bench_bridges import bridge_overheads

    t = Table(
        title="awaitable bridges, µs per op (median of batches), this machine", title_justify="left"
    )
    rows = bridge_overheads(repeats)
    keys = [k for k in rows[0] if k != "name"] if rows else []
    t.add_column("name")
    for k in keys:
        t.add_column(k, justify="right")
    for r in rows:
        t.add_row(
            str(r["name"]), *[f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        )
    _console().print(t)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
