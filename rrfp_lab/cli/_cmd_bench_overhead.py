"""``rrfp-async bench overhead``: each overhead against its raw baseline, one table a section."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from rich.table import Table

from rrfp_async.cli import (
    console,
    json_option,
    log_options,
    microbatches_option,
    policy_option,
    repeats_option,
    table,
)

__all__ = ["bench_overhead"]

_OVERHEAD_SECTIONS = ("decision", "message", "tp", "split", "task")

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
    type=click.IntRange(min=1),
    help="TP sizes (repeatable; one process each). Default: 1 2 4 8.",
)
@click.option(
    "--tp-task-ms",
    "tp_tasks_ms",
    multiple=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Task lengths of the TP per-step figures (repeatable). Default: 1 5 20.",
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
@microbatches_option(
    8,
    short=False,
    help_text="Microbatches of the I+W vs B measurement (the task section: twice as many).",
)
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
    tp_tasks_ms: tuple[float, ...],
    repeats: int,
    messages: int,
    decisions: int,
    compute_ms: float,
    microbatches: int,
    as_json: bool,
) -> None:
    """Overheads in isolation, each against its raw baseline (ratios measured in one run)."""
    from .. import (
        decision_latency,
        message_cost,
        split_backward_cost_isolated,
        task_overhead_isolated,
        tp_coordination,
        tp_model,
    )

    chosen = [s for s in _OVERHEAD_SECTIONS if not sections or s in sections]
    loop_names = list(loops or ("uvloop", "asyncio"))
    out: dict[str, Any] = {}
    if "decision" in chosen:
        out["decision"] = decision_latency(
            ready_sizes or (1, 2, 4, 8, 16, 32, 64),
            policies=policies or ("strict", "greedy", "readiness_first"),
            loops=loop_names,
            repeats=repeats,
        )
    if "message" in chosen:
        out["message"] = message_cost(
            sizes or (64, 16 * 1024, 1 << 20),
            messages=messages,
            loops=loop_names,
            ios=ios or ("per_edge", "shared"),
        )
    if "tp" in chosen:
        out["tp"] = tp_coordination(
            tps or (1, 2, 4, 8),
            decisions=decisions,
            compute_ms=compute_ms,
            computes_ms=tp_tasks_ms or (1.0, 5.0, 20.0),
        )
        if len({r["tp"] for r in out["tp"]}) >= 2:
            out["tp_model"] = tp_model(out["tp"], task_ms=compute_ms)
    if "split" in chosen:
        out["split"] = split_backward_cost_isolated(
            microbatches=microbatches, repeats=max(5, 2 * repeats)
        )
    if "task" in chosen:
        out["task"] = task_overhead_isolated(microbatches=2 * microbatches)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    tables: dict[str, Callable[[Any], list[Table]]] = {
        "decision": lambda rows: [_decision_table(rows, loop_names, repeats)],
        "message": lambda rows: [_message_table(rows)],
        "tp": lambda rows: [_tp_table(rows, compute_ms), _tp_step_table(rows)],
        "tp_model": _tp_model_tables,
        "split": lambda rows: [_split_table(rows)],
        "task": lambda rows: [_task_table(rows)],
    }
    con = console()
    for section, rows in out.items():
        for t in tables[section](rows):
            con.print(t)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _decision_table(rows: Rows, loop_names: list[str], repeats: int) -> Table:
    from .. import DECISION_TARGET_US

    cols = ["policy", "k", "mean k", *loop_names, "CPU"]
    cols += [f"{ln} +yield" for ln in loop_names] + ["worst / target", "target"]
    t = table(
        "decision latency (policy + stage bookkeeping, no compute), µs per decision,"
        f" median of {repeats} steps; target < {DECISION_TARGET_US:g} µs",
        cols,
        left={"policy"},
        whole={"policy"},
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
    from .. import MESSAGE_TARGET_RATIO

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
    from .. import TP_SHARE_TARGET, TP_TARGET_RATIO

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
        if r["tp"] == 1:  # nothing to coordinate: the pairing's noise floor only
            t.add_row(
                "1", "-", "-", "-", "-", "-", f"{r['stage_us']:.1f}", "-",
                f"{r['share_measured']:.2%}", "(floor)", "-",
            )  # fmt: skip
            continue
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


def _tp_step_table(rows: Rows) -> Table:
    from .. import TP_STEP_SHARE_TARGET

    t = table(
        "TP coordination per step, µs (slowest rank, median over paired steps of 16"
        " decisions): the default (followers deduce; here every input is local, so every"
        " decision), every decision waited for (a task with an input message), and with the"
        " all-gather check, against no coordination; target at TP 8, 5 ms tasks:"
        f" < {TP_STEP_SHARE_TARGET:.0%}",
        (
            "TP",
            "task ms",
            "step ms (off)",
            "default: cost",
            "first task",
            "share",
            "waited: cost",
            "first task",
            "end of step",
            "decisions only",
            "share",
            "all-gather: cost",
            "share",
        ),
    )
    for r in rows:
        for p in r["steps"]:
            t.add_row(
                str(r["tp"]),
                f"{p['compute_ms']:g}",
                f"{p['step_off_ms']:.1f}",
                f"{p['cost_us']:.0f}",
                f"{p['first_delay_us']:.0f}",
                f"{p['share']:.2%}",
                f"{p['wait_cost_us']:.0f}",
                f"{p['wait_first_us']:.0f}",
                f"{p['wait_end_us']:.0f}",
                f"{p['decisions_cost_us']:.0f}",
                f"{p['wait_share']:.2%}",
                f"{p['gather_cost_us']:.0f}",
                f"{p['gather_share']:.2%}",
            )
    t.caption = (
        "five DistributedStages side by side, steps alternating (order rotating): no"
        " coordination; decisions only; decisions + all-gather check (fold_tp_check=False);"
        " decisions + folded check, every decision waited for (deduce_tp=False); the"
        " default (deduced decisions start at once). cost = step time - no coordination's;"
        " first task: when the first task started; end of step: after the last task;"
        " share = cost / step time; TP 1: the pairing's noise floor"
    )
    return t


def _tp_model_tables(model: dict[str, Any]) -> list[Table]:
    from .. import TP_MODEL_TOLERANCE

    t = table(
        "TP coordination model: a + b x f(tp), f = log2(tp) or tp - 1 (least squares, the"
        " smaller residual chosen), µs; leave-one-out: fit on the other TP sizes, predict"
        f" this one (target within {TP_MODEL_TOLERANCE:.0%} at TP 2/4/8); long tasks: of"
        f" {model['task_ms']:g} ms and longer",
        (
            "term",
            "form",
            "a",
            "b",
            "rms residual",
            "other form",
            "measured (tp: µs)",
            "leave-one-out (tp: predicted, error)",
            "target",
            "predicted TP 16 / 32",
        ),
        left={"term", "measured (tp: µs)", "leave-one-out (tp: predicted, error)"},
    )
    for term in model["terms"]:
        pred = term["predicted"]
        t.add_row(
            term["name"],
            term["form"],
            f"{term['a_us']:.0f}",
            f"{term['b_us']:.0f}",
            f"{term['residual_us']:.0f}",
            f"{term['other_form']} ({term['other_residual_us']:.0f})"
            if term["other_form"]
            else "-",
            ", ".join(f"{tp}: {v:.0f}" for tp, v in term["measured"].items()),
            ", ".join(
                f"{x['tp']}: {x['predicted_us']:.0f} ("
                + ("-" if x["error"] is None else f"{x['error']:+.0%}")
                + ")"
                for x in term["loo"]
            ),
            _verdict(term["met_loo"]) if term["loo"] else "-",
            " / ".join(f"{v:.0f}" for v in pred.values()),
        )
    s = table(
        "TP coordination per step as a share of step time, from the fitted per-step total"
        f" (tasks of {model['task_ms']:g} ms; 16 decisions: the benchmark's step; 256: one"
        " stage of M = 128 at paper scale)",
        ("TP", "decisions", "step ms", "cost µs", "share", "source"),
    )
    for x in model["share"]:
        s.add_row(
            str(x["tp"]),
            str(x["decisions"]),
            f"{x['step_ms']:.0f}",
            f"{x['cost_us']:.0f}",
            f"{x['share']:.2%}",
            "fit (measured TP)" if x["measured"] else "prediction",
        )
    return [t, s]


def _split_table(rows: Rows) -> Table:
    from .. import SPLIT_TARGET_RATIO

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


def _task_table(rows: Rows) -> Table:
    t = table(
        "per task: one stage, one process, real compute; ours (DistributedStage +"
        " TorchStageExecutor) vs torch Schedule1F1B on the same module",
        (
            "device",
            "mbs",
            "compute ms",
            "ours ms",
            "Schedule1F1B ms",
            "idle/task ours µs",
            "idle/task torch µs",
            "hand-offs/task",
            "losses agree",
        ),
        left={"device"},
    )
    for r in rows:
        t.add_row(
            r["device"],
            str(r["microbatches"]),
            f"{r['compute_ms']:.2f}",
            f"{r['ours_ms']:.2f}",
            f"{r['torch_ms']:.2f}",
            f"{r['idle_ours_us']:.1f}",
            f"{r['idle_torch_us']:.1f}",
            f"{r['handoffs_per_task']:.2f}",
            "yes" if r["losses_agree"] else "NO",
        )
    t.caption = (
        "compute: the same forwards and backwards back to back, no scheduler; idle per task"
        " = (step - compute) / tasks (on a GPU: the device waiting for the host); hand-offs:"
        " thread hand-offs of the stage's ComputeWorker per task (loop -> compute thread ->"
        " loop; on CUDA tasks end when their kernels are enqueued, no event wait per task)"
    )
    return t
