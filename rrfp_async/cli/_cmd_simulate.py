"""``rrfp-async simulate``: one step under several policies on virtual time, compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from ..policies import HINTS

if TYPE_CHECKING:
    from ..sim import SimResult
from ._options import (
    chunks_option,
    hint_option,
    jitter_option,
    json_option,
    latency_option,
    log_choice,
    log_options,
    memory_budget_option,
    memory_factor_option,
    microbatches_option,
    png_option,
    policy_names,
    policy_option,
    seed_option,
    stages_option,
)
from ._output import console, require_plot_extra, table

__all__ = ["simulate_cmd"]


@click.command("simulate")
@stages_option(help_text="Pipeline ranks P.")
@microbatches_option(help_text="Microbatches M.")
@chunks_option()
@hint_option(f"Hint: {', '.join(sorted(HINTS))} (or an alias: bf, bfw, interleaved).")
@policy_option("Policy to compare (repeatable). Default: strict and readiness_first.")
@memory_budget_option(
    help_text="Activation byte budget per rank: a factor of what strict 1F1B holds on these"
    " microbatches (1.5), or bytes (24GiB). Default: 1.0, the same bytes (a microbatch's"
    " tokens are its bytes)."
)
@memory_factor_option(
    help_text="Bound the count of activations instead of bytes: a scale of 1F1B's in-flight count."
)
@click.option(
    "--workload",
    type=click.Choice(["uniform", "text", "multimodal"]),
    default="uniform",
    show_default=True,
)
@jitter_option(0.0, "Sigma of the lognormal compute noise.")
@latency_option(0.0, "Mean message latency, seconds.")
@click.option(
    "--split-backward/--no-split-backward",
    default=None,
    help="Split backwards into I and W (default: only for zb_h1).",
)
@seed_option
@json_option("Print JSON instead of a table.")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a Chrome/Perfetto trace per policy (FILE, or FILE with .POLICY"
    " before the extension when several policies run).",
)
@png_option("Write a PNG timeline, one panel per policy.")
@log_options
def simulate_cmd(
    stages: int,
    microbatches: int,
    chunks: int,
    hint: str,
    policies: tuple[str, ...],
    memory_budget: float | int | None,
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
    declared GPU cost model; nothing is measured on the host it runs on.
    """
    from ..observability import LogObserver
    from ..sim import simulate

    if png_path is not None:
        require_plot_extra()
    names = policy_names(policies, ["strict", "readiness_first"])
    record = trace_path is not None or png_path is not None
    fmt, _ = log_choice()
    results: dict[str, SimResult] = {
        n: simulate(
            observer=LogObserver() if fmt is not None else None,
            record=record,
            stages=stages,
            microbatches=microbatches,
            chunks=chunks,
            hint=hint,
            policy=n,
            memory_factor=memory_factor,
            memory_budget=memory_budget,
            workload=workload,
            jitter=jitter,
            latency=latency,
            split_backward=split_backward,
            seed=seed,
        )
        for n in names
    }
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
                "memory_budget": memory_budget,
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
    con = console()
    title = (
        f"{stages} stages x {microbatches} microbatches, chunks {chunks}, hint"
        f" {results[base].hint}, workload {workload}, jitter {jitter}"
        f" (simulated, virtual time)"
    )
    con.print(_comparison_table(results, base, title))
    if len(names) >= 2:
        a, b = results[names[0]], results[names[1]]
        con.print(
            f"{names[0]} / {names[1]} makespan ratio: [bold]{a.makespan / b.makespan:.3f}x[/bold]"
            f"   efficiency {a.efficiency:.3f} vs {b.efficiency:.3f}"
        )
    for w in written:
        con.print(f"wrote {w}", markup=False, highlight=False, soft_wrap=True)


def _comparison_table(results: dict[str, SimResult], base: str, title: str) -> Table:
    t = table(
        title,
        (
            "policy",
            "makespan\ns",
            "bound\ns",
            "eff.",
            "speedup",
            "peak",
            "bytes vs\n1F1B",
            "devs",
            "wall\ns",
        ),
        left={"policy"},
        whole={"policy"},
    )
    b = results[base].makespan
    for name, r in results.items():
        t.add_row(
            name,
            f"{r.makespan:.4f}",
            f"{r.lower_bound:.4f}",
            f"{r.efficiency:.3f}",
            f"{b / r.makespan:.3f}x",
            str(max(r.peak_inflight)),
            f"{r.memory_ratio:.2f}x",
            str(sum(r.deviations)),
            f"{r.wall_time:.3f}",
        )
    t.caption = (
        f"speedup: vs {base}; bound: critical path / busiest rank lower bound; eff.: bound /"
        " makespan; peak: most"
        " activations in flight on any rank; bytes vs 1F1B: the largest rank's peak"
        " activation bytes over what strict 1F1B holds on the same microbatches; devs:"
        " decisions off the hint order"
    )
    return t


def _policy_path(path: str, policy: str, several: bool) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}.{policy}{p.suffix}") if several else p


def _write_outputs(
    results: dict[str, SimResult], trace_path: str | None, png_path: str | None, title: str
) -> list[str]:
    from ..observability import render_png, write_trace

    written: list[str] = []
    several = len(results) > 1
    if trace_path is not None:
        for n, r in results.items():
            written.append(str(write_trace(_policy_path(trace_path, n, several), r.chrome_trace())))
    if png_path is not None:
        panels = [(n, r.trace) for n, r in results.items() if r.trace is not None]
        written.append(str(render_png(panels, png_path, title=title)))
    return written
