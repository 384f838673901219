"""The ``rrfp-async`` command line (click for parsing, rich for tables)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .._errors import RRFPError
from ..observability._logging import LogFormat, LogObserver, configure_logging
from ..observability._trace import load_trace, render_png, summarize, write_trace
from ..policies._hints import HINTS
from ..policies._policy import available_policies
from ..sim._simulate import SimResult, simulate

__all__ = ["main"]


def _set_logging(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    meta = ctx.find_root().meta
    if value is not None:
        meta[f"log_{param.name}"] = value
    fmt = meta.get("log_format", "console")
    level = meta.get("log_level", "warning")
    configure_logging(format=fmt, level=level)
    return value


def log_options(f: Any) -> Any:
    """``--log-format`` and ``--log-level`` (step-traced structlog events) for a command."""
    f = click.option(
        "--log-level",
        "level",
        default=None,
        expose_value=False,
        callback=_set_logging,
        is_eager=True,
        type=click.Choice(["debug", "info", "warning", "error"]),
        help="debug: one event per transition; info: steps (default warning).",
    )(f)
    return click.option(
        "--log-format",
        "format",
        default=None,
        expose_value=False,
        callback=_set_logging,
        is_eager=True,
        type=click.Choice(["json", "console"]),
        help="Log lines as JSON or as console columns (stderr).",
    )(f)


def _log_choice() -> tuple[LogFormat | None, str]:
    """The log format workers should configure (None: nothing would be logged), and the level."""
    meta = click.get_current_context().find_root().meta
    level: str = meta.get("log_level", "warning")
    fmt: LogFormat = meta.get("log_format", "console")
    return (fmt if level in ("debug", "info") else None), level


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rrfp-async")
@log_options
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
    default="breadth_first_weighted",
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
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a Chrome/Perfetto trace per policy (FILE, or FILE with .POLICY"
    " before the extension when several policies run).",
)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG timeline, one panel per policy.",
)
@log_options
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
    trace_path: str | None,
    png_path: str | None,
) -> None:
    """Simulate one step under several policies (same sizes, same noise) and compare.

    Time is virtual: the real stage-loop code runs on a discrete-event clock with a
    declared GPU cost model; nothing here measures this machine.
    """
    names = _policy_names(policies, ["strict", "readiness_first"])
    results: dict[str, SimResult] = {}
    record = trace_path is not None or png_path is not None
    fmt, _ = _log_choice()
    try:
        for n in names:
            results[n] = simulate(
                observer=LogObserver() if fmt is not None else None,
                record=record,
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
    written = _write_outputs(
        results, trace_path, png_path, "simulated step (virtual time, declared cost model)"
    )
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
            "written": written,
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
    for w in written:
        console.print(f"wrote {w}")


def _policy_path(path: str, policy: str, several: bool) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}.{policy}{p.suffix}") if several else p


def _write_outputs(
    results: dict[str, SimResult], trace_path: str | None, png_path: str | None, title: str
) -> list[str]:
    written: list[str] = []
    several = len(results) > 1
    if trace_path is not None:
        for n, r in results.items():
            written.append(str(write_trace(_policy_path(trace_path, n, several), r.chrome_trace())))
    if png_path is not None:
        panels = [(n, r.trace) for n, r in results.items() if r.trace is not None]
        written.append(str(render_png(panels, png_path, title=title)))
    return written


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
@log_options
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
@click.option("--hint", default="breadth_first_weighted", show_default=True)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policy to compare (repeatable). Default: strict and readiness_first.",
)
@click.option("--memory-factor", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
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
    from ._bench import pipeline_step_times

    names = _policy_names(policies, ["strict", "readiness_first"])
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


@bench.command("peer")
@click.option("--stages", "-p", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--microbatches", "-m", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option(
    "--us-per-token",
    "scales",
    type=click.FloatRange(min=0, min_open=True),
    multiple=True,
    help="Emulated forward µs per token (repeatable; one table each). Default: 2 and 8"
    " (communication about 20 % and 5 % of a task here).",
)
@click.option("--hidden", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--torch-schedule",
    "torch_schedules",
    multiple=True,
    help="torch schedule class (repeatable). Default: 1F1B, GPipe, Interleaved1F1B,"
    " InterleavedZeroBubble, ZBVZeroBubble.",
)
@click.option("--hint", "hints", multiple=True, help="rrfp_async hint (repeatable).")
@click.option("--policy", "policies", multiple=True, help="rrfp_async policy (repeatable).")
@click.option(
    "--memory-factor",
    "memory_factors",
    type=click.FloatRange(min=0, min_open=True),
    multiple=True,
    help="Admission bound as a multiple of 1F1B's (repeatable). Default: 1 and 2.",
)
@click.option(
    "--simulated",
    is_flag=True,
    help="Instead: the same steps in the simulator (virtual time, no host cost), with a"
    " simulation-guided hint and an oracle; --latency sets the message latency.",
)
@click.option("--latency", type=click.FloatRange(min=0), default=0.0007, show_default=True)
@click.option(
    "--host-time",
    is_flag=True,
    help="Instead: the stage module's host time per task beyond its emulated time (one"
    " process), and the efficiency it alone caps any runtime at.",
)
@click.option("--json", "as_json", is_flag=True, help="Print {'runs': [...]} as JSON.")
@log_options
def bench_peer(
    stages: int,
    microbatches: int,
    steps: int,
    warmup: int,
    scales: tuple[float, ...],
    hidden: int,
    jitter: float,
    seed: int,
    torch_schedules: tuple[str, ...],
    hints: tuple[str, ...],
    policies: tuple[str, ...],
    memory_factors: tuple[float, ...],
    simulated: bool,
    latency: float,
    host_time: bool,
    as_json: bool,
) -> None:
    """Side by side with torch.distributed.pipelining: same modules, same microbatches.

    Real processes on gloo (127.0.0.1), real CPU compute plus EMULATED GPU time (each stage
    sleeps a declared, seeded duration per token), configurations interleaved step by step.
    """
    from ._bench_peer import PeerConfig, peer_benchmark

    base = PeerConfig()
    try:
        cfgs = [
            PeerConfig(
                stages=stages,
                microbatches=microbatches,
                steps=steps,
                warmup_steps=warmup,
                us_per_token=us,
                hidden=hidden,
                jitter=jitter,
                seed=seed,
                torch_schedules=torch_schedules or base.torch_schedules,
                padded_cost=tuple(
                    s for s in base.padded_cost if s in (torch_schedules or base.torch_schedules)
                ),
                hints=hints or base.hints,
                policies=tuple(_policy_names(policies, list(base.policies))),
                memory_factors=memory_factors or base.memory_factors,
            )
            for us in (scales or (2.0, 8.0))
        ]
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    if simulated:
        _peer_simulated(cfgs, latency, as_json)
        return
    if host_time:
        from ._bench_peer import module_host_time

        rows = [{"us_per_token": c.us_per_token, **module_host_time(c)} for c in cfgs]
        if as_json:
            click.echo(json.dumps({"host_time": rows}, indent=2))
            return
        for r in rows:
            click.echo(
                f"{r['us_per_token']:g} µs/token: forward +{r['f_over'] * 1e3:.2f} ms, backward"
                f" +{r['b_over'] * 1e3:.2f} ms over the emulated time (real compute alone"
                f" {r['f_compute'] * 1e3:.2f} / {r['b_compute'] * 1e3:.2f} ms); efficiency"
                f" cap {r['cap']:.2f}"
            )
        return
    results = []
    for cfg in cfgs:
        try:
            res = peer_benchmark(cfg)
        except RRFPError as e:
            raise click.ClickException(str(e)) from e
        results.append(res)
    if as_json:
        runs = [
            dict(r, us_per_token=res["config"].us_per_token) for res in results for r in res["runs"]
        ]
        click.echo(json.dumps({"runs": runs}, indent=2, default=str))
        return
    console = _console()
    for res in results:
        cfg = res["config"]
        t = Table(
            title=f"{cfg.stages} gloo processes on 127.0.0.1, {cfg.microbatches} multimodal"
            f" microbatches, {cfg.us_per_token:g} µs/token: real CPU compute + EMULATED GPU"
            f" time (jitter {cfg.jitter}); median of {cfg.steps} steps after {cfg.warmup_steps}"
            f" warm-up; comm share {res['comm_share']:.0%} of a mean task",
            title_justify="left",
        )
        for c in (
            "system",
            "schedule / hint",
            "policy",
            "memory",
            "step s",
            "vs torch 1F1B",
            "efficiency",
            "peak",
            "note",
        ):
            t.add_column(
                c,
                justify="right"
                if c in ("step s", "vs torch 1F1B", "efficiency", "peak")
                else "left",
            )
        for r in sorted(
            res["runs"],
            key=lambda r: (
                -r["speedup_vs_torch_1f1b"]
                if r["speedup_vs_torch_1f1b"] == r["speedup_vs_torch_1f1b"]
                else 0
            ),
        ):
            t.add_row(
                r["system"],
                (r["schedule"] or r["hint"]).replace("breadth_first_weighted", "bfw"),
                r["policy"] or "",
                f"{r['memory_factor']:g}x" if r["memory_factor"] else "",
                f"{r['step_s']:.4f}",
                f"{r['speedup_vs_torch_1f1b']:.2f}x",
                f"{r['efficiency']:.2f}",
                str(r["peak_inflight"]),
                r["note"],
            )
        t.caption = (
            f"efficiency = lower bound (emulated durations only) / step; losses of every"
            f" configuration equal torch's within {res['loss_max_diff']:.1e}; bfw ="
            " breadth_first_weighted; ':split' = split backward (I/W)"
        )
        console.print(t)


def _peer_simulated(cfgs: list[Any], latency: float, as_json: bool) -> None:
    from ._bench_peer import peer_simulated

    out = [
        {"us_per_token": cfg.us_per_token, **row}
        for cfg in cfgs
        for row in peer_simulated(cfg, latency=latency)
    ]
    if as_json:
        click.echo(json.dumps({"simulated": out}, indent=2))
        return
    t = Table(
        title=f"the peer benchmark's steps simulated (virtual time, declared cost model, no"
        f" host cost, message latency {latency * 1e3:g} ms): median over the steps",
        title_justify="left",
    )
    for c in ("µs/token", "configuration", "vs strict 1F1B", "efficiency"):
        t.add_column(c, justify="left" if c == "configuration" else "right")
    for r in out:
        t.add_row(
            f"{r['us_per_token']:g}",
            r["configuration"],
            f"{r['vs_strict_1f1b']:.2f}x",
            f"{r['efficiency']:.2f}",
        )
    _console().print(t)


@bench.command("bridges")
@click.option("--repeats", type=click.IntRange(min=10), default=2000, show_default=True)
@log_options
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


@bench.command("logging")
@click.option("--repeats", type=click.IntRange(min=1), default=9, show_default=True)
@log_options
def bench_logging(repeats: int) -> None:
    """Overhead of step-traced logging on a simulated 16 x 128 step (disabled and enabled)."""
    from ._bench import logging_overhead

    t = Table(
        title="simulated 16 x 128 step, wall time, median of interleaved runs", title_justify="left"
    )
    for c in ("variant", "median s", "overhead vs no observer"):
        t.add_column(c, justify="left" if c == "variant" else "right")
    for r in logging_overhead(repeats=repeats):
        t.add_row(r["variant"], f"{r['median_s']:.4f}", f"{r['overhead']:+.2%}")
    _console().print(t)


_OVERHEAD_SECTIONS = ("decision", "message", "tp", "split")


@bench.command("overhead")
@click.option(
    "--section",
    "sections",
    multiple=True,
    type=click.Choice(_OVERHEAD_SECTIONS),
    help="Section to run (repeatable). Default: all.",
)
@click.option(
    "--ready",
    "ready_sizes",
    multiple=True,
    type=click.IntRange(min=1),
    help="Ready-set sizes for the decision latency (repeatable). Default: 1 2 4 ... 64.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policies for the decision latency (repeatable). Default: strict greedy readiness_first.",
)
@click.option(
    "--loop",
    "loops",
    multiple=True,
    type=click.Choice(["uvloop", "asyncio"]),
    help="Event loops (repeatable). Default: both.",
)
@click.option(
    "--size",
    "sizes",
    multiple=True,
    type=click.IntRange(min=4),
    help="Message sizes in bytes (repeatable). Default: 64, 16384, 1048576.",
)
@click.option(
    "--tp",
    "tps",
    multiple=True,
    type=click.IntRange(min=2),
    help="TP sizes (repeatable; one process each). Default: 2 and 4.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=9,
    show_default=True,
    help="Timed steps per decision-latency case (I+W vs B: twice as many rounds).",
)
@click.option(
    "--messages", type=click.IntRange(min=5), default=300, show_default=True, help="Round trips."
)
@click.option("--decisions", type=click.IntRange(min=5), default=200, show_default=True)
@click.option(
    "--compute-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Task compute for the TP share of step time.",
)
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Microbatches of the I+W vs B measurement.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@log_options
def bench_overhead(
    sections: tuple[str, ...],
    ready_sizes: tuple[int, ...],
    policies: tuple[str, ...],
    loops: tuple[str, ...],
    sizes: tuple[int, ...],
    tps: tuple[int, ...],
    repeats: int,
    messages: int,
    decisions: int,
    compute_ms: float,
    microbatches: int,
    as_json: bool,
) -> None:
    """Overheads in isolation, each against its raw baseline (ratios measured in one run)."""
    from . import _bench_overhead as ov

    chosen = [s for s in _OVERHEAD_SECTIONS if not sections or s in sections]
    loop_names = list(loops or ("uvloop", "asyncio"))
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        if "decision" in chosen:
            out["decision"] = ov.decision_latency(
                ready_sizes or (1, 2, 4, 8, 16, 32, 64),
                policies=policies or ("strict", "greedy", "readiness_first"),
                loops=loop_names,
                repeats=repeats,
            )
        if "message" in chosen:
            out["message"] = ov.message_cost(
                sizes or (64, 16 * 1024, 1 << 20), messages=messages, loops=loop_names
            )
        if "tp" in chosen:
            out["tp"] = ov.tp_coordination(
                tps or (2, 4), decisions=decisions, compute_ms=compute_ms
            )
        if "split" in chosen:
            out["split"] = ov.split_backward_cost_isolated(
                microbatches=microbatches, repeats=max(5, 2 * repeats)
            )
    except RRFPError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    console = _console()

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    if "decision" in out:
        t = Table(
            title="decision latency (policy + stage bookkeeping, no compute), µs per decision,"
            f" median of {repeats} steps; target < {ov.DECISION_TARGET_US:g} µs",
            title_justify="left",
        )
        cols = ["policy", "k", "mean k", *loop_names, "CPU"]
        cols += [f"{ln} +yield" for ln in loop_names] + ["worst / target", "target"]
        for c in cols:
            t.add_column(c, justify="left" if c == "policy" else "right")
        keys: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
        for r in out["decision"]:
            keys.setdefault((r["policy"], r["ready"]), {})[r["loop"]] = r
        for (pol, k), by_loop in keys.items():
            first = next(iter(by_loop.values()))
            worst = max(r["us_median"] for r in by_loop.values())
            t.add_row(
                pol,
                str(k),
                f"{first['ready_mean']:.1f}",
                *[f"{by_loop[ln]['us_median']:.1f}" if ln in by_loop else "-" for ln in loop_names],
                f"{min(r['cpu_us'] for r in by_loop.values()):.1f}",
                *[
                    f"{by_loop[ln]['us_yield_median']:.1f}" if ln in by_loop else "-"
                    for ln in loop_names
                ],
                f"{worst / ov.DECISION_TARGET_US:.2f}x",
                verdict(worst < ov.DECISION_TARGET_US),
            )
        t.caption = (
            "per decision = step wall time / decisions, one rank, k admitted ready tasks at every"
            " decision but the last k-1 (mean k: observed); CPU: the loop thread's CPU time per"
            " decision (no preemption); +yield: the executor yields to the loop once per task"
        )
        console.print(t)
    if "message" in out:
        t = Table(
            title="per message, one way (round trip / 2), µs, 2 processes, gloo on 127.0.0.1;"
            f" target P2PChannel <= {ov.MESSAGE_TARGET_RATIO:g}x raw blocking send",
            title_justify="left",
        )
        for c in (
            "bytes",
            "loop",
            "raw send",
            "P2PChannel",
            "ratio",
            "target",
            "raw median",
            "channel median",
            "paired ratio",
            "machine",
        ):
            t.add_column(c, justify="left" if c in ("loop", "machine") else "right")
        for r in out["message"]:
            t.add_row(
                str(r["bytes"]),
                r["loop"],
                f"{r['raw_us']:.1f}",
                f"{r['channel_us']:.1f}",
                f"{r['ratio']:.2f}x",
                verdict(r["met"]),
                f"{r['raw_median_us']:.1f}",
                f"{r['channel_median_us']:.1f}",
                f"{r['ratio_paired']:.2f}x",
                "CONTENDED" if r["contended"] else "quiet",
            )
        t.caption = (
            "raw send, P2PChannel, ratio: lower decile of short interleaved batches (the"
            " batches no other process disturbed); paired ratio: median over batches of"
            " channel / the raw batch before it; CONTENDED: a median is over 3x its lower"
            " decile (other processes held the cores; rerun on a quiet machine)"
        )
        console.print(t)
    if "tp" in out:
        t = Table(
            title="TP coordination per decision, µs, vs raw blocking broadcast of int64[6] on the"
            f" same group (uvloop); targets <= {ov.TP_TARGET_RATIO:g}x and"
            f" < {ov.TP_SHARE_TARGET:.0%} of step time with {compute_ms:g} ms tasks",
            title_justify="left",
        )
        for c in (
            "TP",
            "raw bcast",
            "channel",
            "ratio",
            "target",
            "paired",
            "in stage",
            "share (formula)",
            "share (measured)",
            "target",
            "machine",
        ):
            t.add_column(c, justify="left" if c == "machine" else "right")
        for r in out["tp"]:
            t.add_row(
                str(r["tp"]),
                f"{r['raw_us']:.1f}",
                f"{r['channel_us']:.1f}",
                f"{r['ratio']:.2f}x",
                verdict(r["met_ratio"]),
                f"{r['ratio_paired']:.2f}x",
                f"{r['stage_us']:.1f}",
                f"{r['share']:.2%}",
                f"{r['share_measured']:.2%}",
                verdict(r["met_share"]),
                "CONTENDED" if r["contended"] else "quiet",
            )
        t.caption = (
            "channel: DecisionChannel publish -> receive; slowest rank, lower decile of"
            " interleaved batches (paired: median of adjacent-batch ratios); in stage:"
            " (coordinated - uncoordinated step time) / decisions of a DistributedStage with"
            f" no-op tasks; share (formula) = channel / (channel + {compute_ms:g} ms); share"
            " (measured) = (coordinated - uncoordinated) / coordinated step time with tasks"
            f" that wait {compute_ms:g} ms"
        )
        console.print(t)
    if "split" in out:
        t = Table(
            title="I + W vs B, middle stage of the example model, real CPU compute (1 torch"
            f" thread, no emulated time), ms per step; target I+W <= {ov.SPLIT_TARGET_RATIO:g}x B",
            title_justify="left",
        )
        for c in (
            "stage",
            "mbs",
            "tokens",
            "F",
            "B",
            "I",
            "W",
            "I+W",
            "(I+W) / B",
            "target",
            "tasks",
            "with hand-off",
            "source",
        ):
            t.add_column(c, justify="left" if c == "source" else "right")
        for r in out["split"]:
            t.add_row(
                f"{r['stage']} of {r['stages']}",
                str(r["microbatches"]),
                str(r["tokens"]),
                f"{r['f_ms']:.2f}",
                f"{r['b_ms']:.2f}",
                f"{r['i_ms']:.2f}",
                f"{r['w_ms']:.2f}",
                f"{r['iw_ms']:.2f}",
                f"{r['ratio']:.2f}x",
                verdict(r["met"]),
                f"{r['ratio_tasks']:.2f}x",
                f"{r['ratio_wall']:.2f}x",
                ("helper" if r["source"] == "measure_split_backward" else "tasks")
                + (f", {r['split_mode']}" if "split_mode" in r else ""),
            )
        t.caption = (
            "F..I+W: CPU time of the executor's compute thread through execute(), sum over the"
            " microbatches, median of rounds; (I+W) / B: from the executor's own"
            " measure_split_backward (source: helper) when it has one, else = tasks; tasks, with"
            " hand-off: median of per-round ratios of the CPU time / of the awaits of execute"
        )
        console.print(t)


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
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--markdown", is_flag=True, help="Print the tables as Markdown.")
@log_options
def bench_paper(full: bool, seeds: int, conditions: bool, as_json: bool, markdown: bool) -> None:
    """Paper scale in simulation (PP 4-16 x TP 8, up to 128 GPUs): every hint/policy vs
    strict 1F1B, next to the RRFP preprint's 1.77x / 2.77x (virtual time, declared cost
    model)."""
    from ._bench_paper import (
        PAPER_FIGURES,
        condition_configs,
        condition_scenarios,
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
    if as_json:
        doc = {"paper": PAPER_FIGURES, "grid": grid, "conditions": cond}
        click.echo(json.dumps(doc, indent=1))
        return
    console = _console()
    for tt in report_tables(grid, cond):
        if markdown:
            click.echo(to_markdown(tt) + "\n")
            continue
        t = Table(title=tt.title, title_justify="left")
        for i, c in enumerate(tt.columns):
            t.add_column(c, justify="left" if i < 3 else "right")
        for row in tt.rows:
            t.add_row(*row)
        console.print(t)


@main.command("trace")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Render the trace's timeline to this PNG.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@log_options
def trace_cmd(file: str, png_path: str | None, as_json: bool) -> None:
    """Summarise a trace (per-rank busy / idle, bubble ratio, deviations) and render it."""
    try:
        tr = load_trace(file)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    summ = summarize(tr)
    meta = tr.get("otherData", {}).get("rrfp", {})
    if png_path is not None:
        render_png([(Path(file).name, tr)], png_path, title=_clock_title(meta))
    if as_json:
        click.echo(
            json.dumps(
                {
                    "file": file,
                    "meta": {
                        k: meta.get(k) for k in ("clock", "emulated_gpu_time", "policy", "hint")
                    },
                    "summary": summ,
                    "png": png_path,
                },
                indent=2,
                default=str,
            )
        )
        return
    t = Table(
        title=f"{file}: {_clock_title(meta)}; policy {meta.get('policy', '?')}, hint"
        f" {meta.get('hint', '?')}; makespan {summ['makespan'] * 1e3:.2f} ms",
        title_justify="left",
    )
    for c in (
        "rank",
        "tasks",
        "busy ms",
        "idle ms",
        "bubble",
        "peak in-flight",
        "deviations",
        "idle filled ms",
    ):
        t.add_column(c, justify="right")
    for r, v in summ["ranks"].items():
        t.add_row(
            str(r),
            str(v["tasks"]),
            f"{v['busy'] * 1e3:.2f}",
            f"{v['idle'] * 1e3:.2f}",
            f"{v['bubble_ratio']:.1%}",
            str(v["peak_inflight"] or "-"),
            str(v["deviations"]),
            f"{v['filled'] * 1e3:.2f}",
        )
    console = _console()
    console.print(t)
    console.print(
        f"bubble ratio {summ['bubble_ratio']:.1%}, {summ['deviations']} deviations from"
        f" the hint filled {summ['filled'] * 1e3:.2f} ms of idle time"
    )
    if png_path is not None:
        console.print(f"wrote {png_path}")


def _clock_title(meta: dict[str, Any]) -> str:
    if meta.get("clock") == "virtual":
        return "simulated (virtual time, declared cost model)"
    if meta.get("emulated_gpu_time"):
        return "real run: CPU compute + EMULATED GPU time"
    return "real run"


@main.command("demo")
@click.option("--stages", "-p", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--microbatches", "-m", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Timed steps per policy (after one warm-up step).",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--hint", default="breadth_first_weighted", show_default=True)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Policy to compare (repeatable). Default: strict, readiness_first, backfill.",
)
@click.option(
    "--memory-factor",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Admission room over 1F1B's (strict never uses it).",
)
@click.option("--jitter", type=click.FloatRange(min=0), default=0.3, show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="out/demo",
    show_default=True,
    help="Where traces and the PNG go.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@log_options
def demo_cmd(
    stages: int,
    microbatches: int,
    steps: int,
    tp: int,
    hint: str,
    policies: tuple[str, ...],
    memory_factor: float,
    jitter: float,
    out_dir: str,
    seed: int,
) -> None:
    """Train the example image-text model through a local multi-process gloo pipeline, under a
    fixed order and readiness-first, and compare.

    Real processes (one per rank, gloo on 127.0.0.1) train a small image-text transformer on
    variable-length microbatches (0-4 images, 8-48 text tokens). Time is real CPU compute
    plus EMULATED GPU time: each task also sleeps for its declared cost (per token, per
    image patch, backward 2x, jitter).
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ..observability._trace import chrome_trace
    from ._bench import pipeline_step_times

    names = _policy_names(policies, ["strict", "readiness_first", "backfill"])
    fmt, level = _log_choice()
    warm = 1
    traced = warm + steps - 1
    console = _console()
    console.print(
        f"[bold]rrfp-async demo[/bold]: {stages * tp} processes (PP={stages}, TP={tp}),"
        f" {microbatches} microbatches/step, hint {hint}, admission x{memory_factor:g};"
        " time = real CPU compute + EMULATED GPU time"
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        bar = progress.add_task("starting processes", total=len(names) * (warm + steps))

        def on_progress(msg: Any) -> None:
            policy, step = msg
            progress.update(bar, advance=1, description=f"{policy}: step {step}")

        try:
            res = pipeline_step_times(
                stages=stages,
                microbatches=microbatches,
                steps=steps,
                warmup_steps=warm,
                policies=names,
                hint=hint,
                memory_factor=memory_factor,
                jitter=jitter,
                tp=tp,
                seed=seed,
                trace_step=traced,
                on_progress=on_progress,
                log_format=fmt,
                log_level=level,
            )
        except RRFPError as e:
            raise click.ClickException(str(e)) from e
    out = Path(out_dir)
    cfg = res["config"]
    tokens = statistics.mean(sum(m.tokens for m in b) for b in cfg.batches()[warm:])
    t = Table(
        title="one training step, median over timed steps (slowest rank, from a common barrier)",
        title_justify="left",
    )
    for c in (
        "policy",
        "step ms",
        "samples/s",
        "tokens/s",
        "bubble",
        "peak in-flight",
        "deviations",
        "speedup",
    ):
        t.add_column(c, justify="left" if c == "policy" else "right")
    panels = []
    base = res["policies"][names[0]]["median_s"]
    for n in names:
        r = res["policies"][n]
        step, data = r["median_s"], r["trace"]
        write_trace(
            out / f"trace_{n}.json",
            chrome_trace(
                data,
                clock="real",
                emulated=True,
                policy=n,
                hint=hint,
                title=f"demo step {traced}: CPU compute + emulated GPU time",
            ),
        )
        panels.append((n, data))
        t.add_row(
            n,
            f"{step * 1e3:.1f}",
            f"{microbatches / step:.1f}",
            f"{tokens / step:.0f}",
            f"{summarize(data)['bubble_ratio']:.1%}",
            str(r["peak_inflight"]),
            str(r["deviations"]),
            f"{base / step:.3f}x",
        )
    png = render_png(
        panels,
        out / "timeline.png",
        title=f"demo step {traced}, {stages * tp} processes: real CPU compute + EMULATED GPU time",
    )
    console.print(t)
    console.print(
        f"traces: {', '.join(str(out / f'trace_{n}.json') for n in names)}"
        " (open in ui.perfetto.dev or chrome://tracing)"
    )
    console.print(f"timeline: {png}  (total {res['wall_s']:.1f} s, spawn included)")


def _policy_names(given: tuple[str, ...], default: list[str]) -> list[str]:
    """The policies to compare (``default`` when none given); unknown names are refused."""
    names = list(given) or default
    known = available_policies()
    for n in names:
        if n not in known:
            raise click.BadParameter(
                f"unknown policy {n!r}; choose from {known}", param_hint="--policy"
            )
    return names


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
