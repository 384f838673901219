"""``rrfp-async trace``: summarise a written trace (or merge per-rank trace files into one
timeline first) and render its timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .._errors import TraceError
from ._options import json_option, log_options, png_option
from ._output import console, require_plot_extra, table

__all__ = ["trace_cmd"]


@click.command("trace")
@click.argument("files", nargs=-1, required=True)
@click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the (merged) Chrome / Perfetto trace there.",
)
@png_option("Render the trace's timeline to this PNG.")
@json_option("Print the summary as JSON.")
@log_options
def trace_cmd(files: tuple[str, ...], out: str | None, png_path: str | None, as_json: bool) -> None:
    """Summarise a trace (per-rank busy / idle, bubble ratio, deviations) and render it.

    FILES: one trace file, or the per-rank files of a multi-process run (rank0.json
    rank1.json ..., a glob such as 'out/rank*.json', or the directory that holds them),
    merged into one timeline: messages joined across files, one clock.
    """
    from ..observability import (
        load_trace,
        merge_trace_files,
        render_png,
        stalls,
        summarize,
        trace_files,
        write_trace,
    )

    if png_path is not None:
        # --png asks for that file: without its extra the command fails before it writes
        # anything (not a note and exit 0 with no PNG, which a script takes for success).
        require_plot_extra()
    try:
        paths = trace_files(files)
    except TraceError as e:  # an argument that names no file: a usage error (exit code 2)
        raise click.BadParameter(str(e), param_hint="FILES") from None
    merged = None
    if len(paths) == 1:
        tr = load_trace(paths[0])  # not a trace, or one rank's part: TraceError
        name = str(paths[0])
    else:
        merged = merge_trace_files(paths)
        tr = merged.chrome_trace()
        name = f"{len(paths)} files merged"
    summ = summarize(tr)
    found = stalls(tr)
    states = _state_dumps(paths)
    meta = tr.get("otherData", {}).get("rrfp", {})
    if out is not None:
        write_trace(out, tr)
    if png_path is not None:
        render_png([(Path(name).name, tr)], png_path, title=_clock_title(meta))
    report = None
    if merged is not None:
        report = {
            "ranks": {str(r): str(p) for r, p in merged.ranks.items()},
            "alignment": merged.alignment,
            "causality_gap": merged.causality_gap,
            "dropped": list(merged.dropped),
        }
    if as_json:
        click.echo(
            json.dumps(
                {
                    "file": name if merged is None else None,
                    "files": [str(p) for p in paths],
                    "meta": {
                        k: meta.get(k) for k in ("clock", "emulated_gpu_time", "policy", "hint")
                    },
                    "merged": report,
                    "summary": summ,
                    "stalls": found,
                    "states": states,
                    "png": png_path,
                    "out": out,
                },
                indent=2,
                default=str,
                allow_nan=False,  # load_trace refused non-finite values: valid JSON only
            )
        )
        return
    con = console()
    if merged is not None:
        con.print(
            f"merged {len(paths)} files (ranks {', '.join(map(str, merged.ranks))});"
            f" clocks: {merged.alignment}"
        )
        if merged.causality_gap > 0:
            con.print(
                f"[yellow]clock offset of at least {merged.causality_gap * 1e3:.3f} ms:[/]"
                " a message seems to arrive that much before the task that produced it started"
            )
        if merged.dropped:
            con.print(
                f"note: {len(merged.dropped)} message(s) had one half only (a failed step's?),"
                " left out: " + "; ".join(merged.dropped[:5])
            )
    t = table(
        f"{name}: {_clock_title(meta)}; policy {meta.get('policy', '?')}, hint"
        f" {meta.get('hint', '?')}; makespan {summ['makespan'] * 1e3:.2f} ms",
        (
            "rank",
            "tasks",
            "busy ms",
            "idle ms",
            "bubble",
            "peak\nin-flight",
            "devi-\nations",
            "idle\nfilled ms",
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
    con.print(t)
    con.print(
        f"bubble ratio {summ['bubble_ratio']:.1%}, {summ['deviations']} deviations from"
        f" the hint filled {summ['filled'] * 1e3:.2f} ms of idle time"
    )
    _print_stalls(con, found)
    for fname, text in states.items():
        con.print(f"state dump {fname}:")
        con.print(text.rstrip(), markup=False, highlight=False)
    if out is not None:
        con.print(f"wrote {out}", markup=False, highlight=False, soft_wrap=True)
    if png_path is not None:
        con.print(f"wrote {png_path}", markup=False, highlight=False, soft_wrap=True)


#: How many waits the text output lists (all of them are in --json).
WAITS_SHOWN = 10


def _state_dumps(paths: list[Path]) -> dict[str, str]:
    """The ranks' state dumps (``state-rank{r}.txt``: SIGUSR1 or a step timeout, see
    ``DistributedStage.dump_state``) beside the trace files, in rank order."""
    import re

    found: dict[str, str] = {}
    for d in sorted({p.parent for p in paths}):
        files = [
            f for f in d.glob("state-rank*.txt") if re.fullmatch(r"state-rank\d+\.txt", f.name)
        ]
        for f in sorted(files, key=lambda f: int(f.name[10:-4])):
            try:
                found[str(f)] = f.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                found[str(f)] = f"(unreadable: {e})"
    return found


def _print_stalls(con: Any, found: dict[str, Any]) -> None:
    """The slow tasks with the tasks that waited for them, then the longest waits."""
    if found["slow"]:
        t = table(
            "slow tasks (over 2x their kind's median on their rank, out of its spread) and"
            " who waited for them",
            ("step", "rank", "task", "ms", "median ms", "waited for it (rank:task)"),
        )
        for s in found["slow"]:
            t.add_row(
                str(s["step"]),
                str(s["rank"]),
                s["task"],
                f"{s['seconds'] * 1e3:.2f}",
                f"{s['median'] * 1e3:.2f}",
                " ".join(s["waited_by"]) or "nobody",
            )
        con.print(t)
    else:
        con.print("no slow task (none over 2x its kind's median on its rank)")
    waits = sorted(found["waits"], key=lambda w: -w["seconds"])[:WAITS_SHOWN]
    if not waits:
        return
    t = table(
        f"longest waits ({len(waits)} of {len(found['waits'])}; root: the slow task at the"
        " end of the chain, '-' for the pipeline's own fill and drain)",
        ("step", "rank", "task", "idle ms", "waited for", "root"),
    )
    for w in waits:
        what = (
            f"{w['waited_for']} (rank {w['from_rank']})"
            if w["reason"] == "input"
            else "held (ready: policy, admission or TP leader)"
        )
        t.add_row(
            str(w["step"]),
            str(w["rank"]),
            w["task"],
            f"{w['seconds'] * 1e3:.2f}",
            what,
            w["root"] or "-",
        )
    con.print(t)


def _clock_title(meta: dict[str, Any]) -> str:
    if meta.get("clock") == "virtual":
        return "simulated (virtual time, declared cost model)"
    if meta.get("emulated_gpu_time"):
        return "real run: CPU compute + EMULATED GPU time"
    return "real run"
