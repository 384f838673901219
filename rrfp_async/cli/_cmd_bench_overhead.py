"""``rrfp-async bench overhead``: each overhead against its raw baseline, one table a section."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from rich.table import Table

from ._options import json_option, log_options, microbatches_option, policy_option, repeats_option
from ._output import console, table

__all__ = ["bench_overhead"]

_OVERHEAD_SECTIONS = ("decision", "message", "tp", "split")

Rows = list[dict[str, Any]]


@click.command("overhead")
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
@policy_option(
    "Policies for the decision latency (repeatable). Default: strict greedy readiness_first."
)
@click.option(
    "--loop",
    "loops",
    multiple=True,
    type=click.Choice(["uvloop", "asyncio"]),
    help="Event loops (repeatable). Default: both.",
)
@click.option(
    "--io",
    "ios",
    multiple=True,
    type=click.Choice(["per_edge", "shared"]),
    help="P2PChannel receive modes of the message section (repeatable). Default: both.",
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
@repeats_option(
    9, help_text="Timed steps per decision-latency case (I+W vs B: twice as many rounds)."
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
@microbatches_option(8, short=False, help_text="Microbatches of the I+W vs B measurement.")
@json_option("Print JSON instead of tables.")
@log_options
def bench_overhead(
    sections: tuple[str, ...],
    ready_sizes: tuple[int, ...],
    policies: tuple[str, ...],
    loops: tuple[str, ...],
    ios: tuple[str, ...],
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
    from ..bench import _overhead as ov

    chosen = [s for s in _OVERHEAD_SECTIONS if not sections or s in sections]
    loop_names = list(loops or ("uvloop", "asyncio"))
    out: dict[str, Rows] = {}
    if "decision" in chosen:
        out["decision"] = ov.decision_latency(
            ready_sizes or (1, 2, 4, 8, 16, 32, 64),
            policies=policies or ("strict", "greedy", "readiness_first"),
            loops=loop_names,
            repeats=repeats,
        )
    if "message" in chosen:
        out["message"] = ov.message_cost(
            sizes or (64, 16 * 1024, 1 << 20),
            messages=messages,
            loops=loop_names,
            ios=ios or ("per_edge", "shared"),
        )
    if "tp" in chosen:
        out["tp"] = ov.tp_coordination(tps or (2, 4), decisions=decisions, compute_ms=compute_ms)
    if "split" in chosen:
        out["split"] = ov.split_backward_cost_isolated(
            microbatches=microbatches, repeats=max(5, 2 * repeats)
        )
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    tables: dict[str, Callable[[Rows], Table]] = {
        "decision": lambda rows: _decision_table(rows, loop_names, repeats),
        "message": _message_table,
        "tp": lambda rows: _tp_table(rows, compute_ms),
        "split": _split_table,
    }
    con = console()
    for section, rows in out.items():
        con.print(tables[section](rows))


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _decision_table(rows: Rows, loop_names: list[str], repeats: int) -> Table:
    from ..bench._overhead import DECISION_TARGET_US

    cols = ["policy", "k", "mean k", *loop_names, "CPU"]
    cols += [f"{ln} +yield" for ln in loop_names] + ["worst / target", "target"]
    t = table(
        "decision latency (policy + stage bookkeeping, no compute), µs per decision,"
        f" median of {repeats} steps; target < {DECISION_TARGET_US:g} µs",
        cols,
        left={"policy"},
    )
    keys: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
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
            f"{worst / DECISION_TARGET_US:.2f}x",
            _verdict(worst < DECISION_TARGET_US),
        )
    t.caption = (
        "per decision = step wall time / decisions, one rank, k admitted ready tasks at every"
        " decision but the last k-1 (mean k: observed); CPU: the loop thread's CPU time per"
        " decision (no preemption); +yield: the executor yields to the loop once per task"
    )
    return t


def _message_table(rows: Rows) -> Table:
    from ..bench._overhead import MESSAGE_TARGET_RATIO

    t = table(
        "per message, one way (round trip / 2), µs, 2 processes, gloo on 127.0.0.1;"
        f" target P2PChannel <= {MESSAGE_TARGET_RATIO:g}x raw blocking send",
        (
            "bytes",
            "loop",
            "io",
            "raw send",
            "P2PChannel",
            "ratio",
            "target",
            "raw median",
            "channel median",
            "paired ratio",
            "machine",
        ),
        left={"loop", "io", "machine"},
    )
    for r in rows:
        t.add_row(
            str(r["bytes"]),
            r["loop"],
            r["io"] if r["per_handoff"] is None else f"{r['io']} ({r['per_handoff']:.2f}/wake)",
            f"{r['raw_us']:.1f}",
            f"{r['channel_us']:.1f}",
            f"{r['ratio']:.2f}x",
            _verdict(r["met"]),
            f"{r['raw_median_us']:.1f}",
            f"{r['channel_median_us']:.1f}",
            f"{r['ratio_paired']:.2f}x",
            "CONTENDED" if r["contended"] else "quiet",
        )
    t.caption = (
        "raw send, P2PChannel, ratio: lower decile of short interleaved batches (the"
        " batches no other process disturbed); paired ratio: median over batches of"
        " channel / the raw batch before it; CONTENDED: a median is over 3x its lower"
        " decile (other processes held the cores; rerun on a quiet machine); io: the"
        " channel's receive mode (shared: completions per wake-up of the loop)"
    )
    return t


def _tp_table(rows: Rows, compute_ms: float) -> Table:
    from ..bench._overhead import TP_SHARE_TARGET, TP_TARGET_RATIO

    t = table(
        "TP coordination per decision, µs, vs raw blocking broadcast of int64[6] on the"
        f" same group (uvloop); targets <= {TP_TARGET_RATIO:g}x and"
        f" < {TP_SHARE_TARGET:.0%} of step time with {compute_ms:g} ms tasks",
        (
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
        ),
        left={"machine"},
    )
    for r in rows:
        t.add_row(
            str(r["tp"]),
            f"{r['raw_us']:.1f}",
            f"{r['channel_us']:.1f}",
            f"{r['ratio']:.2f}x",
            _verdict(r["met_ratio"]),
            f"{r['ratio_paired']:.2f}x",
            f"{r['stage_us']:.1f}",
            f"{r['share']:.2%}",
            f"{r['share_measured']:.2%}",
            _verdict(r["met_share"]),
            "CONTENDED" if r["contended"] else "quiet",
        )
    t.caption = (
        "channel: DecisionChannel publish -> receive; slowest rank, lower decile of"
        " interleaved batches (paired: median of adjacent-batch ratios); in stage:"
        " (coordinated - uncoordinated step time) / decisions of a DistributedStage with"
        f" no-op tasks; share (formula) = channel / (channel + {compute_ms:g} ms), as if"
        " never overlapped with compute; share (measured, the target) = median over step"
        " pairs of (coordinated - uncoordinated) / coordinated step time, tasks sleeping"
        f" {compute_ms:g} ms on a compute thread (emulated GPU time)"
    )
    return t


def _split_table(rows: Rows) -> Table:
    from ..bench._overhead import SPLIT_TARGET_RATIO

    t = table(
        "I + W vs B, middle stage of the example model, real CPU compute (1 torch"
        f" thread, no emulated time), ms per step; target I+W <= {SPLIT_TARGET_RATIO:g}x B",
        (
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
        ),
        left={"source"},
    )
    for r in rows:
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
            _verdict(r["met"]),
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
    return t
