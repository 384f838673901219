"""``rrfp-async bench hf``: a tiny Hugging Face GPT-2 under torch pipelining and rrfp_async
(smoke size: 1 step, PP 2)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from rrfp_lab._hf import HFConfig, make_steps, pad


def test_padding_keeps_the_real_tokens_and_ignores_the_pads() -> None:
    cfg = HFConfig(microbatches=5, min_len=3, max_len=9, steps=1, warmup_steps=0)
    step = make_steps(cfg)[0]
    padded = pad(step)
    n = max(b.ids.shape[1] for b in step)
    for b, p in zip(step, padded, strict=True):
        k = b.ids.shape[1]
        assert p.ids.shape == (cfg.seqs, n)
        assert (p.ids[:, :k] == b.ids).all() and (p.labels[:, :k] == b.labels).all()
        assert (p.labels[:, k - 1 :] == -100).all()
    with pytest.raises(ValueError, match="only 'gpt2'"):
        HFConfig(model="llama")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_hf_prints_the_paired_ratios_and_the_loss_check() -> None:
    pytest.importorskip("transformers")
    from rrfp_async.cli._main import main

    args = ["bench", "hf", "-p", "2", "-m", "4", "--steps", "1", "--warmup", "0"]
    args += ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "100"]
    args += ["--min-len", "8", "--max-len", "32", "--us-per-token", "1"]
    # A table wide enough that no cell wraps (the console is $COLUMNS wide off a terminal).
    res = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "torch Schedule1F1B" in out and "real lengths" in out
    # two paired ratios: median (min-max); two bytes ratios with theirs on the real lengths
    assert len(re.findall(r"\d\.\d\dx \(\d\.\d\d-\d\.\d\d\)", out)) == 2
    assert len(re.findall(r"\d\.\d\dx \(\d\.\d\dx\)", out)) == 2
    assert "loss check PASSED" in out
    assert "EMULATED GPU time" in out
    assert "peak MiB" in out and "saved-tensor meter" in out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_hf_bytes_are_what_each_run_holds() -> None:
    """On padded microbatches ours holds at most 1F1B's count of equal forwards, so on the
    first rank no more than torch; on the last both hold one forward at a time and torch
    the logits more (one timed step: exactly); torch's order on the real lengths holds no
    more than on the padded ones."""
    pytest.importorskip("transformers")
    from rrfp_lab._hf import hf_benchmark

    cfg = HFConfig(
        stages=2,
        microbatches=4,
        steps=1,
        warmup_steps=0,
        layers=2,
        hidden=32,
        heads=2,
        vocab=100,
        min_len=8,
        max_len=32,
        us_per_token=1.0,
    )
    nbytes = hf_benchmark(cfg)["bytes"]
    torch_, padded = nbytes["torch padded"], nbytes["ours padded"]
    real = nbytes["torch real lengths"]
    assert torch_["vs_torch_padded"] == 1.0
    n = max(b.ids.shape[1] for b in make_steps(cfg)[1])  # the timed step's padded length
    logits = 4 * cfg.seqs * n * cfg.vocab
    theirs, mine = torch_["peak_bytes_per_rank"], padded["peak_bytes_per_rank"]
    assert 0 < mine[0] <= theirs[0]  # the first rank
    assert theirs[1] - mine[1] == logits  # the last
    assert all(0 < r <= t for r, t in zip(real["peak_bytes_per_rank"], theirs, strict=True))
    ours = nbytes["ours variable"]
    assert ours["vs_torch_real_lengths"] == ours["peak_bytes"] / real["peak_bytes"]


def test_torch_runs_meter_counts_what_the_executors_meter_counts_and_the_logits() -> None:
    """torch's run is metered inside its stage module (``_MeteredStage``, the loss torch's
    schedule computes measured into the last forward), ours by the executor: on the same
    padded microbatches the first stage counts the same bytes per forward (torch's input a
    view of its whole batch, counted as the microbatch's own), the last the same plus the
    logits torch keeps until their backward (ours keeps only the loss; torch's target a view
    of its batch too); torch's recorded order replayed on ours' bytes is what ours held
    (both ran GPipe's order here)."""
    pytest.importorskip("transformers")
    import torch

    import rrfp_async as rr
    from rrfp_async.distributed import split_model
    from rrfp_lab._hf import (
        _batch_ids,
        _batch_loss,
        _MeteredStage,
        build_blocks,
        lm_loss,
        split_spec,
    )
    from rrfp_lab._peer_stage import LiveBytes, replay_peak

    cfg = HFConfig(microbatches=3, min_len=5, max_len=20, layers=2, hidden=32, heads=2, vocab=100)
    step = pad(make_steps(cfg)[0])
    split = split_model(build_blocks(cfg), split_spec(cfg))
    mods = split.modules_of([0, 1])
    execs = [
        rr.TorchStageExecutor(
            {v: mods[v]},
            _batch_loss if v == 1 else None,
            rank=v,
            input_fn=_batch_ids,
            measure_activations=True,
        )
        for v in range(2)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=3)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "gpipe"), execs, policy="strict")
    try:
        stats = rr.run(pipe.run_step(step))
        ours = [e.activation_bytes() for e in execs]
    finally:
        for e in execs:
            e.close()
    # torch's way: each microbatch a view of one batch (ids, labels), GPipe's order.
    ids = torch.tensor_split(torch.cat([b.ids for b in step]), 3)
    labels = torch.tensor_split(torch.cat([b.labels for b in step]), 3)
    lives = [LiveBytes(), LiveBytes()]
    stages = [_MeteredStage(mods[v], v, lives[v]) for v in range(2)]
    for s in stages:
        s.begin()
    sent, outs, losses = [], [], []
    for m in range(3):
        sent.append(stages[0](ids[m]))
        x = sent[-1].detach().requires_grad_()
        outs.append((x, stages[1](x)))
        losses.append(lives[1].loss(lm_loss, outs[-1][1], labels[m]))
    for m in range(3):
        losses[m].backward()
        sent[m].backward(outs[m][0].grad)
    for live in lives:
        live.end()
    logits = 4 * cfg.seqs * step[0].ids.shape[1] * cfg.vocab
    assert lives[0].bytes == ours[0]
    assert lives[1].bytes == {k: b + logits for k, b in ours[1].items()}
    for v in range(2):
        assert replay_peak(lives[v].order, ours[v]) == stats[v].held_peak(ours[v])
        assert lives[v].peak == stats[v].held_peak(lives[v].bytes)
