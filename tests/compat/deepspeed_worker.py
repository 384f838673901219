"""One rank of the DeepSpeed drop-in's comparison job (``test_deepspeed.py``).

For each configuration named on the command line, the same model, data and seeds train for
``STEPS`` batches (and one ``eval_batch``) three times: on DeepSpeed's own
``PipelineEngine``, and on ``rrfp_async.deepspeed``'s engine with ``policy="strict"`` and with
the default (readiness-first). Each rank writes, per configuration and engine, the losses,
the eval output and its stage's parameters to ``OUT/<config>.<engine>.<rank>.pt``.

The model is gpt-neox-shaped: a ``TiedLayerSpec`` embedding on the first stage whose weight
the last stage reuses for the logits, blocks that carry ``(hidden, attention mask)`` tuples
between stages (the mask a bool tensor, ``set_has_attention_mask``), data turned into
``((ids, mask), labels)`` by a ``set_batch_fn`` function, as gpt-neox's ``train_step_pipe``
feeds its engine.

    torchrun --nproc-per-node 2 tests/compat/deepspeed_worker.py OUT base fp16 ...
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

import rrfp_async.deepspeed as rr_ds

STEPS = 3
VOCAB, DIM = 32, 16

CONFIGS: dict[str, dict[str, Any]] = {
    # name: pipeline stages, precision, ZeRO stage, optimizer, checkpointing, dynamic shapes
    "base": {"pp": 2, "opt": "SGD"},
    "adamw_zero1": {"pp": 2, "zero": 1},
    "checkpointing": {"pp": 2, "ckpt": 1, "zero": 1, "reentrant": False},
    "bf16": {"pp": 2, "prec": "bf16", "zero": 1},
    "fp16": {"pp": 2, "prec": "fp16"},
    "dynamic": {"pp": 2, "dynamic": True},
    "pp4_tied": {"pp": 4, "tied": True},
    "pp4_bf16_ckpt": {"pp": 4, "tied": True, "prec": "bf16", "zero": 1, "ckpt": 1},
    "pp2_dp2_zero1": {"pp": 2, "zero": 1, "tied": True},
    "pp2_dp2_dynamic_fp16": {"pp": 2, "prec": "fp16", "dynamic": True, "tied": True},
    # Variable lengths whose forwards take time by length (a sleep): readiness-first reorders.
    "jitter": {"pp": 4, "dynamic": True, "slow": True, "zero": 1, "gas": 8, "dropout": 0.0},
    # The same with dropout: the default keeps DeepSpeed's forward order (learning off).
    "jitter_dropout": {"pp": 4, "dynamic": True, "slow": True, "gas": 8},
}

SLOW_S_PER_TOKEN = 0.004
"""The ``slow`` configuration's forward sleep per token of the microbatch, per block."""


class Embed(nn.Embedding):
    """``(ids, mask) -> (hidden, mask)``."""

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        ids, mask = x
        return super().forward(ids), mask


class Block(nn.Module):
    """A residual MLP block that carries the mask on (``slow``: its forward also sleeps
    ``SLOW_S_PER_TOKEN`` per token, a long microbatch's work)."""

    def __init__(self, slow: bool = False, dropout: float = 0.1) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.drop = nn.Dropout(dropout)
        self.slow = slow

    def forward(self, x: Any) -> Any:
        h, mask = x
        if self.slow and self.training:
            time.sleep(SLOW_S_PER_TOKEN * h.shape[1])
        return h + self.drop(self.ff(h)) * mask.unsqueeze(-1).to(h.dtype), mask


def logits(embed: nn.Module, x: Any) -> torch.Tensor:
    h, _mask = x
    return h @ embed.weight.t().to(h.dtype)  # type: ignore[operator]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, x: Any) -> torch.Tensor:
        h, _mask = x
        return self.out(h)


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), labels.reshape(-1))


def build(cfg: dict[str, Any]) -> PipelineModule:
    torch.manual_seed(0)
    blocks = [
        LayerSpec(Block, bool(cfg.get("slow")), cfg.get("dropout", 0.1))
        for _ in range(2 * cfg["pp"])
    ]
    first: Any
    last: Any
    if cfg.get("tied"):
        first = TiedLayerSpec("embed", Embed, VOCAB, DIM)
        last = TiedLayerSpec("embed", Embed, VOCAB, DIM, forward_fn=logits)
    else:
        first = LayerSpec(Embed, VOCAB, DIM)
        last = LayerSpec(Head)
    return PipelineModule(
        layers=[first, *blocks, last],
        num_stages=cfg["pp"],
        loss_fn=loss_fn,
        partition_method="uniform",
        activation_checkpoint_interval=cfg.get("ckpt", 0),
        dynamic_shape=bool(cfg.get("dynamic")),
        # (reentrant checkpointing of the embedding would detach it: gpt-neox's list)
        checkpointable_layers=["Block"],
    )


def ds_config(cfg: dict[str, Any]) -> dict[str, Any]:
    opt = cfg.get("opt", "AdamW")
    c: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": cfg.get("gas", 4),
        "optimizer": {"type": opt, "params": {"lr": 0.05 if opt == "SGD" else 0.01}},
        "zero_optimization": {"stage": cfg.get("zero", 0)},
        "steps_per_print": 10_000,
        "gradient_clipping": 1.0,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.002,
                "warmup_max_lr": 0.02,
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
        },
    }
    if "reentrant" in cfg:
        c["pipeline"] = {"use_reentrant": cfg["reentrant"]}
    if cfg.get("prec") == "bf16":
        c["bf16"] = {"enabled": True}
    if cfg.get("prec") == "fp16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return c


def data(cfg: dict[str, Any], n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` microbatches of 2 sequences (lengths 4-12 with dynamic shapes, 2-30 with
    ``slow``, else 8)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    top = 31 if cfg.get("slow") else 13
    for _ in range(n):
        s = (
            int(torch.randint(4 if top == 13 else 2, top, (1,), generator=g))
            if cfg.get("dynamic")
            else 8
        )
        ids = torch.randint(0, VOCAB, (2, s + 1), generator=g)
        out.append({"text": ids})
    return out


def batch_fn(item: dict[str, torch.Tensor]) -> Any:
    """gpt-neox's shape: raw tokens -> ((inputs, attention mask), labels)."""
    ids = item["text"]
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    s = tokens.shape[1]
    mask = torch.ones(tokens.shape[0], s, dtype=torch.bool)
    return (tokens, mask), labels


def run(name: str, engine_kind: str, out: Path) -> None:
    cfg = CONFIGS[name]
    if engine_kind == "deepspeed":
        rr_ds.uninstall()
    else:
        rr_ds.install(policy=engine_kind, step_timeout=120)
    model = build(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        config=ds_config(cfg),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    want = "PipelineEngine" if engine_kind == "deepspeed" else "ReadinessFirstPipelineEngine"
    assert type(engine).__name__ == want, type(engine)
    engine.set_has_attention_mask(True)
    engine.set_batch_fn(batch_fn)
    torch.manual_seed(7)  # dropout
    items = data(cfg, cfg.get("gas", 4) * STEPS)
    it = iter(items)
    losses, deviations, reordered = [], 0, 0
    ds_order = rr_ds.deepspeed_order(cfg["pp"], cfg.get("gas", 4))
    for _ in range(STEPS):
        losses.append(engine.train_batch(it).item())
        runner = getattr(engine, "rrfp", None)
        if runner is not None and runner.last_stats is not None:
            st = runner.last_stats
            deviations += st.deviations
            ran = [e.task for e in st.executed]
            reordered += ran != ds_order[ran[0].stage]
    gas = cfg.get("gas", 4)
    ev = engine.eval_batch(iter(items[:gas])).item()
    # eval_batch's options: the logits of the last microbatch (last stage), no DP reduce.
    ev2, logits = engine.eval_batch(
        iter(items[gas : 2 * gas]), return_logits=True, reduce_output="avg", bcast_loss=True
    )
    # A smaller global batch from now on (fewer accumulation steps), as curricula do.
    dp = torch.distributed.get_world_size() // cfg["pp"]
    engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * 2 * dp)
    losses.append(engine.train_batch(iter(data(cfg, 2))).item())
    params = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    rank = torch.distributed.get_rank()
    torch.save(
        {
            "losses": losses,
            "eval": ev,
            "eval2": float(ev2),
            "logits": None if logits is None else logits.detach().float().clone(),
            "params": params,
            "deviations": deviations,
            "reordered": reordered,
            "learning_off": getattr(getattr(engine, "rrfp", None), "learning_off", None),
        },
        out / f"{name}.{engine_kind}.{rank}.pt",
    )
    engine.destroy()


def error_case(case: str, out: Path) -> None:
    """A misuse on the readiness-first engine: each rank writes what it raised (or "none")
    to ``OUT/error.<case>.<rank>.json``."""
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    rr_ds.install(step_timeout=30, hint="1f1b" if case == "patched_schedule_hint" else None)
    cfg = dict(CONFIGS["base"])
    config = ds_config(cfg)
    stock_steps = ds_schedule.TrainSchedule.steps
    engine = None
    try:
        if case == "gas_mismatch" and rank == 0:
            config["gradient_accumulation_steps"] = 2
        if case == "zero2":  # DeepSpeed's pipeline engine refuses it (an AssertionError)
            config["zero_optimization"] = {"stage": 2}
        if case == "tensor_parallel":
            topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=world // 4)
            torch.manual_seed(0)
            model: Any = PipelineModule(
                layers=[LayerSpec(Embed, VOCAB, DIM), LayerSpec(Block), LayerSpec(Head)],
                topology=topo,
                loss_fn=loss_fn,
            )
        else:
            model = build(cfg)
        if case in ("patched_schedule", "patched_schedule_hint"):

            def steps(self: Any) -> Any:  # diffusion-pipe's kind of patch
                yield from stock_steps(self)

            ds_schedule.TrainSchedule.steps = steps  # type: ignore[method-assign]
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            config=config,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
        )
        engine.set_has_attention_mask(True)
        engine.set_batch_fn(batch_fn)
        n = 2 if case == "dry" else 4 * STEPS
        it = iter(data(cfg, n))
        t0 = time.monotonic()
        for _ in range(STEPS):
            engine.train_batch(it)
        got = {"type": "none", "message": "", "seconds": time.monotonic() - t0}
    except Exception as e:
        got = {"type": type(e).__name__, "message": str(e), "module": type(e).__module__}
    finally:
        ds_schedule.TrainSchedule.steps = stock_steps  # type: ignore[method-assign]
        if engine is not None:
            engine.destroy()
    (out / f"error.{case}.{rank}.json").write_text(json.dumps(got))


def main() -> None:
    out = Path(sys.argv[1])
    deepspeed.init_distributed(dist_backend="gloo")
    if sys.argv[2] == "--errors":
        for case in sys.argv[3:]:
            error_case(case, out)
        torch.distributed.barrier()
        return
    from deepspeed.accelerator import get_accelerator

    fp16 = bool(get_accelerator().is_fp16_supported())
    (out / "fp16_supported").write_text(str(fp16))
    for name in sys.argv[2:]:
        if CONFIGS[name].get("prec") == "fp16" and not fp16:
            continue  # (DeepSpeed's CPU accelerator refuses fp16 on this processor)
        for kind in ("deepspeed", "strict", "readiness_first"):
            run(name, kind, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
