"""``rrfp-async trace``: summarise a written trace (or merge per-rank trace files into one
timeline first) and render its timeline.

It reads what a job that died left behind: a directory's newest step (a failed step's
``failed-rank*.json`` when they are newer than its ``rank*.json``), the survivors' files when
a rank's file is missing, a file cut short up to the cut. It then says which ranks are
missing or torn, shows the rest, and exits with :data:`PARTIAL_EXIT_CODE` (not 0), so that a
script can tell a partial picture from a whole one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape

from .._errors import TraceError
from ._options import json_option, log_options, png_option
from ._output import console, require_plot_extra, table

if TYPE_CHECKING:
    from ..observability import MergedTrace

__all__ = ["PARTIAL_EXIT_CODE", "trace_cmd"]

#: The exit code of ``rrfp-async trace`` when it rendered what it could read but a rank's
#: file was missing or cut short (torn): everything was printed and written, with warnings
#: that name the ranks and files. 0: every rank's file was there and whole; 1: an error,
#: nothing rendered; 2: a usage error.
PARTIAL_EXIT_CODE = 3


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
    rank1.json ..., a glob such as 'out/rank*.json', or the directory that holds them:
    its newest step, the failed step's failed-rank*.json when they are newer), merged into
    one timeline: messages joined across files, one clock. A rank whose file is missing or
    cut short is named, the rest shown, and the exit code is 3 (0: every file whole).
    """
    from ..observability import render_png, stalls, summarize, write_trace

    if png_path is not None:
        # --png asks for that file: without its extra the command fails before it writes
        # anything (not a note and exit 0 with no PNG, which a script takes for success).
        require_plot_extra()
    try:
        paths, chosen = _resolve(files)
    except TraceError as e:  # an argument that names no file: a usage error (exit code 2)
        raise click.BadParameter(str(e), param_hint="FILES") from None
    tr, merged = _read(paths)
    name = str(paths[0]) if len(paths) == 1 else f"{len(paths)} files merged"
    summ = summarize(tr)
    found = stalls(tr)
    states = _state_dumps(paths)
    meta = tr.get("otherData", {}).get("rrfp", {})
    if out is not None:
        write_trace(out, tr)
    if png_path is not None:
        render_png([(Path(name).name, tr)], png_path, title=_clock_title(meta))
    failures = _failures(meta)
    report = None
    if merged is not None:
        report = {
            "ranks": {str(r): str(p) for r, p in merged.ranks.items()},
            "alignment": merged.alignment,
            "causality_gap": merged.causality_gap,
            "dropped": list(merged.dropped),
            "missing": list(merged.missing),
            "torn": list(merged.torn),
        }
    missing, torn = _gaps(merged, meta)
    partial = bool(missing or torn)
    warnings = _warnings(missing, torn, paths[0].parent, merged is None)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "file": name if merged is None else None,
                    "files": [str(p) for p in paths],
                    "meta": {
                        k: meta.get(k) for k in ("clock", "emulated_gpu_time", "policy", "hint")
                    },
                    "chosen": chosen,
                    "merged": report,
                    "complete": not partial,
                    "failures": failures,
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
        for w in warnings:
            click.echo(f"warning: {w}", err=True)
        if partial:
            raise click.exceptions.Exit(PARTIAL_EXIT_CODE)
        return
    con = console()
    for note in chosen:
        con.print(note, markup=False, highlight=False)
    for w in warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    if merged is not None:
        count = f"{len(paths)} files" if len(paths) > 1 else "1 file"
        con.print(
            f"merged {count} (ranks {', '.join(map(str, merged.ranks))});"
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
    _print_failures(con, failures)
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
    if partial:
        raise click.exceptions.Exit(PARTIAL_EXIT_CODE)


def _resolve(files: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    """The files the arguments name (a directory: its newest step, ``newest_trace_files``)
    and a line per directory whose choice there was to make.

    Raises:
        TraceError: An argument names no file.
    """
    from ..observability import newest_trace_files, trace_files

    specs: list[str | Path] = []
    chosen: list[str] = []
    for spec in files:
        if Path(spec).is_dir():
            found, note = newest_trace_files(spec)
            specs.extend(found)
            if note:
                chosen.append(f"{spec}: {note}")
        else:
            specs.append(spec)
    return trace_files(specs), chosen


def _read(paths: list[Path]) -> tuple[dict[str, Any], MergedTrace | None]:
    """The trace to show: one whole file as it is, else the files merged with what is
    missing or torn named (``merge_trace_files(partial=True)``). One file that is a rank's
    part or cut short is merged alone; any other refusal of it stands."""
    from ..observability import load_trace, merge_trace_files

    if len(paths) > 1:
        merged = merge_trace_files(paths, partial=True)
        return merged.chrome_trace(), merged
    try:
        return load_trace(paths[0]), None
    except TraceError as e:
        try:
            merged = merge_trace_files(paths, partial=True)
        except TraceError:
            raise e from None
        if merged.complete:  # nothing missing or torn: its own refusal stands
            raise
        return merged.chrome_trace(), merged


def _gaps(merged: MergedTrace | None, meta: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The ranks whose files were missing and the files cut short: of this merge, or of the
    merge that wrote this file (``otherData.rrfp.merged``: a partial picture stays one)."""
    if merged is not None:
        return list(merged.missing), list(merged.torn)
    made = meta.get("merged")
    if not isinstance(made, dict):
        return [], []
    missing, torn = made.get("missing", []), made.get("torn", [])
    return (
        [r for r in missing if isinstance(r, int)] if isinstance(missing, list) else [],
        [t for t in torn if isinstance(t, str)] if isinstance(torn, list) else [],
    )


def _warnings(missing: list[int], torn: list[str], where: Path, written: bool) -> list[str]:
    """What to say of the ranks whose files were missing and of the files cut short
    (``written``: by the merge that wrote the file shown)."""
    out = []
    if missing:
        rs = ", ".join(map(str, missing))
        one = len(missing) == 1
        it, its = ("it", "its") if one else ("them", "their")
        if written:
            out.append(
                f"this trace was merged without the trace file{'' if one else 's'} of"
                f" rank{'' if one else 's'} {rs} (missing then): the halves of {its} messages"
                " are left out"
            )
        else:
            out.append(
                f"the trace file{'' if one else 's'} of rank{'' if one else 's'} {rs}"
                f" {'is' if one else 'are'} missing (named by the other files' messages or"
                f" pipeline): shown without {it}, the halves of {its} messages left out. If"
                f" {'it is' if one else 'they are'} elsewhere, name every rank's file (the"
                f" directory, or a glob such as '{where / 'rank*.json'}')"
            )
    when = " (when this trace was merged)" if written else ""
    out.extend(f"torn{when}: {t}" for t in torn)
    return out


def _failures(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's failed steps (``Failure`` rows; times in seconds from its start)."""
    keys = ("rank", "step", "time", "error", "message", "running")
    return [dict(zip(keys, row, strict=True)) for row in meta.get("failures", [])]


def _print_failures(con: Any, failures: list[dict[str, Any]]) -> None:
    """A line per rank on which the step failed, the tasks it had running then."""
    for f in failures:
        first = f["message"].splitlines()[0] if f["message"] else ""
        running = ", ".join(
            f"{t} (since {s * 1e3:.2f} ms)" for t, s in sorted(f["running"].items())
        )
        con.print(
            f"[red]rank {f['rank']}: step {f['step']} FAILED[/] at {f['time'] * 1e3:.2f} ms: "
            + escape(f"{f['error']}: {first}")
            + (f"; running then: {running}" if running else ""),
            highlight=False,
        )


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
