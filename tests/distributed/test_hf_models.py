"""Real models nobody here wrote: Hugging Face GPT-2, Llama and ResNet, split by hand into
pipeline stages (``_hf.py``), trained across gloo processes and compared with plain autograd
on the whole model (same init, same data, same loss scaling, same optimizer).

Every model trains 3 steps of 4 variable-size microbatches under ``strict`` and
``readiness_first``, the ``1f1b`` hint and the default (``breadth_first_weighted``, from
each step's sizes), full and split backward; parameters, per-microbatch losses, buffers
(BatchNorm's running statistics) and a forward-only step's losses after training must
agree within 1e-5. Nothing is downloaded: tiny configs, random init.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import rrfp_async as rr
from tests._pool import pooled_spawn

from . import _hf
from ._hf import Job, Run

TOL = 1e-5
STEPS, MICROBATCHES = 3, 4

pytestmark = pytest.mark.timeout(120)
distributed = pytest.mark.distributed


def _lm_batches(pad: bool) -> list[list[rr.Microbatch]]:
    return _hf.lm_batches(STEPS, MICROBATCHES, seed=7, pad=pad)


def _check(job: Job, results: list[list[dict[str, Any]]], stages: int) -> list[dict[str, Any]]:
    """Each run against its reference; returns the references."""
    refs = []
    for i, run in enumerate(job.runs):
        per_rank = [r[i] for r in results]
        ref = _hf.reference(job, run, stages)
        refs.append(ref)
        diff = _hf.max_diff(_hf.merged(per_rank, "params"), ref["params"])
        assert diff[0] <= TOL, (run, diff)
        diff = _hf.max_diff(_hf.merged(per_rank, "buffers"), ref["buffers"])
        assert diff[0] <= TOL, (run, diff)
        last = per_rank[-1]
        assert len(last["losses"]) == STEPS, run
        for mine, theirs in zip(last["losses"], ref["losses"], strict=True):
            assert mine == pytest.approx(theirs, abs=TOL), run
        assert last["eval"] == pytest.approx(ref["eval"], abs=TOL), run
        assert all(r["losses"] == [] and r["eval"] is None for r in per_rank[:-1]), run
    return refs


def _assert_not_trained_alike(refs: list[dict[str, Any]], job: Job) -> None:
    """Not vacuous: the runs' references really trained (they moved away from the init,
    far beyond the tolerance)."""
    init = _hf.snapshot(*_hf.build(job, 2))["params"]
    for ref in refs:
        moved = max((ref["params"][n] - init[n]).abs().max().item() for n in init)
        assert moved > 100 * TOL


GPT2_RUNS = (
    Run(policy="strict", hint="1f1b"),
    Run(policy="readiness_first", split=True, loss_scale="tokens"),
    Run(policy="readiness_first", hint="1f1b", optimizer="adamw"),
    Run(policy="strict", split=True),
)


@distributed
@pytest.mark.parametrize("stages", [2, 3])
def test_gpt2_tied_embeddings_match_autograd(stages: int) -> None:
    # Padded microbatches (rows of different lengths, left-padded): the attention mask is a
    # side input every stage turns into the causal mask. wte (first stage) and lm_head
    # (last stage) are one tied weight, declared with `shared=`: its two copies must get
    # the summed gradient and stay equal (both are compared with the reference's weight).
    runs = GPT2_RUNS if stages == 2 else GPT2_RUNS[:2]
    job = Job(kind="gpt2", runs=runs, batches=_lm_batches(pad=True))
    results = pooled_spawn(_hf.worker, stages, job, timeout=100)
    refs = _check(job, results, stages)
    _assert_not_trained_alike(refs, job)
    for i in range(len(runs)):
        copies = _hf.merged([r[i] for r in results], "params")["transformer.wte.weight"]
        assert len(copies) == 2 and torch.equal(copies[0], copies[1])
        vocab = _hf.VOCAB
        shapes = results[-1][i]["eval_shapes"]
        assert [s[-1] for s in shapes] == [vocab] * MICROBATCHES
    # The mask matters: without it, the reference's first losses differ (left padding).
    unmasked = dataclasses.replace(job, batches=_without_mask(job.batches))
    assert _hf.reference(unmasked, runs[0], stages)["losses"][0] != pytest.approx(
        refs[0]["losses"][0], abs=1e-3
    )


def test_gpt2_tie_across_copies_in_one_process() -> None:
    # LocalPipeline: each stage cut from its own copy of the model, so wte and lm_head are
    # distinct parameter objects in one process; the declared tie sums their gradients.
    runs = (Run(policy="readiness_first", split=True), Run(policy="strict", hint="1f1b"))
    job = Job(kind="gpt2", runs=runs, batches=_lm_batches(pad=True))
    results = [_hf.train_local(job, run, 2) for run in runs]
    _check(job, [list(r) for r in zip(*results, strict=True)], 2)
    for per_rank in results:
        first, last = _hf.merged(per_rank, "params")["transformer.wte.weight"]
        assert torch.equal(first, last)
    # Undeclared, the copies drift (what the declaration is for).
    undeclared = dataclasses.replace(job, declare_ties=False)
    first, last = _hf.merged(_hf.train_local(undeclared, runs[0], 2), "params")[
        "transformer.wte.weight"
    ]
    assert (first - last).abs().max().item() > 1e-3


def _without_mask(batches: list[list[rr.Microbatch]]) -> list[list[rr.Microbatch]]:
    return [
        [
            dataclasses.replace(
                mb, data={k: v for k, v in mb.data.items() if k != "attention_mask"}
            )
            for mb in mbs
        ]
        for mbs in batches
    ]


@distributed
def test_gpt2_undeclared_tie_fails_naming_both() -> None:
    job = Job(kind="gpt2", runs=(Run(),), batches=_lm_batches(pad=True), declare_ties=False)
    with pytest.raises(rr.errors.SpawnError, match="PlanError") as ei:
        pooled_spawn(_hf.worker, 2, job, timeout=100)
    text = str(ei.value)
    assert "'wte.weight' of virtual stage 0" in text
    assert "'lm_head.weight' of virtual stage 1" in text
    assert "same shape and values" in text


@distributed
def test_gpt2_undeclared_tie_without_check_drifts() -> None:
    # What the declaration and the check are for: each rank trains its own copy of the tied
    # weight, the copies drift apart and neither is the reference's.
    job = Job(
        kind="gpt2",
        runs=(Run(),),
        batches=_lm_batches(pad=True),
        declare_ties=False,
        check_ties=False,
    )
    results = pooled_spawn(_hf.worker, 2, job, timeout=100)
    got = _hf.merged([r[0] for r in results], "params")
    first, last = got["transformer.wte.weight"]
    assert (first - last).abs().max().item() > 1e-3
    ref = _hf.reference(job, job.runs[0])["params"]["transformer.wte.weight"]
    for copy in (first, last):
        assert (copy - ref).abs().max().item() > 1e-3


@distributed
def test_gpt2_frozen_first_stage() -> None:
    # The whole first stage frozen (embeddings and its blocks; lm_head with them: it is the
    # same tied weight): its input is data and nothing in it needs a gradient, so its
    # backward does nothing and the last stage sends no gradient back. AdamW with weight
    # decay is given every parameter, frozen ones too: a frozen parameter must keep
    # .grad None (a zero gradient would let weight decay move it).
    job = Job(
        kind="gpt2",
        runs=(Run(optimizer="adamw"), Run(policy="strict", hint="1f1b", split=True)),
        batches=_lm_batches(pad=True),
        freeze_first=True,
    )
    results = pooled_spawn(_hf.worker, 2, job, timeout=100)
    _check(job, results, 2)
    model, mods = _hf.build(job, 2)
    init = _hf.snapshot(model, mods)["params"]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {"transformer.wte.weight", "transformer.h.1.attn.c_attn.weight"} <= frozen
    for i in range(len(job.runs)):
        got = _hf.merged([r[i] for r in results], "params")
        for n in frozen:
            assert all(torch.equal(t, init[n]) for t in got[n]), n
        # The rest trained (blocks 2-3 are the last stage's).
        name = "transformer.h.3.mlp.c_fc.weight"
        assert name not in frozen and not torch.equal(got[name][0], init[name])


@distributed
def test_llama_rotary_tables_cross_the_boundary() -> None:
    # The boundary is rr.Args(hidden, position_embeddings=(cos, sin)): the tables are
    # computed once on the first stage and sent forward (they need no gradient); the last
    # stage holds no rotary module. Microbatches of different lengths, no padding.
    runs = (
        Run(policy="strict", split=True),
        Run(policy="readiness_first", hint="1f1b"),
    )
    job = Job(kind="llama", runs=runs, batches=_lm_batches(pad=False))
    _, mods = _hf.build(job, 2)
    assert not any("rotary" in n for n, _ in mods[1].named_modules())
    results = pooled_spawn(_hf.worker, 2, job, timeout=100)
    _assert_not_trained_alike(_check(job, results, 2), job)


@distributed
def test_resnet_batchnorm_buffers_match_autograd() -> None:
    # BatchNorm in training mode on microbatches of 32x32 and 48x48 images: the running
    # statistics (and num_batches_tracked) must match too. They are an exponential average
    # in forward order, and the size-aware default hint runs heavy microbatches first: the
    # reference runs each step's microbatches in the first stage's forward order.
    runs = (
        Run(policy="strict", hint="1f1b"),
        Run(policy="readiness_first", split=True),
        Run(policy="strict", optimizer="adamw"),
    )
    job = Job(kind="resnet", runs=runs, batches=_hf.image_batches(STEPS, MICROBATCHES, seed=3))
    sizes = {mb.data["pixel_values"].shape[-1] for mbs in job.batches for mb in mbs}
    assert sizes == set(_hf.IMAGE_SIZES)
    plan = _hf.plan_for(job, runs[1], 2)
    orders = [_hf.forward_order(plan, runs[1], mbs) for mbs in job.batches]
    assert any(o != sorted(o) for o in orders)  # the default hint does reorder forwards
    results = pooled_spawn(_hf.worker, 2, job, timeout=100)
    refs = _check(job, results, 2)
    _assert_not_trained_alike(refs, job)
    bufs = refs[0]["buffers"]
    assert any(n.endswith("running_mean") for n in bufs)
    # Every training forward and the forward-only step's (the modules stay in training
    # mode, as in the reference) updated the statistics once per microbatch.
    tracked = bufs["resnet.embedder.embedder.normalization.num_batches_tracked"]
    assert int(tracked) == (STEPS + 1) * MICROBATCHES
