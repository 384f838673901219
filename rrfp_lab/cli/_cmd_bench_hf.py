"""``rrfp-async bench hf``: a Hugging Face model side by side with torch pipelining."""

from __future__ import annotations

import json
from typing import Any

import click

from rrfp_async.cli import (
    console,
    json_option,
    log_options,
    microbatches_option,
    seed_option,
    steps_option,
    table,
)

__all__ = ["bench_hf"]


@click.command("hf")
@click.option(
    "--model", type=click.Choice(["gpt2"]), default="gpt2", show_default=True, help="HF model."
)
@click.option(
    "--stages",
    "-p",
    "stages",
    type=click.IntRange(min=2),
    multiple=True,
    help="Pipeline ranks (gloo processes; repeatable). Default: 2 and 4.",
)
@microbatches_option(12)
@click.option(
    "--seqs",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Sequences per microbatch (one length per microbatch).",
)
@click.option("--min-len", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-len", type=click.IntRange(min=1), default=160, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--hidden", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--vocab", type=click.IntRange(min=2), default=1000, show_default=True)
@steps_option(6)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option(
    "--us-per-token",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="EMULATED GPU time: forward µs per token per block (backward twice that),"
    " padded tokens included. 0: real CPU compute only.",
)
@seed_option
@click.option(
    "--meter/--no-meter",
    default=True,
    show_default=True,
    help="Measure every run's activation bytes on every step (the saved-tensor meter, on"
    " for all runs alike); --no-meter: no bytes, and no meter's cost in any run's time.",
)
@json_option("Print the results as JSON.")
@log_options
def bench_hf(
    model: str,
    stages: tuple[int, ...],
    microbatches: int,
    seqs: int,
    min_len: int,
    max_len: int,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    steps: int,
    warmup: int,
    us_per_token: float,
    seed: int,
    meter: bool,
    as_json: bool,
) -> None:
    """A Hugging Face GPT-2 (small config, random weights, tied wte/lm_head) split into
    pipeline stages: torch Schedule1F1B on batches padded to each step's longest sequence,
    against rrfp_async's default configuration on the real lengths and on the same padded
    batches. Real CPU compute on gloo processes (127.0.0.1), runs interleaved step by step,
    paired per-step ratios; every run's peak activation bytes per rank measured on every step
    by one saved-tensor meter (--no-meter: none). Needs transformers.
    """
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise click.UsageError("bench hf needs transformers (pip install transformers)") from e
    from .. import HFConfig, hf_benchmark

    try:
        cfgs = [
            HFConfig(
                model=model,
                stages=p,
                microbatches=microbatches,
                seqs=seqs,
                min_len=min_len,
                max_len=max_len,
                layers=layers,
                hidden=hidden,
                heads=heads,
                vocab=vocab,
                steps=steps,
                warmup_steps=warmup,
                us_per_token=us_per_token,
                seed=seed,
                meter=meter,
            )
            for p in (stages or (2, 4))
        ]
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    results = [hf_benchmark(cfg) for cfg in cfgs]
    if as_json:
        click.echo(json.dumps({"runs": results}, indent=2))
        return
    for res in results:
        _print(res)


def _print(res: dict[str, Any]) -> None:
    c = res["config"]
    tok = res["tokens"]
    emulated = (
        f"real CPU compute + EMULATED GPU time ({c['us_per_token']:g} µs/token/block forward,"
        " 2x backward)"
        if c["us_per_token"] > 0
        else "real CPU compute only (no emulated GPU time)"
    )
    t = table(
        f"GPT-2 ({c['layers']} blocks, n_embd {c['hidden']}, vocab {c['vocab']}, tied"
        f" wte/lm_head) on {c['stages']} gloo processes, {c['microbatches']} microbatches x"
        f" {c['seqs']} sequences of {c['min_len']}-{c['max_len']} tokens; {emulated}; median"
        f" of {c['steps']} steps after {c['warmup_steps']} warm-up; padding to the step's"
        f" longest computes {tok['padding_factor']:.2f}x the real tokens",
        (
            "run",
            "data",
            "step s",
            "torch / this (paired: median, min-max)",
            "peak MiB",
            "bytes vs torch",
        ),
        left={"run", "data"},
    )
    t.add_row(
        "torch Schedule1F1B",
        "padded",
        f"{res['step_s']['torch padded']:.4f}",
        "1.00x",
        *_bytes_cells(res["bytes"], "torch padded"),
    )
    for key, data in (("ours variable", "real lengths"), ("ours padded", "padded")):
        sp = res["speedup"][key]
        t.add_row(
            "rrfp_async default",
            data,
            f"{res['step_s'][key]:.4f}",
            f"{sp['median']:.2f}x ({sp['min']:.2f}-{sp['max']:.2f})",
            *_bytes_cells(res["bytes"], key),
        )
    lc = res["loss_check"]
    t.caption = (
        f"loss check {'PASSED' if lc['passed'] else 'FAILED'} (tolerance {lc['tolerance']:g}):"
        f" torch padded vs ours padded {lc['torch_padded_vs_ours_padded']:.1e}, ours variable"
        f" vs single-process reference {lc['ours_variable_vs_reference']:.1e}. torch's"
        " PipelineStage does not reduce tied parameters: its run all-reduces the wte/lm_head"
        " gradient between the first and last rank after step() (timed), as a torch user must. "
        + (
            "peak MiB: the most activation bytes any rank held in a timed step, measured on"
            " every step of every run by the saved-tensor meter (its cost in every run's time"
            " alike; torch's inside its stage module, ours by the executor); torch keeps the"
            " last stage's logits until their backward, ours only the loss; bytes vs torch:"
            " the run's peak / torch padded's; (in parentheses) torch's order replayed on the"
            " bytes ours measured on the real lengths: its peak and its ratio, and ours on the"
            " real lengths / that"
            if res["bytes"] is not None
            else "no bytes measured (--no-meter)"
        )
    )
    console().print(t)


def _bytes_cells(nbytes: dict[str, Any] | None, key: str) -> tuple[str, str]:
    """A run's peak bytes (MiB) and its ratio to torch padded's, torch's order on the real
    lengths in parentheses; dashes without the meter."""
    if nbytes is None:
        return "–", "–"
    b = nbytes[key]
    peak, ratio = f"{b['peak_bytes'] / 2**20:.2f}", f"{b['vs_torch_padded']:.2f}x"
    if key == "torch padded":
        real = nbytes["torch real lengths"]
        peak += f" ({real['peak_bytes'] / 2**20:.2f})"
        ratio += f" ({real['vs_torch_padded']:.2f}x)"
    elif key == "ours variable":
        ratio += f" ({b['vs_torch_real_lengths']:.2f}x)"
    return peak, ratio
