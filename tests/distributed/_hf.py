"""Hugging Face models split by hand into pipeline stages, their data and references.

Used by ``test_hf_models.py`` (in the test process and in every spawned rank). Models are
built from tiny configs with random weights (nothing is downloaded), every rank builds the
whole model from the same seed and keeps its own stages: a stage module holds the *same*
submodules as the whole model, so the whole model's parameter names name what each rank
trained, and the reference is that whole model run by plain autograd.

The splits follow each model's own ``forward`` in transformers 5.x (read from the installed
package): GPT-2 blocks are called ``block(hidden, cache, causal_mask)``, Llama layers
``layer(hidden, attention_mask=..., position_embeddings=(cos, sin), position_ids=...)``, and
the causal mask is built by ``create_causal_mask`` exactly as the model builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
)
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

import rrfp_async as rr

VOCAB = 96


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


# --- GPT-2 -----------------------------------------------------------------------------------


def gpt2(seed: int, n_layer: int = 4) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"  # what it computes anyway (silences a warning)
    return model


class GPT2Stage(nn.Module):
    """Blocks ``lo:hi`` of a GPT-2 LM; the first stage also embeds (``wte`` + ``wpe`` of the
    position ids), the last also applies ``ln_f`` and ``lm_head``. The attention mask (a
    side input, ``[batch, seq]`` with 0 at padding) is turned into the causal mask on every
    stage the way ``GPT2Model.forward`` does."""

    def __init__(self, model: GPT2LMHeadModel, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        tr = model.transformer
        self.config = tr.config
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = tr.wte, tr.wpe, tr.drop
        self.h = nn.ModuleList(tr.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = tr.ln_f, model.lm_head

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = _positions(x)
        if self.first:
            emb = self.wte(x)
            h = self.drop(emb + self.wpe(pos))
        else:
            h = x
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=None,
            position_ids=pos,
        )
        for block in self.h:
            h = block(h, None, mask)
        if self.last:
            return self.lm_head(self.ln_f(h))
        return h


def gpt2_stages(model: GPT2LMHeadModel, stages: int) -> list[nn.Module]:
    n = model.config.n_layer
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    return [
        GPT2Stage(model, cuts[i], cuts[i + 1], first=i == 0, last=i == stages - 1)
        for i in range(stages)
    ]


def gpt2_ties(stages: int) -> dict[str, list[tuple[int, str]]]:
    return {"wte": [(0, "wte.weight"), (stages - 1, "lm_head.weight")]}


# --- Llama -----------------------------------------------------------------------------------


def llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).train()
    model.loss_type = "ForCausalLM"
    return model


class LlamaStage(nn.Module):
    """Decoder layers ``lo:hi`` of a Llama LM. The first stage embeds and computes the rotary
    tables once; every boundary is ``rr.Args(hidden, position_embeddings=(cos, sin))``, so
    later stages receive the tables instead of recomputing them (they hold no
    ``rotary_emb``). The last stage applies ``norm`` and ``lm_head``."""

    def __init__(self, model: LlamaForCausalLM, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        m = model.model
        self.config = m.config
        self.first, self.last = first, last
        if first:
            self.embed_tokens, self.rotary_emb = m.embed_tokens, m.rotary_emb
        self.layers = nn.ModuleList(m.layers[lo:hi])
        if last:
            self.norm, self.lm_head = m.norm, model.lm_head

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        pos = _positions(x)
        if self.first:
            h = self.embed_tokens(x)
            position_embeddings = self.rotary_emb(h, position_ids=pos)
        else:
            h = x
        assert position_embeddings is not None
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )
        for layer in self.layers:
            h = layer(
                h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=pos
            )
        if self.last:
            return self.lm_head(self.norm(h))
        return rr.Args(h, position_embeddings=position_embeddings)


def llama_stages(model: LlamaForCausalLM, stages: int) -> list[nn.Module]:
    n = model.config.num_hidden_layers
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    return [
        LlamaStage(model, cuts[i], cuts[i + 1], first=i == 0, last=i == stages - 1)
        for i in range(stages)
    ]


# --- ResNet ----------------------------------------------------------------------------------

NUM_LABELS = 5


def resnet(seed: int) -> ResNetForImageClassification:
    torch.manual_seed(seed)
    cfg = ResNetConfig(  # type: ignore[call-arg]  # num_labels: PretrainedConfig's, via **kwargs
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=NUM_LABELS,
    )
    return ResNetForImageClassification(cfg).train()


class ResNetStage(nn.Module):
    """Encoder stages ``lo:hi`` of a ResNet classifier; the first also runs the embedder
    (conv + BatchNorm + pool), the last the pooler and the classifier."""

    def __init__(
        self, model: ResNetForImageClassification, lo: int, hi: int, *, first: bool, last: bool
    ):
        super().__init__()
        m = model.resnet
        self.first, self.last = first, last
        if first:
            self.embedder = m.embedder
        self.stages = nn.ModuleList(m.encoder.stages[lo:hi])
        if last:
            self.pooler, self.classifier = m.pooler, model.classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embedder(x)
        for s in self.stages:
            x = s(x)
        if self.last:
            return self.classifier(self.pooler(x))
        return x


def resnet_stages(model: ResNetForImageClassification, stages: int) -> list[nn.Module]:
    n = len(model.resnet.encoder.stages)
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    return [
        ResNetStage(model, cuts[i], cuts[i + 1], first=i == 0, last=i == stages - 1)
        for i in range(stages)
    ]


# --- data ------------------------------------------------------------------------------------


def lm_batches(
    steps: int, microbatches: int, *, seed: int, pad: bool, rows: int = 2
) -> list[list[rr.Microbatch]]:
    """Token microbatches of variable length (6-24 tokens per microbatch). With ``pad``,
    each row has its own length within the microbatch, left-padded (mask 0, label -100),
    so the attention mask changes the result of every real token after the padding.
    ``tokens`` counts the predicted labels (what ``ForCausalLMLoss`` averages over)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for i in range(microbatches):
            n = int(torch.randint(6, 25, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (rows, n), generator=g)
            mask = torch.ones(rows, n, dtype=torch.long)
            if pad:
                for r in range(1, rows):
                    k = int(torch.randint(1, n // 2, (1,), generator=g))
                    mask[r, :k] = 0
                ids = ids.masked_fill(mask == 0, 0)
            labels = ids.masked_fill(mask == 0, -100)
            data = {"input_ids": ids, "labels": labels}
            if pad:
                data["attention_mask"] = mask
            tokens = int((labels[:, 1:] != -100).sum())
            mbs.append(rr.Microbatch(index=i, tokens=tokens, data=data))
        out.append(mbs)
    return out


IMAGE_SIZES = (32, 48)


def image_batches(steps: int, microbatches: int, *, seed: int) -> list[list[rr.Microbatch]]:
    """Image microbatches of 2-3 images whose size alternates between 32x32 and 48x48."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for i in range(microbatches):
            side = IMAGE_SIZES[int(torch.randint(0, 2, (1,), generator=g))]
            b = int(torch.randint(2, 4, (1,), generator=g))
            x = torch.randn(b, 3, side, side, generator=g)
            y = torch.randint(0, NUM_LABELS, (b,), generator=g)
            patches = b * side * side // 64
            mbs.append(
                rr.Microbatch(
                    index=i, tokens=patches, patches=patches, data={"pixel_values": x, "labels": y}
                )
            )
        out.append(mbs)
    return out


# --- one model kind: how to build, split, feed and score it ----------------------------------


def lm_loss(logits: torch.Tensor, mb: rr.Microbatch) -> torch.Tensor:
    """The loss ``*ForCausalLM`` computes from ``labels`` (HF's own function)."""
    return ForCausalLMLoss(logits, mb.data["labels"], logits.shape[-1])


def image_loss(logits: torch.Tensor, mb: rr.Microbatch) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.view(-1, NUM_LABELS), mb.data["labels"].view(-1))


def lm_input(mb: rr.Microbatch) -> Any:
    d = mb.data
    if "attention_mask" in d:
        return rr.Args(d["input_ids"], attention_mask=d["attention_mask"])
    return d["input_ids"]


def image_input(mb: rr.Microbatch) -> Any:
    return mb.data["pixel_values"]


def lm_whole(model: nn.Module, mb: rr.Microbatch) -> torch.Tensor:
    """The reference: the whole model's own forward and loss."""
    return model(**mb.data).loss


def image_whole(model: nn.Module, mb: rr.Microbatch) -> torch.Tensor:
    return model(pixel_values=mb.data["pixel_values"], labels=mb.data["labels"]).loss


@dataclasses.dataclass(frozen=True)
class Kind:
    build: Callable[[int], nn.Module]
    split: Callable[[Any, int], list[nn.Module]]
    input_fn: Callable[[rr.Microbatch], Any]
    loss_fn: Callable[[Any, rr.Microbatch], torch.Tensor]
    whole: Callable[[nn.Module, rr.Microbatch], torch.Tensor]
    side_inputs: tuple[str, ...] | None = None


KINDS: dict[str, Kind] = {
    "gpt2": Kind(gpt2, gpt2_stages, lm_input, lm_loss, lm_whole, ("attention_mask",)),
    "llama": Kind(llama, llama_stages, lm_input, lm_loss, lm_whole),
    "resnet": Kind(resnet, resnet_stages, image_input, image_loss, image_whole),
}


# --- one training run ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One training configuration: the same model, data and optimizer under one policy,
    hint and backward."""

    policy: str = "readiness_first"
    hint: str = "breadth_first_weighted"
    split: bool = False
    optimizer: str = "sgd"
    loss_scale: str = "microbatch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """What every rank trains: ``runs`` one after the other, each from the same init."""

    kind: str
    runs: tuple[Run, ...]
    batches: list[list[rr.Microbatch]]
    seed: int = 0
    declare_ties: bool = True
    check_ties: bool = True
    freeze_first: bool = False


def make_optimizer(name: str, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        # eps 1e-6, not 1e-8: Adam divides by a gradient's running magnitude, so gradients
        # that are mathematically zero and numerically rounding noise (~1e-11: GPT-2's key
        # bias, softmax ignores a constant shift) would get updates of ~lr/500 that depend
        # on summation order; 1e-6 keeps those far below the tolerance.
        return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)
    raise ValueError(name)


def _dedup(params: Any) -> list[nn.Parameter]:
    out: list[nn.Parameter] = []
    for p in params:
        if all(p is not q for q in out):
            out.append(p)
    return out


def build(job: Job, stages: int) -> tuple[nn.Module, list[nn.Module]]:
    kind = KINDS[job.kind]
    model = kind.build(job.seed)
    mods = kind.split(model, stages)
    if job.freeze_first:
        mods[0].requires_grad_(False)
    return model, mods


def scaled(loss: torch.Tensor, mb: rr.Microbatch, mbs: Sequence[rr.Microbatch], how: str) -> Any:
    """A microbatch's share of the step loss, the executor's exact expression."""
    if how == "tokens":
        return loss * (mb.tokens / sum(m.tokens for m in mbs))
    return loss / len(mbs)


def snapshot(model: nn.Module, mods: Sequence[nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """The whole model's parameters and buffers held by ``mods``, by the whole model's names
    (a tied weight appears once, under its first name)."""
    pids = {id(p) for m in mods for p in m.parameters()}
    bids = {id(b) for m in mods for b in m.buffers()}
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in pids},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers() if id(b) in bids},
    }


def plan_for(job: Job, run: Run, stages: int) -> rr.StepPlan:
    return rr.StepPlan(
        topology=rr.Topology(stages=stages),
        microbatches=len(job.batches[0]),
        split_backward=run.split,
        ordered_weights=run.split,
    )


def forward_order(plan: rr.StepPlan, run: Run, mbs: Sequence[rr.Microbatch]) -> list[int]:
    """The order the first stage runs its forwards in: its hint's (every forward there is
    ready at once, so each policy follows the hint's order; later stages get them in that
    order). A size-aware hint puts heavy microbatches first."""
    return [t.mb for t in schedule_for(plan, run.hint, mbs).hint[0] if t.kind == "F"]


def reference(job: Job, run: Run, stages: int = 2) -> dict[str, Any]:
    """Plain autograd on the whole model: same init, data, loss scaling and optimizer, one
    intra-op thread like every spawned rank. The microbatches of a step run in the order the
    pipeline's first stage runs their forwards: BatchNorm's running statistics are an
    exponential average in forward order (parameters do not depend on it beyond rounding).
    After training, one forward-only pass over the first step's microbatches (``eval``)."""
    kind = KINDS[job.kind]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, mods = build(job, stages)
        opt = make_optimizer(run.optimizer, list(model.parameters()))
        plan = plan_for(job, run, stages)
        losses: list[list[float]] = []
        for mbs in job.batches:
            row = [0.0] * len(mbs)
            for i in forward_order(plan, run, mbs):
                loss = kind.whole(model, mbs[i])
                row[i] = float(loss.detach())
                scaled(loss, mbs[i], mbs, run.loss_scale).backward()
            losses.append(row)
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            evals = [float(kind.whole(model, mb)) for mb in job.batches[0]]
        return {**snapshot(model, mods), "losses": losses, "eval": evals}
    finally:
        torch.set_num_threads(n)


def schedule_for(plan: rr.StepPlan, hint: str, mbs: Sequence[rr.Microbatch]) -> rr.StepSchedule:
    """The step's schedule; the cost-aware default hint reads the microbatches' sizes."""
    durations = rr.CostModel().declared(plan, mbs)
    return rr.StepSchedule.build(plan, hint, durations=durations)


async def _train(job: Job, run: Run, layout: rr.ProcessLayout, groups: Any) -> dict[str, Any]:
    kind = KINDS[job.kind]
    stages = layout.pp
    model, mods = build(job, stages)
    mine = {layout.pp_rank: mods[layout.pp_rank]}
    # Every parameter, frozen ones too, as user code often does (`AdamW(model.parameters())`):
    # the optimizer skips a parameter whose .grad is None, and only such a one.
    opt = make_optimizer(run.optimizer, _dedup(p for m in mine.values() for p in m.parameters()))
    shared = gpt2_ties(stages) if job.kind == "gpt2" and job.declare_ties else None
    executor = rr.TorchStageExecutor(
        mine,
        kind.loss_fn,
        input_fn=kind.input_fn,
        side_inputs=kind.side_inputs,
        shared=shared,
        loss_scale=run.loss_scale,  # type: ignore[arg-type]
        rank=layout.rank,
    )
    plan = plan_for(job, run, stages)
    losses: list[list[float]] = []
    deviations = 0
    try:
        async with rr.DistributedStage(
            layout,
            schedule_for(plan, run.hint, job.batches[0]),
            executor,
            groups=groups,
            policy=run.policy,
            check_ties=job.check_ties,
            step_timeout=60,
        ) as stage:
            for mbs in job.batches:
                sched = schedule_for(plan, run.hint, mbs)
                st = await stage.run_step(mbs, schedule=sched)
                opt.step()
                opt.zero_grad(set_to_none=True)
                deviations += st.deviations
                if st.losses is not None:
                    losses.append(list(st.losses))
            # A forward-only step after training: the last stage's losses and outputs.
            st = await stage.run_step(job.batches[0], train=False)
            evals = None if st.losses is None else list(st.losses)
            shapes = None if st.outputs is None else [tuple(o.shape) for o in st.outputs]
    finally:
        executor.close()
    return {
        **snapshot(model, list(mine.values())),
        "losses": losses,
        "eval": evals,
        "eval_shapes": shapes,
        "deviations": deviations,
    }


def train_local(job: Job, run: Run, stages: int) -> list[dict[str, Any]]:
    """``run`` on a ``LocalPipeline`` in this process, each stage cut from its own copy of
    the model (built from the same seed, as each rank builds one): a tied weight is then
    distinct parameter objects in different stages, like across processes."""
    kind = KINDS[job.kind]
    built = [build(job, stages) for _ in range(stages)]
    mods = [built[v][1][v] for v in range(stages)]
    shared = gpt2_ties(stages) if job.kind == "gpt2" and job.declare_ties else None
    executors = [
        rr.TorchStageExecutor(
            {v: mods[v]},
            kind.loss_fn,
            input_fn=kind.input_fn,
            side_inputs=kind.side_inputs,
            shared=shared,
            loss_scale=run.loss_scale,  # type: ignore[arg-type]
            rank=v,
        )
        for v in range(stages)
    ]
    opts = [make_optimizer(run.optimizer, list(m.parameters())) for m in mods]
    plan = plan_for(job, run, stages)
    pipe = rr.LocalPipeline(
        schedule_for(plan, run.hint, job.batches[0]), executors, policy=run.policy
    )
    losses: list[list[float]] = []
    try:
        for mbs in job.batches:
            stats = rr.run(pipe.run_step(mbs, schedule=schedule_for(plan, run.hint, mbs)))
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert stats[-1].losses is not None
            losses.append(list(stats[-1].losses))
        evals = rr.run(pipe.run_step(job.batches[0], train=False))[-1].losses
    finally:
        for ex in executors:
            ex.close()
    out: list[dict[str, Any]] = [
        {**snapshot(built[v][0], [mods[v]]), "losses": [], "eval": None} for v in range(stages)
    ]
    out[-1].update(losses=losses, eval=None if evals is None else list(evals))
    return out


def worker(rank: int, world: int, job: Job) -> list[dict[str, Any]]:
    """Body of every rank: each run of ``job`` in turn, on a 2-rank (``world``-rank)
    pipeline; returns the run's parameters, buffers and losses (CPU tensors, floats)."""
    layout = rr.ProcessLayout.from_world(pp=world)
    groups = rr.build_groups(layout)
    out = []
    for run in job.runs:
        out.append(rr.run(_train(job, run, layout, groups)))
        torch.distributed.barrier()
    return out


def merged(per_rank: Sequence[Mapping[str, Any]], what: str) -> dict[str, list[torch.Tensor]]:
    """``what`` ("params" or "buffers") of one run over the ranks: name -> every rank's copy."""
    out: dict[str, list[torch.Tensor]] = {}
    for r in per_rank:
        for n, t in r[what].items():
            out.setdefault(n, []).append(t)
    return out


def max_diff(
    got: Mapping[str, list[torch.Tensor]], ref: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """The largest difference of any copy from the reference, and which tensor it is in."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return (
        max(((t.double() - ref[n].double()).abs().max().item(), n) for n in ref for t in got[n])
        if ref
        else (0.0, "")
    )
