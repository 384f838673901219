"""Train a Hugging Face causal LM (Qwen2) through a 2-process readiness-first pipeline.

Without torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment: the script starts the 2
processes itself on 127.0.0.1; ``--spawn``, once needed for this, is still accepted and
changes nothing):

    python examples/train_hf_causal_lm.py

Under torchrun (one process per pipeline rank, gloo on CPU; the training loop is a plain
synchronous loop in either case: ``with rr.DistributedStage(...)`` + ``run_step_sync``):

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29512 \\
        examples/train_hf_causal_lm.py

The model is ``Qwen2ForCausalLM`` from a small config with random weights (nothing is
downloaded), with its input and output embeddings tied as the small Qwen2 checkpoints are.
One call splits it: ``rr.split_causal_lm(model, 2)`` gives rank 0 the embedding and the first
decoder layers, the last rank the other layers, the final norm and ``lm_head``; every stage
builds the causal mask (from the padding mask, which reaches every stage as a side input),
the position ids and the rotary tables the way the model's own forward does, and the split's
``loss_fn`` is the model's own loss. ``lm_head.weight`` *is* ``model.embed_tokens.weight``:
the split finds that tie (one parameter object in two stages) and ``split.executor`` declares
it; each rank then holds its own copy, and the library sums the two copies' gradients after
every step. Microbatches have different lengths (6-24 tokens) and rows padded within a
microbatch. See docs/hf_models.md for the families it splits and what it refuses. Needs
transformers: ``pip install 'rrfp-async[hf]'`` (without it the script says so in one line).

Each step prints the pipeline's mean loss next to the loss of a plain single-process
reference (the whole model, autograd, same init and data); at the end, how far the
pipeline's parameters are from that reference, next to how far the reference is from itself
when each step's microbatches are summed in reverse order. Both are float rounding: the
pipeline adds the same gradients in another order (the tied weight's two halves on two
ranks), and AdamW, which divides by each gradient's running magnitude, turns the rounding
noise of gradients that are mathematically zero (the attention's key bias: softmax ignores a
constant shift) into updates of ~1e-5.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import rrfp_async as rr

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

VOCAB = 128


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (split over the ranks)")
    ap.add_argument("--policy", default="readiness_first")
    ap.add_argument("--hint", default="breadth_first_weighted")
    ap.add_argument("--split-backward", action="store_true", help="I and W instead of B")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="accepted for old command lines: without torchrun the script starts its processes",
    )
    return ap.parse_args(argv)


def build_model(args: argparse.Namespace) -> Qwen2ForCausalLM:
    """The whole model, from the seed: every rank builds the same one and keeps its stage."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # the hf extra (checked in main)

    torch.manual_seed(args.seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg)
    model.loss_type = "ForCausalLM"  # what model(labels=...) computes (silences a warning)
    return model


def microbatches(args: argparse.Namespace, step: int) -> list[rr.Microbatch]:
    """One step's microbatches: 2 rows of 6-24 tokens, the second row left-padded (mask 0,
    label -100). ``tokens`` (the predicted labels) sizes the cost-aware default hint. The
    text is learnable: each row counts up by a stride of 1-3 from a random start."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    out = []
    for i in range(args.microbatches):
        n = int(torch.randint(6, 25, (1,), generator=g))
        start = torch.randint(1, VOCAB, (2, 1), generator=g)
        stride = torch.randint(1, 4, (2, 1), generator=g)
        ids = (start + stride * torch.arange(n)) % (VOCAB - 1) + 1
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, : int(torch.randint(1, n // 2, (1,), generator=g))] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        data = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        out.append(rr.Microbatch(index=i, tokens=int((labels[:, 1:] != -100).sum()), data=data))
    return out


def reference(
    args: argparse.Namespace, *, reverse: bool = False
) -> tuple[Qwen2ForCausalLM, list[float]]:
    """The whole model trained in this process by plain autograd on the same microbatches
    (loss / M per microbatch, like the pipeline), and its mean loss per step; with
    ``reverse``, each step's microbatches in the opposite order (the same sums, rounded
    differently)."""
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for s in range(args.steps):
        mbs = microbatches(args, s)
        total = 0.0
        for mb in reversed(mbs) if reverse else mbs:
            loss = model(**mb.data).loss
            total += float(loss.detach())
            (loss / len(mbs)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(total / len(mbs))
    return model, losses


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    """Body of every process (``rr.spawn`` or torchrun): train this rank's stage, then
    compare with the single-process reference. The last rank prints."""
    layout = rr.ProcessLayout.from_world(pp=world)
    model = build_model(args)
    # One call: the stage modules of the whole model (each rank keeps only its own), the
    # tie (lm_head.weight is model.embed_tokens.weight: one object in two stages), the
    # model's own loss, and what each stage reads from its microbatch (the padding mask).
    split = rr.split_causal_lm(model, world)
    stage_module = split.modules[layout.pp_rank]
    last = layout.pp_rank == world - 1
    # split.shared == {"0:model.embed_tokens.weight": ((0, "model.embed_tokens.weight"),
    #                                                 (1, "lm_head.weight"))}
    executor = split.executor([layout.pp_rank], rank=layout.rank)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=args.lr)
    plan = rr.StepPlan(
        topology=rr.Topology(stages=world),
        microbatches=args.microbatches,
        split_backward=args.split_backward,
        ordered_weights=args.split_backward,
    )
    cost = rr.CostModel()  # declared cost per token: sizes the default hint's order

    def schedule(mbs: list[rr.Microbatch]) -> rr.StepSchedule:
        return rr.StepSchedule.build(plan, args.hint, durations=cost.declared(plan, mbs))

    ref_model, ref_losses = reference(args)

    # A plain synchronous training loop: the stage runs on an event loop thread of its own.
    first = microbatches(args, 0)
    try:
        with rr.DistributedStage(layout, schedule(first), executor, policy=args.policy) as stage:
            for s in range(args.steps):
                mbs = first if s == 0 else microbatches(args, s)
                t0 = time.perf_counter()
                stats = stage.run_step_sync(mbs, schedule=schedule(mbs))
                ms = (time.perf_counter() - t0) * 1e3
                opt.step()
                opt.zero_grad()
                if last:
                    assert stats.losses is not None
                    loss = sum(stats.losses) / len(stats.losses)
                    print(
                        f"step {s}  loss {loss:.4f}  (reference {ref_losses[s]:.4f})"
                        f"  {len(mbs)} microbatches of {[mb.tokens for mb in mbs]} tokens"
                        f"  {ms:.0f} ms",
                        flush=True,
                    )
    finally:
        executor.close()

    # This rank's parameters against the reference's (the tied weight under its first name).
    ref = dict(ref_model.named_parameters())
    mine = {id(p) for p in stage_module.parameters()}
    rev = dict(reference(args, reverse=True)[0].named_parameters())
    worst = torch.tensor(
        [
            max(
                (p - ref[n]).abs().max().item()
                for n, p in model.named_parameters()
                if id(p) in mine
            ),
            max((rev[n] - ref[n]).abs().max().item() for n in ref),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a tensor crosses the network, no object
    if last:
        print(
            f"max |parameter - single-process reference| = {worst[0].item():.3g}"
            f" over {len(ref)} tensors (the reference with its microbatches reversed:"
            f" {worst[1].item():.3g})",
            flush=True,
        )


def require(module: str, extra: str) -> None:
    """Exit with one line saying what to install, not a traceback, when ``module`` is
    missing."""
    if importlib.util.find_spec(module) is None:
        sys.exit(f"{os.path.basename(__file__)} needs {module}: pip install 'rrfp-async[{extra}]'")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    require("transformers", "hf")
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start them here
        rr.spawn(train, 2, args, timeout=300)
        return
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    try:
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.barrier()  # nobody tears the group down while a peer still communicates
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
