"""``rrfp-async demo``: train the example model through a local multi-process pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from rrfp_async.cli import (
    console,
    hint_option,
    jitter_option,
    log_choice,
    log_options,
    memory_budget_option,
    memory_factor_option,
    microbatches_option,
    optional_png,
    policy_names,
    policy_option,
    progress,
    seed_option,
    speedup_table,
    stages_option,
    steps_option,
    table,
    tp_option,
)

__all__ = ["demo_cmd"]


@click.command("demo")
@stages_option(4, minimum=2)
@microbatches_option(16)
@steps_option(10, "Timed steps per policy (after one warm-up step; the verdict needs >= 6).")
@tp_option()
@hint_option()
@policy_option(
    "Policy to compare (repeatable); POLICY@HINT runs it on another hint. Default:"
    " strict@1f1b (the fixed order torch and Megatron run), strict (the hint in order),"
    " readiness_first."
)
@memory_budget_option(
    1.0,
    "Activation byte budget per rank: a factor of what strict 1F1B holds on each step's"
    " microbatches (1.0: the same bytes), or bytes (24GiB). A microbatch's tokens are its"
    " declared bytes.",
)
@memory_factor_option(
    None, "Bound the count of activations instead of bytes (a multiple of 1F1B's count)."
)
@jitter_option()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="out/demo",
    show_default=True,
    help="Where traces and the PNG go.",
)
@seed_option
@log_options
def demo_cmd(
    stages: int,
    microbatches: int,
    steps: int,
    tp: int,
    hint: str,
    policies: tuple[str, ...],
    memory_budget: float | int,
    memory_factor: float | None,
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
    # Lazy, so that --help stays fast: the harness imports torch.
    from rrfp_async.observability import chrome_trace, render_png, summarize, write_trace

    from .. import pipeline_step_times

    names = policy_names(policies, ["strict@1f1b", "strict", "readiness_first"], with_hint=True)
    fmt, level = log_choice()
    warm = 1
    traced = warm + steps - 1
    con = console()
    con.print(
        f"[bold]rrfp-async demo[/bold]: {stages * tp} processes (PP={stages}, TP={tp}),"
        f" {microbatches} microbatches/step, hint {hint}, "
        + (
            f"admission x{memory_factor:g} of 1F1B's count of activations;"
            if memory_factor is not None
            else f"activation bytes within {memory_budget:g}x what strict 1F1B holds;"
            if isinstance(memory_budget, float)
            else f"activation bytes within {memory_budget} B per rank;"
        )
        + " time = real CPU compute + EMULATED GPU time"
    )
    # On stderr: a bar on a terminal, a line per step through a pipe (stdout: the tables).
    with progress(len(names) * (warm + steps)) as update:
        update("starting processes", False)

        def on_progress(msg: Any) -> None:
            policy, step = msg
            update(f"{policy}: step {step}", True)

        res = pipeline_step_times(
            stages=stages,
            microbatches=microbatches,
            steps=steps,
            warmup_steps=warm,
            policies=names,
            hint=hint,
            memory_factor=memory_factor,
            memory_budget=None if memory_factor is not None else memory_budget,
            jitter=jitter,
            tp=tp,
            seed=seed,
            trace_step=traced,
            on_progress=on_progress,
            log_format=fmt,
            log_level=level,
            measure_activations=True,
        )
    out = Path(out_dir)
    base = names[0]
    over = f"{steps} timed step{'s' if steps != 1 else ''}"
    behaviour = table(
        f"what each policy did, over the {over} and in step {traced} alone (the traced"
        " step: the traces and the PNG)",
        (
            "policy",
            f"deviations\n(total of\n{steps}; step\n{traced})",
            f"bytes vs\n1F1B\n(max of {steps})",
            f"measured\nvs {base}\n(max of {steps})",
            f"bubble\n(step {traced})",
        ),
        left={"policy"},
        whole={"policy"},
    )
    behaviour.caption = (
        "bytes vs 1F1B: the most activation bytes a rank held, as its ledger counts them"
        " (learned from the measured bytes once fitted), over what strict 1F1B holds on the"
        f" same microbatches; measured: the saved-tensor meter's, over {base}'s"
    )
    panels = []
    for n in names:
        r = res["policies"][n]
        data = r["trace"]
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
        one = summarize(data)
        behaviour.add_row(
            n,
            f"{r['deviations']}; {one['deviations']}",
            "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x",
            "-" if r["measured_ratio"] is None else f"{r['measured_ratio']:.2f}x",
            f"{one['bubble_ratio']:.1%}",
        )
    timing = speedup_table(
        f"timing over {over}; speedup = {base}'s step i / the policy's step i (the same"
        " microbatches and"
        " emulated noise), median and min–max over the paired steps",
        [(n, res["policies"][n]["median_s"], res["policies"][n]["vs_first"]) for n in names],
        steps=steps,
        microbatches=microbatches,
        base=base,
    )
    con.print(timing)
    con.print()
    con.print(behaviour)
    con.print(
        f"traces: {', '.join(str(out / f'trace_{n}.json') for n in names)}"
        " (open in ui.perfetto.dev or chrome://tracing)"
    )
    # Last, after every table: a plain install (no matplotlib) keeps the results.
    png = optional_png(
        lambda: render_png(
            panels,
            out / "timeline.png",
            title=(
                f"demo step {traced}, {stages * tp} processes: real CPU compute + EMULATED GPU time"
            ),
        )
    )
    if png is not None:
        con.print(f"timeline: {png}")
    con.print(f"total {res['wall_s']:.1f} s, spawn included")
