"""The activation-bytes predictor: exact on linear data, its fallbacks, its refusals, and its
predictions of held-out sizes from bytes measured on two real models."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rrfp_async as rr
from rrfp_async._activation_model import ActivationModel, features_of
from rrfp_lab.models import ImageTextConfig, build_stage_modules, loss_fn

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ pure


@given(
    c=st.tuples(*[st.integers(0, 10**6)] * 4),
    sizes=st.lists(
        st.tuples(st.integers(1, 100_000), st.integers(0, 5_000)), min_size=5, max_size=12
    ),
    query=st.tuples(st.integers(1, 200_000), st.integers(0, 10_000)),
)
def test_exact_on_data_from_a_linear_model(
    c: tuple[int, int, int, int], sizes: list[tuple[int, int]], query: tuple[int, int]
) -> None:
    def truth(t: int, p: int) -> int:
        return c[0] + c[1] * t + c[2] * t * t + c[3] * p

    model = ActivationModel()
    for t, p in sizes:
        model.observe(3, {"tokens": t, "patches": p}, truth(t, p))
    q = {"tokens": query[0], "patches": query[1]}
    if model.covers(3, q):
        # exact up to float64 rounding, which is relative to the largest bytes seen: with
        # sizes 1 and 40160 (1e12 bytes) a query of 960 bytes came out 960.001
        top = max(truth(t, p) for t, p in sizes)
        assert model.predict(3, q) == pytest.approx(truth(*query), rel=1e-6, abs=1e-9 * top)
    else:  # the fallback: the most bytes per token seen
        seen = max(truth(t, p) / t for t, p in sizes)
        assert model.predict(3, q) == pytest.approx(seen * query[0])
    # not vacuous: sizes that move along every column, well apart, always give the fit
    x = np.array([[1, t, t * t, p] for t, p in set(sizes)], dtype=np.float64)
    x /= np.abs(x).max(axis=0).clip(min=1)
    sv = np.linalg.svd(x, compute_uv=False)
    if len(sv) == 4 and sv[-1] > 1e-3 * sv[0]:
        assert model.ready(3) and model.covers(3, q)


def test_ready_needs_as_many_distinct_sizes_as_columns() -> None:
    model = ActivationModel()
    assert not model.ready(0) and model.observations(0) == 0 and model.columns(0) == ()
    for t in (10, 10, 20):  # two distinct sizes: the square term is unknown
        model.observe(0, {"tokens": t}, 100 * t)
    assert model.columns(0) == ("1", "tokens", "tokens**2")
    assert not model.ready(0) and not model.covers(0, {"tokens": 40})
    assert model.predict(0, {"tokens": 40}) == 4000  # fallback: the most bytes per token seen
    assert math.isnan(model.error(0))
    model.observe(0, {"tokens": 30}, 3000)
    assert model.ready(0) and model.covers(0, {"tokens": 40})
    assert model.predict(0, {"tokens": 40}) == pytest.approx(4000)
    assert model.observations(0) == 4


def test_columns_that_never_moved_do_not_count_and_are_not_extrapolated() -> None:
    # text only so far: patches is 0 everywhere; three lengths fit 1, tokens, tokens**2
    model = ActivationModel()
    for t in (8, 16, 24):
        model.observe(1, {"tokens": t, "patches": 0}, 10 + 2 * t + t * t)
    assert model.ready(1)
    assert model.predict(1, {"tokens": 32, "patches": 0}) == pytest.approx(10 + 64 + 1024)
    # a first image: the data says nothing about patches, so the fallback, not a guess
    q = {"tokens": 32, "patches": 16}
    assert not model.covers(1, q)
    assert model.predict(1, q) == pytest.approx((10 + 48 + 576) / 24 * 32)


def test_dependent_columns_still_fit_the_sizes_they_span() -> None:
    # every image of 16 patches: images = patches / 16, always; 5 columns, rank 4
    model = ActivationModel()

    def f(k: int, text: int) -> dict[str, float]:
        return {"tokens": 16 * k + text, "patches": 16 * k, "images": k}

    def truth(k: int, text: int) -> float:
        t = 16 * k + text
        return 500 + 40 * t + 3 * t * t + 7 * 16 * k

    for k, text in [(0, 8), (1, 20), (2, 12), (0, 40), (3, 30)]:
        model.observe(0, f(k, text), truth(k, text))
    assert model.ready(0)
    assert model.covers(0, f(4, 16))
    assert model.predict(0, f(4, 16)) == pytest.approx(truth(4, 16), rel=1e-9)
    off_line = {"tokens": 40, "patches": 32, "images": 1}  # one image of 32 patches: unseen
    assert not model.covers(0, off_line)


def test_never_below_zero() -> None:
    model = ActivationModel(quadratic=False)
    for t, b in [(10, 100), (20, 50), (30, 0)]:  # falling: the fit is negative beyond 30
        model.observe(0, {"tokens": t}, b)
    assert model.ready(0)
    assert not model.covers(0, {"tokens": 40})
    assert model.predict(0, {"tokens": 40}) == pytest.approx(10 * 40)  # 10 bytes a token seen


def test_error_is_the_largest_recent_out_of_sample_error() -> None:
    model = ActivationModel(quadratic=False, error_window=2)
    for t in (10, 20):
        model.observe(0, {"tokens": t}, 10 * t)
    assert math.isnan(model.error(0))  # nothing predicted while not ready
    model.observe(0, {"tokens": 30}, 300)  # predicted 300 first: exact
    assert model.error(0) == pytest.approx(0.0, abs=1e-12)
    model.observe(0, {"tokens": 40}, 500)  # predicted 400
    assert model.error(0) == pytest.approx(0.2)
    model.observe(0, {"tokens": 50}, 0)  # measured 0: divided by 1 byte
    assert model.error(0) > 1.0
    assert math.isnan(model.error(7))


def test_extra_features_are_columns() -> None:
    # two rows per microbatch: attention's square term is rows * (tokens / rows) ** 2
    model = ActivationModel(
        quadratic=False,
        extra_features={"seq_sq": lambda f: f["rows"] * (f["tokens"] / f["rows"]) ** 2},
    )
    assert model.columns(0) == ()

    def truth(rows: int, seq: int) -> float:
        return 64 * rows * seq + 8 * rows * seq * seq

    for rows, seq in [(1, 10), (2, 10), (1, 30), (3, 7), (2, 21)]:
        model.observe(0, {"tokens": rows * seq, "rows": rows}, truth(rows, seq))
    assert model.columns(0) == ("1", "tokens", "rows", "seq_sq")
    assert model.predict(0, {"tokens": 4 * 16, "rows": 4}) == pytest.approx(truth(4, 16))


@pytest.mark.parametrize(
    ("features", "measured", "match"),
    [
        ({"tokens": -1}, 10, r"stage 2: feature 'tokens' must be a finite number >= 0, got -1\.0"),
        ({"tokens": math.nan}, 10, r"stage 2: feature 'tokens' must be a finite .*got nan"),
        ({"tokens": math.inf}, 10, r"stage 2: feature 'tokens' must be a finite .*got inf"),
        ({"tokens": True}, 10, r"stage 2: feature 'tokens' must be a number >= 0, got True"),
        ({"tokens": "8"}, 10, r"stage 2: feature 'tokens' must be a number >= 0, got '8'"),
        ({"tokens": 8}, -5, r"stage 2: measured_bytes must be a finite number >= 0, got -5\.0"),
        ({"tokens": 8}, math.nan, r"stage 2: measured_bytes must be a finite .*got nan"),
        ([("tokens", 8)], 10, r"stage 2: features must be a mapping"),
        ({3: 8}, 10, r"stage 2: feature name 3 is no str"),
    ],
)
def test_bad_input_names_the_stage_the_feature_and_the_value(
    features: Any, measured: Any, match: str
) -> None:
    with pytest.raises(rr.PlanError, match=match):
        ActivationModel().observe(2, features, measured)


def test_bad_use_is_refused() -> None:
    model = ActivationModel(extra_features={"x": lambda f: f["nope"]})
    with pytest.raises(rr.PlanError, match=r"stage 0: extra feature 'x' failed .*KeyError"):
        model.observe(0, {"tokens": 3}, 10)
    neg = ActivationModel(extra_features={"x": lambda f: -f["tokens"]})
    with pytest.raises(rr.PlanError, match=r"stage 1: extra feature 'x' .* got -3\.0"):
        neg.observe(1, {"tokens": 3}, 10)
    model = ActivationModel()
    with pytest.raises(rr.PlanError, match=r"stage 4: nothing observed yet"):
        model.predict(4, {"tokens": 3})
    model.observe(4, {"tokens": 3, "patches": 0}, 10)
    with pytest.raises(
        rr.PlanError, match=r"stage 4: the features must be .*missing \['patches'\]"
    ):
        model.predict(4, {"tokens": 3})
    with pytest.raises(rr.PlanError, match=r"stage 4: .*unknown \['images'\]"):
        model.observe(4, {"tokens": 3, "patches": 0, "images": 0}, 10)
    for stage in (-1, True, 1.0):
        with pytest.raises(rr.PlanError, match="stage must be an int >= 0"):
            model.ready(stage)  # type: ignore[arg-type]
    with pytest.raises(rr.PlanError, match="window must be an int >= 1"):
        ActivationModel(window=0)
    with pytest.raises(rr.PlanError, match="extra feature name 'tokens'"):
        ActivationModel(extra_features={"tokens": lambda f: 1.0})
    with pytest.raises(rr.PlanError, match="is not callable"):
        ActivationModel(extra_features={"x": 3})  # type: ignore[dict-item]


def test_the_window_keeps_the_most_recent_observations() -> None:
    model = ActivationModel(quadratic=False, window=3)
    for t in (10, 20, 30):
        model.observe(0, {"tokens": t}, 1000 * t)  # the model changed since (a new layer)
    for t in (10, 20, 30):
        model.observe(0, {"tokens": t}, 10 * t)
    assert model.predict(0, {"tokens": 40}) == pytest.approx(400)
    assert model.observations(0) == 6


def test_features_of_common_microbatches() -> None:
    assert features_of(rr.Microbatch(index=0, tokens=80, patches=64, images=4)) == {
        "tokens": 80.0,
        "patches": 64.0,
        "images": 4.0,
    }
    assert features_of(torch.zeros(2, 12, dtype=torch.long)) == {"tokens": 24.0}  # token ids
    assert features_of(torch.zeros(2, 12, 32)) == {"tokens": 24.0}  # hidden states
    hf = {
        "input_ids": torch.zeros(2, 10, dtype=torch.long),
        "attention_mask": torch.ones(2, 10),
        "pixel_values": torch.zeros(3, 3, 8, 16),
    }
    assert features_of(hf) == {"tokens": 20.0, "images": 3.0, "pixels": 3 * 8 * 16.0}
    assert features_of({"inputs_embeds": torch.zeros(1, 7, 16)}) == {"tokens": 7.0}

    class Counted:
        tokens = 9

    assert features_of(Counted()) == {"tokens": 9.0}
    with pytest.raises(rr.PlanError, match=r"no size found in a mapping with keys \['text'\]"):
        features_of({"text": torch.zeros(3)})
    with pytest.raises(rr.PlanError, match="cannot read the size of 'abc'"):
        features_of("abc")


# ------------------------------------------------------------------ measured on real models
#
# Bytes measured by TorchStageExecutor (saved-tensor hooks, CPU) for a few sizes; the model is
# fitted per stage and asked for sizes it never saw. Measured on CPU (torch 2.13): the
# relative error is ~1e-15, i.e. exact up to float rounding, because every storage a stage
# keeps is a polynomial of degree <= 2 in its sizes. The bound below says "exact".

EXACT = 1e-9


def _measure(
    execs: Sequence[rr.TorchStageExecutor], pipe: rr.LocalPipeline, mbs: list[rr.Microbatch]
) -> dict[tuple[int, int], int]:
    rr.run(pipe.run_step(mbs))
    return {k: b for e in execs for k, b in e.activation_bytes().items()}


def _image_text_mb(i: int, k: int, text: int, cfg: ImageTextConfig) -> rr.Microbatch:
    g = torch.Generator().manual_seed(1000 * i + 10 * k + text)
    ppi = cfg.patches_per_image
    data = {
        "images": torch.rand((k, cfg.channels, cfg.image_size, cfg.image_size), generator=g),
        "text": torch.randint(0, cfg.vocab, (text,), generator=g),
    }
    return rr.Microbatch(index=i, tokens=k * ppi + text, patches=k * ppi, images=k, data=data)


def test_predicts_held_out_sizes_of_the_image_text_model() -> None:
    cfg, stages, m = ImageTextConfig(n_layers=4), 2, 4
    mods = build_stage_modules(cfg, stages, list(range(stages)))
    execs = [
        rr.TorchStageExecutor({v: mods[v]}, loss_fn, rank=v, measure_activations=True)
        for v in range(stages)
    ]
    plan = rr.StepPlan(topology=rr.Topology(stages=stages), microbatches=m)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs, policy="strict")
    seen = [[(0, 8), (1, 20), (2, 12), (0, 40)], [(3, 30), (4, 48), (1, 8), (2, 44)]]
    held_out = [(4, 16), (3, 48), (0, 25), (1, 47)]  # (images, text tokens)
    model = ActivationModel()
    try:
        for sizes in seen:
            mbs = [_image_text_mb(i, k, t, cfg) for i, (k, t) in enumerate(sizes)]
            for (v, i), b in _measure(execs, pipe, mbs).items():
                model.observe(v, features_of(mbs[i]), b)
        mbs = [_image_text_mb(i, k, t, cfg) for i, (k, t) in enumerate(held_out)]
        measured = _measure(execs, pipe, mbs)
    finally:
        for e in execs:
            e.close()
    assert sorted(measured) == [(v, i) for v in range(stages) for i in range(m)]
    for (v, i), b in measured.items():
        f = features_of(mbs[i])
        assert model.ready(v) and model.covers(v, f), (v, held_out[i])
        assert model.predict(v, f) == pytest.approx(b, rel=EXACT), (v, held_out[i], b)
    assert all(model.error(v) < EXACT for v in range(stages))  # the second step's, predicted


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_predicts_held_out_lengths_of_a_tiny_llama(attention: str) -> None:
    # sdpa keeps O(length) per layer, eager its [heads, length, length] probabilities: a
    # linear and a quadratic stage, one predictor
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation=attention,
    )
    lm = tf.LlamaForCausalLM(cfg).train()
    lm.loss_type = "ForCausalLM"
    split = rr.split_causal_lm(lm, 2)
    execs = [split.executor([v], rank=v, measure_activations=True) for v in range(2)]
    plan = rr.StepPlan(topology=rr.Topology(stages=2), microbatches=4)
    pipe = rr.LocalPipeline(rr.StepSchedule.build(plan, "1f1b"), execs, policy="strict")

    def mbs_of(lengths: list[int], seed: int) -> list[rr.Microbatch]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for i, n in enumerate(lengths):
            ids = torch.randint(1, 128, (1, n), generator=g)
            data = {"input_ids": ids, "labels": ids.clone()}
            out.append(rr.Microbatch(index=i, tokens=n - 1, data=data))
        return out

    model = ActivationModel()
    try:
        for seed, lengths in enumerate([[6, 10, 17, 24], [31, 8, 20, 12]]):
            mbs = mbs_of(lengths, seed)
            for (v, i), b in _measure(execs, pipe, mbs).items():
                model.observe(v, features_of(mbs[i].data), b)  # tokens of the padded shape
        held_out = [40, 13, 50, 64]
        mbs = mbs_of(held_out, 9)
        measured = _measure(execs, pipe, mbs)
    finally:
        for e in execs:
            e.close()
    assert sorted(measured) == [(v, i) for v in range(2) for i in range(4)]
    for (v, i), b in measured.items():
        f = features_of(mbs[i].data)
        assert model.covers(v, f), (v, held_out[i])
        assert model.predict(v, f) == pytest.approx(b, rel=EXACT), (v, held_out[i], b)
