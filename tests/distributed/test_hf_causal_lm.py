"""``rr.split_causal_lm``: Hugging Face decoders of five families split in one call, against
the model's own ``forward`` + loss; and the models it refuses, with a PlanError naming why.

Families (tiny configs, random weights, ``_hf_causal_lm.py``): Llama; Qwen2 with tied
embeddings and a sliding window on half its layers; Mistral with a sliding window on all;
GPT-NeoX (its own module names and layer call, partial rotary); Mixtral with the router
load-balancing loss in its loss. Microbatches are left-padded rows of 6-24 tokens, so the
padding mask and the 4-token sliding windows change every result.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers as tf

import rrfp_async as rr
from tests._pool import pooled_spawn

from . import _hf_causal_lm as H
from ._hf_causal_lm import Run

pytestmark = pytest.mark.timeout(300)

#: Bitwise where the order allows it (below); else float rounding of sums taken in another
#: order (a tied weight's two uses, readiness-first's order of backwards).
TOL = 1e-6
FAMILIES = sorted(H.FAMILIES)
SPLITS: dict[str, int | list[str]] = {
    "llama": 2,
    "qwen2": 3,  # the tie spans stages 0 and 2; the window's layers sit on stages 1 and 2
    "mistral": ["model.layers.1"],
    "gpt_neox": ["gpt_neox.layers.3"],
    "mixtral": ["layers.1", "layers.3"],  # router logits pass through a middle stage
}


def _compare(family: str, run: Run, *, bitwise: bool) -> None:
    steps = H.batches(1, 4)
    got = H.train_local(family, steps, run, SPLITS[family])
    ref = H.reference(family, steps, run, len(got["split"].modules))
    assert got["losses"] == ref["losses"]  # one loss per microbatch, bitwise
    diff, where = H.max_diff(got["grads"], ref["grads"])
    if bitwise:
        assert diff == 0.0, (where, diff)
    assert diff <= TOL, (where, diff)
    # Not vacuous: the gradients are far from zero everywhere that matters.
    assert max(g.abs().max().item() for g in ref["grads"].values()) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_the_models_own_forward_and_loss(family: str) -> None:
    # Strict 1F1B: every stage runs its backwards in microbatch order, as the reference
    # does, so each gradient sums the same values in the same order: bitwise, except the
    # tied Qwen2 embedding (its two uses, on two stages, are summed in another order).
    _compare(family, Run(policy="strict", hint="1f1b"), bitwise=family != "qwen2")


@pytest.mark.parametrize("family", ["mixtral", "qwen2"])
def test_split_backward_and_readiness_first_match(family: str) -> None:
    # I/W split backward with the cost-aware hint: the router logits (Mixtral) and the
    # tied weight (Qwen2) through the split backward's path.
    _compare(
        family,
        Run(policy="readiness_first", hint="breadth_first_weighted", split_backward=True),
        bitwise=False,
    )


def test_router_loss_is_in_the_loss_and_reaches_every_router() -> None:
    # Not vacuous: the router loss is a large part of Mixtral's loss here, and a pipeline
    # that dropped it (or its gradient into an earlier stage's routers) would be far off.
    model = H.build("mixtral")
    mb = H.batches(1, 1)[0][0]
    with_aux = model(**mb.data)
    model.config.output_router_logits = False
    without = model(**mb.data)
    assert float((with_aux.loss - without.loss).detach()) > 0.1
    model.config.output_router_logits = True
    split = rr.split_causal_lm(model, ["layers.2"])
    out: Any = split.modules[0](mb.data["input_ids"], attention_mask=mb.data["attention_mask"])
    assert isinstance(out, rr.Args) and len(out.kwargs["router_logits"]) == 2
    out = split.modules[1](*out.args, attention_mask=mb.data["attention_mask"], **out.kwargs)
    assert set(out) == {"logits", "router_logits"} and len(out["router_logits"]) == 4
    loss = split.loss_fn(out, mb)
    assert torch.equal(loss, with_aux.loss)
    loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().max() > 0


def test_ties_names_and_stages() -> None:
    model = H.build("qwen2")
    split = rr.split_causal_lm(model, 3)
    assert split.layers == ((0, 2), (2, 3), (3, 4))
    # The tied lm_head is the embedding: one parameter object on stages 0 and 2.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert split.shared == {
        "0:model.embed_tokens.weight": ((0, "model.embed_tokens.weight"), (2, "lm_head.weight"))
    }
    # The stages' names are the model's; together they hold all of it, each layer once.
    whole = model.state_dict()
    names = [set(m.state_dict()) for m in split.modules]
    assert all(n <= set(whole) for n in names)
    assert set().union(*names) == set(whole)
    assert "model.layers.2.self_attn.q_proj.weight" in names[1]
    assert all("model.rotary_emb.inv_freq" in dict(m.named_buffers()) for m in split.modules)
    assert not any(
        isinstance(m, rr.distributed.CausalLMStage) and m.first for m in split.modules[1:]
    )
    # Untied: nothing shared.
    assert rr.split_causal_lm(H.build("llama"), 2).shared == {}


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_given_position_ids_reach_every_stage(family: str) -> None:
    # Two packed sequences in one row (positions restart at 0, no padding mask). The model's
    # forward uses the given positions (rotary tables), and transformers masks the two
    # sequences from each other, but only without a cache: with config.use_cache (True by
    # default, even in training) its forward makes one and the mask stays causal. Every
    # stage follows the same rule from its own microbatch.
    model = H.build(family)
    ids = torch.randint(1, H.VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(8), torch.arange(6)]).unsqueeze(0)
    split = rr.split_causal_lm(model, 2)
    logits = []
    for extra in ({}, {"use_cache": False}):
        data = {"input_ids": ids, "position_ids": pos, "labels": ids, **extra}
        with torch.no_grad():
            want = model(**data)
            out = split.modules[0](ids, **split.side_inputs(0, data))
            out = split.modules[1](out, **split.side_inputs(1, data))
        assert torch.equal(out, want.logits), extra
        assert torch.equal(split.loss_fn(out, data), want.loss), extra
        logits.append(out)
    with torch.no_grad():
        default = model(input_ids=ids).logits
    # Not vacuous: the positions matter, and so does the cache rule.
    assert not torch.allclose(logits[0], default, rtol=0, atol=1e-5)
    assert not torch.allclose(logits[0], logits[1], rtol=0, atol=1e-5)


def test_gradient_checkpointing_follows_the_models_cache_rule() -> None:
    # Under gradient checkpointing in training the model's forward turns use_cache off, so
    # packed sequences are masked from each other; the stages (whose layers checkpoint as
    # the model's do) follow. Losses and gradients: bitwise.
    model = H.build("llama")
    model.activation_checkpointing_enable()
    ids = torch.randint(1, H.VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(8), torch.arange(6)]).unsqueeze(0)
    data = {"input_ids": ids, "position_ids": pos, "labels": ids}
    split = rr.split_causal_lm(model, 2)
    want = model(**data).loss
    want.backward()
    ref = H.grads(model)
    model.zero_grad(set_to_none=True)
    out = split.modules[0](ids, **split.side_inputs(0, data))
    loss = split.loss_fn(split.modules[1](out, **split.side_inputs(1, data)), data)
    loss.backward()
    assert torch.equal(loss, want)
    assert H.max_diff(H.grads(model), ref)[0] == 0.0
    with torch.no_grad():
        cached = model(**data, use_cache=True).loss  # not vacuous: the rule matters here
    assert not torch.allclose(cached, want, rtol=0, atol=1e-6)


def test_a_microbatch_without_labels_is_named() -> None:
    split = rr.split_causal_lm(H.build("llama"), 2)
    mb = H.batches(1, 3)[0][2]
    data = {k: v for k, v in mb.data.items() if k != "labels"}
    with pytest.raises(rr.PlanError, match=r"labels of microbatch 2 \(keys: \['attention"):
        split.loss_fn(torch.zeros(2, 3, H.VOCAB), rr.Microbatch(index=2, data=data))
    with pytest.raises(rr.PlanError, match="has no input_ids"):
        split.input_fn({"labels": mb.data["labels"]})


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_processes_tied_qwen2_and_mixtral_match_autograd() -> None:
    # Across 2 gloo processes: Qwen2's tied embedding lives on both ranks (its two copies'
    # gradients summed by the tie reduction), Mixtral's router logits cross the wire with
    # the hidden states and their gradients come back. 2 steps of SGD, then parameters
    # and per-microbatch losses against the whole model trained by plain autograd.
    job = H.Job(families=("qwen2", "mixtral"), steps=H.batches(2, 4), lr=0.5)
    results = pooled_spawn(H.worker, 2, job, timeout=300)
    for family in job.families:
        ref = H.reference(family, job.steps, job.run, 2, lr=job.lr)
        got: dict[str, list[torch.Tensor]] = {}
        for r in results:
            for n, p in r[family]["params"].items():
                got.setdefault(n, []).append(p)
        assert got.keys() == ref["params"].keys()
        diff = max((p - ref["params"][n]).abs().max().item() for n, ps in got.items() for p in ps)
        assert diff <= TOL, (family, diff)
        losses = results[1][family]["losses"]
        assert len(losses) == len(ref["losses"]) == 2
        for mine, theirs in zip(losses, ref["losses"], strict=True):
            assert mine == pytest.approx(theirs, abs=TOL), family
        init = H.params(H.build(family))
        assert max((ref["params"][n] - init[n]).abs().max().item() for n in init) > 1e-2
    # The tie is on both ranks, declared alike.
    assert results[0]["qwen2"]["shared"] == results[1]["qwen2"]["shared"] != {}
    assert len(got) == len(ref["params"])


# ------------------------------------------------------------------------------ refusals


def _refused(model: nn.Module, *match: str, spec: Any = 2) -> str:
    with pytest.raises(rr.PlanError) as e:
        rr.split_causal_lm(model, spec)
    text = str(e.value)
    for m in match:
        assert m in text, text
    return text


def test_encoder_only_models_are_refused() -> None:
    torch.manual_seed(0)
    # EuroBERT has transformers' pipeline plan, but its attention is bidirectional.
    cfg = tf.EuroBertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        mask_token_id=1,
    )
    _refused(tf.EuroBertForMaskedLM(cfg), "EuroBertForMaskedLM cannot be split", "not causal")
    bert = tf.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    _refused(tf.BertForMaskedLM(bert), "BertForMaskedLM", "base_model_pp_plan")


def test_a_model_without_a_pipeline_plan_is_refused() -> None:
    cfg = tf.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    _refused(tf.GPT2LMHeadModel(cfg), "GPT2LMHeadModel", "no base_model_pp_plan", "by hand")


def test_a_base_model_without_head_is_refused() -> None:
    _refused(H.build("llama").model, "LlamaModel", "without a head", "ForCausalLM")


class _SegmentLayer(tf.models.llama.modeling_llama.LlamaDecoderLayer):  # type: ignore[misc]
    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: Any = None,
        segment_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        return super().forward(  # type: ignore[no-any-return]
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
            **kwargs,
        )


def test_an_unknown_layer_call_is_refused() -> None:
    model = H.build("llama")
    cfg = model.config
    model.model.layers = nn.ModuleList(_SegmentLayer(cfg, i) for i in range(4))
    _refused(model, "model.layers.0", "_SegmentLayer.forward", "segment_ids")


def test_a_module_no_plan_places_is_refused() -> None:
    model = H.build("llama")
    model.model.extra_norm = nn.LayerNorm(32)
    _refused(model, "model.extra_norm", "base_model_pp_plan")


class _ScaledLlama(tf.LlamaForCausalLM):  # type: ignore[misc]
    """A forward that does more than its modules: it scales the hidden states."""

    def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        out = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(out.last_hidden_state * 1.5)
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size)
        return tf.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_forward_the_stages_do_not_reproduce_is_refused() -> None:
    torch.manual_seed(0)
    model = _ScaledLlama(H.build("llama").config)
    model.loss_type = "ForCausalLM"
    _refused(model, "_ScaledLlama", "differ from its own forward")
    # The same model passes with the check off (the user's word), and the model's modes
    # are as they were.
    assert model.training
    assert len(rr.split_causal_lm(model, 2, check=False).modules) == 2


def test_soft_capped_logits_are_refused() -> None:
    # Gemma 2 caps its logits in the causal LM's forward, not in a module.
    cfg = tf.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    _refused(tf.Gemma2ForCausalLM(cfg), "Gemma2ForCausalLM", "final_logit_softcapping")


def test_bad_split_specs_are_refused() -> None:
    model = H.build("llama")
    _refused(model, "1 to 4 stages", spec=5)
    _refused(model, "no layer a stage can begin at", spec=["model.layers.0"])
    _refused(model, "no layer a stage can begin at", spec=["lm_head"])
    _refused(model, "must increase", spec=["layers.3", "layers.2"])
    _refused(model, "expected a number of stages", spec="layers.2")


def test_split_model_refuses_a_hugging_face_model() -> None:
    # What users tried first: accepted, then a TypeError from inside transformers.
    model = H.build("llama")
    with pytest.raises(rr.PlanError, match="split_causal_lm"):
        rr.split_model(model.model, ["layers.2"])
    with pytest.raises(rr.PlanError, match="LlamaForCausalLM is a Hugging Face model"):
        rr.split_model(model, 2)


def test_missing_transformers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    model = H.build("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(rr.PlanError, match=r"needs transformers >= 5 \(pip install"):
        rr.split_causal_lm(model, 2)


def test_import_rrfp_async_does_not_import_transformers() -> None:
    code = "import sys, rrfp_async; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
