"""``rrfp-async trace``: summarise a written trace and render its timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..observability import load_trace, render_png, summarize
from ._options import json_option, log_options, png_option
from ._output import console, table

__all__ = ["trace_cmd"]


@click.command("trace")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@png_option("Render the trace's timeline to this PNG.")
@json_option("Print the summary as JSON.")
@log_options
def trace_cmd(file: str, png_path: str | None, as_json: bool) -> None:
    """Summarise a trace (per-rank busy / idle, bubble ratio, deviations) and render it."""
    tr = load_trace(file)  # a file that is not a trace: TraceError, printed as "Error: ..."
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
                allow_nan=False,  # load_trace refused non-finite values: valid JSON only
            )
        )
        return
    t = table(
        f"{file}: {_clock_title(meta)}; policy {meta.get('policy', '?')}, hint"
        f" {meta.get('hint', '?')}; makespan {summ['makespan'] * 1e3:.2f} ms",
        (
            "rank",
            "tasks",
            "busy ms",
            "idle ms",
            "bubble",
            "peak in-flight",
            "deviations",
            "idle filled ms",
        ),
    )
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
    con = console()
    con.print(t)
    con.print(
        f"bubble ratio {summ['bubble_ratio']:.1%}, {summ['deviations']} deviations from"
        f" the hint filled {summ['filled'] * 1e3:.2f} ms of idle time"
    )
    if png_path is not None:
        con.print(f"wrote {png_path}")


def _clock_title(meta: dict[str, Any]) -> str:
    if meta.get("clock") == "virtual":
        return "simulated (virtual time, declared cost model)"
    if meta.get("emulated_gpu_time"):
        return "real run: CPU compute + EMULATED GPU time"
    return "real run"
