"""``rrfp-async bench peer``: side by side with torch.distributed.pipelining."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from rrfp_async.cli import (
    console,
    hint_option,
    jitter_option,
    json_option,
    latency_option,
    log_options,
    memory_factor_option,
    microbatches_option,
    policy_names,
    policy_option,
    progress,
    seed_option,
    stages_option,
    steps_option,
    table,
)

__all__ = ["bench_peer"]


@click.command("peer")
@stages_option(4, minimum=2)
@microbatches_option(16)
@steps_option(7)
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
@jitter_option()
@seed_option
@click.option(
    "--torch-schedule",
    "torch_schedules",
    multiple=True,
    help="torch schedule (repeatable): torch's short name, as get_schedule_class takes it"
    " (1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,"
    " DualPipeV; any case), or the class name (Schedule1F1B). Default: 1F1B, GPipe,"
    " Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble.",
)
@hint_option("rrfp_async hint (repeatable).", repeatable=True)
@click.option(
    "--dropin-hint",
    "dropin_hints",
    multiple=True,
    help="Hint of the drop-in rows (torch's PipelineStage stepped by"
    " rr.pipelining.ScheduleReadinessFirst; repeatable): an rrfp_async hint, or torch:<schedule>"
    " (torch:Interleaved1F1B, torch:ZBVZeroBubble, torch:DualPipeV) for torch's order on its"
    " own placement, also paired with that torch schedule; or default (the drop-in with no"
    " argument: sizes read off the microbatches, bytes and task times learned from the run,"
    " --memory-factor as a byte budget over 1F1B's measured bytes); or sizes (the same, given"
    " each step's sizes by sizes=). Default: breadth_first_weighted.",
)
@click.option(
    "--workload",
    type=click.Choice(["multimodal", "uniform"]),
    default="multimodal",
    show_default=True,
    help="multimodal: variable-length microbatches; uniform: every microbatch of a step the"
    " step's mean length (the same total work).",
)
@policy_option("rrfp_async policy (repeatable).")
@memory_factor_option(
    help_text="Admission bound as a multiple of 1F1B's (repeatable). Default: 1 and 2.",
    repeatable=True,
)
@click.option(
    "--meter/--no-meter",
    default=True,
    show_default=True,
    help="Measure every row's activation bytes on every step (the saved-tensor meter, on"
    " for all rows alike); --no-meter: no bytes, and no meter's cost in any row's time.",
)
@click.option(
    "--simulated",
    is_flag=True,
    help="Instead: the same steps in the simulator (virtual time, no host cost), with a"
    " simulation-guided hint and an oracle; --latency sets the message latency.",
)
@latency_option(0.0007)
@click.option(
    "--host-time",
    is_flag=True,
    help="Instead: the stage module's host time per task beyond its emulated time (one"
    " process), and the efficiency it alone caps any runtime at.",
)
@json_option("Print {'runs': [...]} as JSON.")
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
    dropin_hints: tuple[str, ...],
    workload: str,
    policies: tuple[str, ...],
    memory_factors: tuple[float, ...],
    meter: bool,
    simulated: bool,
    latency: float,
    host_time: bool,
    as_json: bool,
) -> None:
    """Side by side with torch.distributed.pipelining: same modules, same microbatches.

    Real processes on gloo (127.0.0.1), real CPU compute plus EMULATED GPU time (each stage
    sleeps a declared, seeded duration per token), configurations interleaved step by step.
    """
    from .. import PeerConfig, resolve_torch_schedule

    base = PeerConfig()
    try:
        torch_schedules = tuple(resolve_torch_schedule(n) for n in torch_schedules)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--torch-schedule'") from e
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
                dropin_hints=dropin_hints or base.dropin_hints,
                workload=workload,
                policies=tuple(policy_names(policies, list(base.policies))),
                memory_factors=memory_factors or base.memory_factors,
                meter=meter,
            )
            for us in (scales or (2.0, 8.0))
        ]
    except ValueError as e:
        # PeerConfig validates the options together (a torch schedule it does not know): a
        # usage error, exit code 2, not a failed run.
        raise click.BadParameter(str(e)) from e
    if simulated:
        _peer_simulated(cfgs, latency, as_json)
        return
    if host_time:
        _peer_host_time(cfgs, as_json)
        return
    from .. import peer_benchmark

    results = []
    per_run = cfgs[0].warmup_steps + cfgs[0].steps
    with progress(len(cfgs) * per_run, enabled=not as_json) as update:
        for cfg in cfgs:
            name = f"{cfg.us_per_token:g} µs/token"
            update(f"{name}: starting {cfg.stages} processes", False)

            def on_step(s: Any, name: str = name, w: int = cfg.warmup_steps) -> None:
                what = "warm-up" if s < w else "every configuration"
                update(f"{name}: step {s + 1}/{per_run} done ({what})", True)

            results.append(peer_benchmark(cfg, on_progress=on_step))
    from rrfp_async.observability import paired_ratio

    if as_json:
        runs = [
            dict(r, us_per_token=res["config"].us_per_token) for res in results for r in res["runs"]
        ]
        click.echo(json.dumps({"runs": runs}, indent=2, default=str))
        return
    con = console()
    for res in results:
        cfg = res["config"]
        t = table(
            f"{cfg.stages} gloo processes on 127.0.0.1, {cfg.microbatches} {cfg.workload}"
            f" microbatches, {cfg.us_per_token:g} µs/token: real CPU compute + EMULATED GPU"
            f" time (jitter {cfg.jitter}); {cfg.steps} timed steps after {cfg.warmup_steps}"
            f" warm-up, configurations interleaved step by step; comm share"
            f" {res['comm_share']:.0%} of a mean task",
            (
                "configuration",
                f"step s\n(median\nof {cfg.steps})",
                "vs torch\n1F1B\n(median,\nmin–max)",
                "effic.",
                "peak\nMiB",
                "bytes\nvs\n1F1B",
                "note",
            ),
            left={"configuration", "note"},
        )
        base_steps = next(
            (
                r["steps_s"]
                for r in res["runs"]
                if r["system"] == "torch" and r["schedule"] == "Schedule1F1B" and not r["note"]
            ),
            None,
        )
        cells: list[tuple[str, ...]] = []
        # Fastest first; a NaN speedup (a run that did not finish) sorts as 0.
        for r in sorted(
            res["runs"],
            key=lambda r: (
                -r["speedup_vs_torch_1f1b"]
                if r["speedup_vs_torch_1f1b"] == r["speedup_vs_torch_1f1b"]
                else 0
            ),
        ):
            vs = f"{r['speedup_vs_torch_1f1b']:.2f}x"
            if base_steps and r["steps_s"] and r["steps_s"] is not base_steps:
                # The same pairing as speedup_vs_torch_1f1b (step by step), with its spread.
                paired = paired_ratio(base_steps, r["steps_s"])
                # The verdict where it is no finding ("within noise", "too few steps").
                vs += f"\n{paired.spread}" + (f"\n{paired.verdict}" if paired.within_noise else "")
            name = (r["schedule"] or r["hint"]).replace("breadth_first_weighted", "bfw")
            memory = f"{r['memory_factor']:g}x" if r["memory_factor"] else ""
            cells.append(
                (
                    " ".join(
                        x
                        for x in (r["system"], name.removeprefix("Schedule"), r["policy"], memory)
                        if x
                    ),
                    f"{r['step_s']:.4f}",
                    vs,
                    f"{r['efficiency']:.2f}",
                    *_bytes_cells(r),
                    "; ".join(
                        x
                        for x in (
                            r["note"],
                            f"{r['speedup_vs_same_torch']:.2f}x torch's own"
                            if r.get("speedup_vs_same_torch") == r.get("speedup_vs_same_torch")
                            and r.get("speedup_vs_same_torch") is not None
                            else "",
                        )
                        if x
                    ),
                )
            )
        _fit_numbers(t, cells, con.width)
        t.caption = (
            f"configuration: system, torch schedule or rrfp_async hint, policy, admission bound"
            f" (x 1F1B's); vs torch 1F1B: median and min–max of torch Schedule1F1B's step i /"
            f" the row's step i; effic. = lower bound (emulated durations only) / step;"
            f" losses of every configuration equal torch's within {res['loss_max_diff']:.1e}; bfw ="
            " breadth_first_weighted; ':split' = split backward (I/W); drop-in = torch's"
            " PipelineStage stepped by rr.pipelining.ScheduleReadinessFirst, 'x native' = its"
            " step time paired with the rrfp_async row of the same hint, policy and memory;"
            " drop-in torch:<schedule> = torch's order as the hint on its placement, 'x torch's"
            " own' = that torch schedule's step i / the row's step i, median; "
            + (
                "peak MiB: the most activation bytes any rank held in a timed step, measured"
                " on every step of every row by the saved-tensor meter (its cost in every"
                " row's time alike), torch's on its padded inputs; bytes vs 1F1B: the row's"
                " peak / torch Schedule1F1B's; (in parentheses) on the real lengths: torch's"
                " order replayed on them, / torch 1F1B's order on them; a row of 2 chunks per"
                " rank counts half of what its modules measured (each stands for half the"
                " rank's model)"
                if cfg.meter
                else "no bytes measured (--no-meter)"
            )
        )
        con.print(t)


def _fit_numbers(t: Any, cells: list[tuple[str, ...]], width: int) -> None:
    """Add the rows, the numbers' columns as wide as their figures (a long verdict below a
    ratio wraps); at ``width`` columns the configuration keeps a policy's name whole
    (readiness_first) and the note narrows first."""
    for i in range(1, len(t.columns) - 1):
        # A figure, its spread, a short verdict ("within noise") on one line; longer wrap.
        lines = [ln for c in cells for ln in c[i].splitlines() if len(ln) <= 12]
        words = [w for h in str(t.columns[i].header).splitlines() for w in h.split()]
        t.columns[i].width = max(map(len, lines + words))
    fixed = sum(c.width for c in t.columns[1:-1]) + 3 * len(t.columns) + 1
    room = width - fixed
    natural = [max(len(c[i]) for c in cells) for i in (0, -1)] if cells else [0, 0]
    if sum(natural) > room:  # rich would narrow both alike; the configuration first here
        words = [w for c in cells for w in c[-1].split()] or ["note"]
        note = max(max(map(len, words)), room - natural[0])
        t.columns[0].width = max(len("readiness_first"), room - note)
        t.columns[-1].width = max(1, room - t.columns[0].width)
    for c in cells:
        t.add_row(*c)


def _bytes_cells(r: dict[str, Any]) -> tuple[str, str]:
    """The row's peak bytes (MiB) and its ratio to torch 1F1B's, each with its figure on the
    real lengths in parentheses where there is one; a dash where nothing was measured."""
    if r.get("peak_bytes") is None:
        return "–", "–"
    peak = f"{r['peak_bytes'] / 2**20:.2f}"
    if r.get("real_bytes") is not None:
        peak += f"\n({r['real_bytes'] / 2**20:.2f})"
    ratio, real = r.get("bytes_vs_torch_1f1b", math.nan), r.get("bytes_vs_torch_1f1b_real")
    cell = f"{ratio:.2f}x" if math.isfinite(ratio) else "–"
    if real is not None and math.isfinite(real):
        cell += f"\n({real:.2f}x)"
    return peak, cell


def _peer_host_time(cfgs: list[Any], as_json: bool) -> None:
    from .. import module_host_time

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


def _peer_simulated(cfgs: list[Any], latency: float, as_json: bool) -> None:
    from .. import peer_simulated

    out = [
        {"us_per_token": cfg.us_per_token, **row}
        for cfg in cfgs
        for row in peer_simulated(cfg, latency=latency)
    ]
    if as_json:
        click.echo(json.dumps({"simulated": out}, indent=2))
        return
    t = table(
        f"the peer benchmark's steps simulated (virtual time, declared cost model, no"
        f" host cost, message latency {latency * 1e3:g} ms): median over the steps",
        ("µs/token", "configuration", "vs strict 1F1B", "efficiency"),
        left={"configuration"},
    )
    for r in out:
        t.add_row(
            f"{r['us_per_token']:g}",
            r["configuration"],
            f"{r['vs_strict_1f1b']:.2f}x",
            f"{r['efficiency']:.2f}",
        )
    console().print(t)
