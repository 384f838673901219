"""``rrfp-async bench hf``: a tiny Hugging Face GPT-2 under torch pipelining and rrfp_async
(smoke size: 1 step, PP 2)."""

from __future__ import annotations

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
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "torch Schedule1F1B" in out and "real lengths" in out
    assert out.count("x (") == 2  # two paired ratios: median (min-max)
    assert "loss check PASSED" in out
    assert "EMULATED GPU time" in out
