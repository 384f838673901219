"""Hugging Face causal LMs of five families from tiny configs, split by ``rr.split_causal_lm``.

Used by ``test_hf_causal_lm.py`` in the test process and in every spawned rank. Random
weights from a seed (nothing is downloaded); each rank builds the whole model and keeps its
stage. The reference is the whole model's own ``forward(**data).loss``, by plain autograd.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers as tf
from torch import nn

import rrfp_async as rr

from . import _hf

VOCAB = _hf.VOCAB
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def llama() -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON, tie_word_embeddings=False))


def qwen2() -> nn.Module:
    # Tied embeddings (as the small Qwen2 checkpoints), and a sliding window of 4 tokens on
    # layers 2 and 3 only: the layers of one model get different masks (layer_types).
    cfg = tf.Qwen2Config(
        **_COMMON,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
    )
    return tf.Qwen2ForCausalLM(cfg)


def mistral() -> nn.Module:
    # A sliding window of 4 tokens on every layer (sequences here are 6-24 tokens long).
    return tf.MistralForCausalLM(tf.MistralConfig(**_COMMON, sliding_window=4))


def gpt_neox() -> nn.Module:
    # Its own names (embed_in, emb_dropout, final_layer_norm), its own layer call
    # (layer_past=), partial rotary (a quarter of each head), parallel residual.
    cfg = tf.GPTNeoXConfig(  # type: ignore[call-arg]  # rotary_pct: a legacy keyword it converts
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.25,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPTNeoXForCausalLM(cfg)


def mixtral() -> nn.Module:
    # 4 experts, top 2, and the router load-balancing loss in the model's loss.
    cfg = tf.MixtralConfig(
        **_COMMON,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,  # large, so that a missed router loss is far off
        sliding_window=None,
    )
    return tf.MixtralForCausalLM(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "gpt_neox": gpt_neox,
    "mixtral": mixtral,
}


def build(family: str, seed: int = 0) -> Any:
    """A family's model (``Any``: its attributes are the family's own, ``model.model.layers``)."""
    torch.manual_seed(seed)
    model: Any = FAMILIES[family]().train()
    model.loss_type = "ForCausalLM"  # what it computes anyway (silences a warning)
    return model


def batches(steps: int, microbatches: int, seed: int = 3) -> list[list[rr.Microbatch]]:
    """Variable-length (6-24 tokens), left-padded rows: the padding mask matters."""
    return _hf.lm_batches(steps, microbatches, seed=seed, pad=True)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by the model's names (a tied one once)."""
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        out[n] = p.grad.detach().clone()
    return out


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(((a[n].double() - b[n].double()).abs().max().item(), n) for n in a)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One way to run the same step."""

    policy: str = "strict"
    hint: str = "1f1b"
    split_backward: bool = False


def plan(stages: int, microbatches: int, run: Run) -> rr.StepPlan:
    return rr.StepPlan(
        topology=rr.Topology(stages=stages),
        microbatches=microbatches,
        split_backward=run.split_backward,
        ordered_weights=run.split_backward,
    )


def schedule(p: rr.StepPlan, run: Run, mbs: Sequence[rr.Microbatch]) -> rr.StepSchedule:
    return rr.StepSchedule.build(p, run.hint, durations=rr.CostModel().declared(p, mbs))


def forward_order(p: rr.StepPlan, run: Run, mbs: Sequence[rr.Microbatch]) -> list[int]:
    """The order the first stage runs its forwards in (the hint's)."""
    return [t.mb for t in schedule(p, run, mbs).hint[0] if t.kind == "F"]


def reference(
    family: str, steps: list[list[rr.Microbatch]], run: Run, stages: int, *, lr: float = 0.0
) -> dict[str, Any]:
    """The whole model's own forward + loss, plain autograd, microbatches in the pipeline's
    forward order, loss / M each; SGD(lr) after each step when ``lr``. Returns the first
    step's gradients, every step's losses and the final parameters."""
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if lr else None
    losses, first = [], None
    for mbs in steps:
        row = [0.0] * len(mbs)
        for i in forward_order(plan(stages, len(mbs), run), run, mbs):
            loss = model(**mbs[i].data).loss
            row[i] = float(loss.detach())
            (loss / len(mbs)).backward()
        losses.append(row)
        if first is None:
            first = grads(model)
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)
    return {"grads": first, "losses": losses, "params": params(model)}


def train_local(
    family: str, steps: list[list[rr.Microbatch]], run: Run, split_spec: int | list[str]
) -> dict[str, Any]:
    """The same steps through ``rr.LocalPipeline`` in this process, every stage cut from the
    one model by ``split_causal_lm`` (a tied weight is then one object in two stages)."""
    model = build(family)
    split = rr.split_causal_lm(model, split_spec)
    n = len(split.modules)
    executors = [split.executor([v], rank=v) for v in range(n)]
    p = plan(n, len(steps[0]), run)
    pipe = rr.LocalPipeline(schedule(p, run, steps[0]), executors, policy=run.policy)
    losses, first = [], None
    try:
        for mbs in steps:
            stats = rr.run(pipe.run_step(mbs, schedule=schedule(p, run, mbs)))
            assert stats[-1].losses is not None
            losses.append(list(stats[-1].losses))
            if first is None:
                first = grads(model)
            model.zero_grad(set_to_none=True)
    finally:
        for ex in executors:
            ex.close()
    return {"grads": first, "losses": losses, "split": split}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """What every rank of a distributed run trains: each family in turn, SGD(lr)."""

    families: tuple[str, ...]
    steps: list[list[rr.Microbatch]]
    run: Run = Run()
    lr: float = 0.1


async def _train(family: str, job: Job, layout: rr.ProcessLayout, groups: Any) -> dict[str, Any]:
    model = build(family)
    split = rr.split_causal_lm(model, layout.pp)
    mine = split.modules[layout.pp_rank]
    executor = split.executor([layout.pp_rank], rank=layout.rank)
    opt = torch.optim.SGD(mine.parameters(), lr=job.lr)
    p = plan(layout.pp, len(job.steps[0]), job.run)
    losses = []
    try:
        async with rr.DistributedStage(
            layout,
            schedule(p, job.run, job.steps[0]),
            executor,
            groups=groups,
            policy=job.run.policy,
            step_timeout=60,
        ) as stage:
            for mbs in job.steps:
                st = await stage.run_step(mbs, schedule=schedule(p, job.run, mbs))
                opt.step()
                opt.zero_grad(set_to_none=True)
                if st.losses is not None:
                    losses.append(list(st.losses))
    finally:
        executor.close()
    ids = {id(q) for q in mine.parameters()}
    return {
        "params": {n: q.detach().clone() for n, q in model.named_parameters() if id(q) in ids},
        "losses": losses,
        "shared": split.shared,
    }


def worker(rank: int, world: int, job: Job) -> dict[str, dict[str, Any]]:
    """Body of every rank: each family of ``job`` on a ``world``-stage pipeline."""
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    out = {}
    for family in job.families:
        out[family] = rr.run(_train(family, job, layout, groups))
        torch.distributed.barrier()
    return out
