"""A real model side by side with torch.distributed.pipelining: a Hugging Face GPT-2 (small
config, random weights, tied ``wte``/``lm_head``) split into the same pipeline stages, run
by torch ``Schedule1F1B`` and by rrfp_async's default configuration, interleaved step by
step on gloo processes (``rrfp-async bench hf``).

Design note
-----------
Three runs per step, on the same stage modules (built from the same seed in every process)
and the same token sequences:

* ``torch padded``: ``PipelineStage`` + ``Schedule1F1B``. torch's stages keep fixed receive
  buffers (shape inference at the first step), so every microbatch of a step is padded to the
  step's longest sequence; labels are -100 on the pads, so the loss is the mean over real
  tokens, as without padding. A new padded length needs new stages and a new schedule: the
  runs keep one per length, built and run once *before* timing (their shape-inference
  exchange is never timed). torch does not reduce tied parameters across ranks: like a torch
  user, the run all-reduces the tied ``wte``/``lm_head`` gradient between the first and the
  last rank after ``step()`` (timed, part of the step).
* ``ours variable``: ``rr.DistributedStage`` + ``rr.TorchStageExecutor`` in the default
  configuration (default hint and policy, no declared durations) on the real lengths: a
  microbatch's sequences share one length (a length-grouped loader), nothing is padded. The
  tie is declared (``rr.split_model`` finds it) and reduced by the stage.
* ``ours padded``: the same stage on torch's padded batches (runtime overhead only).

Before the timed steps each system runs one untimed step (plan check, tie discovery, torch's
shape inference). Per step every process enters a barrier, the step is timed, and the slowest
rank's time is the step time. The order of the three runs rotates from step to step; ratios
are paired per step (torch's time / ours in the same step). No optimizer step: the weights
stay put, so the losses are comparable: torch padded vs ours padded, and ours variable vs a
plain single-process forward of the whole model on the same microbatches.

Emulated GPU time (``us_per_token`` > 0): every transformer block sleeps ``us_per_token``
per token it computes (padded tokens included, as a GPU would pay them) in the forward and
twice that in the backward, in an autograd op inside the block (``_peer_stage``'s
``_Sleep``), so both systems pay it alike. With 0 the compute is the real CPU compute only.

Bytes (``meter``, on by default): every run's activation bytes are measured on every step
with the same saved-tensor meter, its cost in every run's time alike. torch's stage module
is metered from inside (``_MeteredStage`` around it, ``_peer_stage.LiveBytes``: a forward's
saved tensors, its received input and its output, until its backward reaches the output;
the last rank's loss, computed by torch's schedule, measured into its forward's bytes), ours
by the executor (``measure_activations=True``: the same, the loss inside the forward, until
the backward ends). torch keeps the last stage's output (the logits) until its backward;
ours keeps only the loss, so torch's last rank holds the logits more. A rank's peak is the
most it held in a step. ``torch real lengths``: torch's recorded order of each step replayed
on the bytes ours measured on the real lengths of that step (``replay_peak``): what torch's
order would hold without padding.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._peer_stage import LiveBytes, _Sleep, replay_peak

__all__ = ["HFConfig", "hf_benchmark", "hf_worker", "make_steps"]

RUNS = ("torch padded", "ours variable", "ours padded")


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """The workload of ``rrfp-async bench hf``.

    Attributes:
        stages: Pipeline ranks (gloo processes), one stage each.
        microbatches: Microbatches per step.
        seqs: Sequences per microbatch (they share one length, drawn per microbatch).
        min_len: Shortest sequence, tokens.
        max_len: Longest sequence, tokens.
        layers: GPT-2 blocks (``n_layer``).
        hidden: ``n_embd``.
        heads: ``n_head``.
        vocab: ``vocab_size``.
        steps: Timed steps.
        warmup_steps: Steps run and discarded before the timed ones.
        us_per_token: Emulated forward µs per token per block (backward twice that); 0: none.
        seed: Seed of the weights and of the data.
        timeout: Seconds for the whole job.
        meter: Measure every run's activation bytes on every step (the saved-tensor meter,
            on for all runs alike: its hooks cost every forward a Python call per saved
            tensor); False: no bytes are reported.
    """

    model: str = "gpt2"
    stages: int = 2
    microbatches: int = 12
    seqs: int = 2
    min_len: int = 16
    max_len: int = 160
    layers: int = 8
    hidden: int = 128
    heads: int = 4
    vocab: int = 1000
    steps: int = 6
    warmup_steps: int = 1
    us_per_token: float = 0.0
    seed: int = 0
    timeout: float = 900.0
    meter: bool = True

    def __post_init__(self) -> None:
        if self.model != "gpt2":
            raise ValueError(f"model: only 'gpt2' is supported, got {self.model!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"lengths: need 1 <= min_len <= max_len, got {self.min_len}..{self.max_len}"
            )
        if self.stages > self.layers + 2:
            raise ValueError(f"stages: {self.stages} stages for {self.layers} blocks + 2")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Batch:
    """One microbatch: token ids and next-token labels (-100 where nothing is predicted)."""

    ids: torch.Tensor
    labels: torch.Tensor


def make_steps(cfg: HFConfig) -> list[list[Batch]]:
    """Every step's microbatches at their real lengths (the same in every process)."""
    g = torch.Generator().manual_seed(cfg.seed * 7919 + 1)
    out = []
    for _ in range(cfg.warmup_steps + cfg.steps + 1):  # +1: the untimed first step
        step = []
        for _ in range(cfg.microbatches):
            n = int(torch.randint(cfg.min_len, cfg.max_len + 1, (1,), generator=g))
            ids = torch.randint(0, cfg.vocab, (cfg.seqs, n), generator=g)
            labels = torch.cat([ids[:, 1:], torch.full((cfg.seqs, 1), -100)], dim=1)
            step.append(Batch(ids, labels))
        out.append(step)
    return out


def pad(step: Sequence[Batch]) -> list[Batch]:
    """The step's microbatches padded to its longest (ids 0, labels -100 on the pads)."""
    n = max(b.ids.shape[1] for b in step)
    return [
        Batch(
            F.pad(b.ids, (0, n - b.ids.shape[1])),
            F.pad(b.labels, (0, n - b.ids.shape[1]), value=-100),
        )
        for b in step
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the real tokens (labels -100 are ignored)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def _batch_loss(logits: torch.Tensor, mb: Batch) -> torch.Tensor:
    return lm_loss(logits, mb.labels)


def _batch_ids(mb: Batch) -> torch.Tensor:
    return mb.ids


# ------------------------------------------------------------------------------ model


class _Embed(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.wte: nn.Module = model.transformer.wte
        self.wpe: nn.Module = model.transformer.wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))  # type: ignore[no-any-return]


class _Block(nn.Module):
    """A GPT-2 block (causal attention, no mask: right pads never reach a real token), with
    emulated GPU time when ``us`` > 0."""

    def __init__(self, block: nn.Module, us: float) -> None:
        super().__init__()
        self.block = block
        self.us = us

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.block(h)
        out = out[0] if isinstance(out, tuple) else out
        if self.us > 0:
            f = self.us * 1e-6 * h.shape[0] * h.shape[1]
            out = _Sleep.apply(out, f, 2 * f)  # type: ignore[no-untyped-call]
        return out  # type: ignore[no-any-return]


class _Head(nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.ln_f: nn.Module = model.transformer.ln_f
        self.lm_head: nn.Module = model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))  # type: ignore[no-any-return]


class _MeteredStage(nn.Module):
    """torch's stage module with the meter inside: each training forward measured
    (``LiveBytes.run``), the microbatch numbered in the order the forwards run
    (``Schedule1F1B`` runs a rank's forwards in microbatch order; ``begin`` restarts the
    count). torch's shape inference (a new padded length's first step, untimed) runs one
    forward more: its step's bytes are not used."""

    def __init__(self, inner: nn.Module, stage: int, live: LiveBytes) -> None:
        super().__init__()
        self.inner = inner
        self.stage = stage
        self.live = live
        self.count = 0

    def begin(self) -> None:
        """A step begins: the next forward is microbatch 0's."""
        self.count = 0
        self.live.begin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.device.type == "meta":
            return self.inner(x)  # type: ignore[no-any-return]
        mb, self.count = self.count, self.count + 1
        return self.live.run(self.stage, mb, self.inner, self.inner, x)


def build_blocks(cfg: HFConfig) -> list[nn.Module]:
    """``[embeddings, blocks..., ln_f + lm_head]`` of a fresh GPT-2 (random weights from
    ``cfg.seed``, dropout 0, ``lm_head`` tied to ``wte``)."""
    import transformers

    torch.manual_seed(cfg.seed)
    conf = transformers.GPT2Config(
        n_layer=cfg.layers,
        n_embd=cfg.hidden,
        n_head=cfg.heads,
        vocab_size=cfg.vocab,
        n_positions=max(cfg.max_len, 8),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(conf)
    assert model.lm_head.weight is model.transformer.wte.weight
    return [
        _Embed(model),
        *(_Block(b, cfg.us_per_token) for b in model.transformer.h),
        _Head(model),
    ]


def split_spec(cfg: HFConfig) -> list[str] | int:
    """Equal blocks per stage, the embeddings with the first, the head with the last (an
    even split by count when the blocks do not divide)."""
    if cfg.layers % cfg.stages:
        return cfg.stages
    per = cfg.layers // cfg.stages
    return [str(1 + k * per) for k in range(1, cfg.stages)]


def reference_losses(cfg: HFConfig, steps: Sequence[Sequence[Batch]]) -> list[float]:
    """Plain single-process forward of the whole model: each step's mean microbatch loss."""
    from rrfp_async.distributed import split_model

    split = split_model(build_blocks(cfg), 1)
    out = []
    with torch.no_grad():
        for step in steps:
            out.append(
                statistics.fmean(float(lm_loss(split.modules[0](b.ids), b.labels)) for b in step)
            )
    return out


# ------------------------------------------------------------------------------ worker


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_worker(rank: int, world: int, cfg: HFConfig) -> dict[str, Any]:
    """One process of ``hf_benchmark`` (module-level, so that ``spawn`` can pickle it)."""
    import torch.distributed.pipelining as tpp

    from rrfp_async import StepPlan, Topology
    from rrfp_async.distributed import (
        DistributedStage,
        ProcessLayout,
        TorchStageExecutor,
        build_groups,
        split_model,
    )
    from rrfp_async.loop import loop_factory
    from rrfp_async.policies import StepSchedule

    steps = make_steps(cfg)
    padded = [pad(s) for s in steps]
    last = rank == world - 1
    layout = ProcessLayout.from_world(pp=world)
    groups = build_groups(layout)

    # -- torch: one stage + schedule per padded length, ties all-reduced after step().
    tsplit = split_model(build_blocks(cfg), split_spec(cfg))
    tmod = tsplit.modules[rank]
    live = LiveBytes() if cfg.meter else None
    metered = _MeteredStage(tmod, rank, live) if live is not None else None

    def tloss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # With the meter, the last rank's loss is measured into its forward's bytes.
        return lm_loss(out, labels) if live is None else live.loss(lm_loss, out, labels)

    # torch's own p2p group: our stage's channel (open over the run) uses the default one.
    tgroup = dist.new_group(list(range(world)), backend="gloo")
    tie_groups = []
    for entries in tsplit.shared.values():
        ranks = sorted({v for v, _ in entries})
        g = dist.new_group(ranks, backend="gloo")  # collective: every rank, same order
        if rank in ranks:
            name = next(n for v, n in entries if v == rank)
            tie_groups.append((tmod.get_parameter(name), g))
    scheds: dict[int, Any] = {}

    def torch_step(s: int) -> float:
        batch = padded[s]
        n = batch[0].ids.shape[1]
        if n not in scheds:
            st = tpp.PipelineStage(metered or tmod, rank, world, torch.device("cpu"), group=tgroup)
            scheds[n] = tpp.Schedule1F1B(st, n_microbatches=cfg.microbatches, loss_fn=tloss)
        sched = scheds[n]
        ids = torch.cat([b.ids for b in batch])
        labels = torch.cat([b.labels for b in batch])
        losses: list[torch.Tensor] = []

        def go() -> None:
            if rank == 0:
                sched.step(ids)
            elif last:
                sched.step(target=labels, losses=losses)
            else:
                sched.step()
            for p, g in tie_groups:  # what torch leaves to its user
                assert p.grad is not None
                dist.all_reduce(p.grad, group=g)

        if metered is not None:
            metered.begin()
        t = _timed(go)
        if metered is not None:
            metered.live.end()
            held["torch padded"].append(metered.live.peak)
            orders.append(metered.live.order)
        if last:
            results["torch padded"][1].append(statistics.fmean(float(x.detach()) for x in losses))
        tmod.zero_grad(set_to_none=True)
        return t

    # -- ours: the default configuration, one stage kept open over the run.
    osplit = split_model(build_blocks(cfg), split_spec(cfg))
    omods = osplit.modules_of([rank])
    ex = TorchStageExecutor(
        omods,
        _batch_loss if last else None,
        rank=rank,
        input_fn=_batch_ids,
        shared=osplit.shared,
        measure_activations=cfg.meter,
    )
    plan = StepPlan(topology=Topology(stages=world), microbatches=cfg.microbatches)
    factory = loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    ds = DistributedStage(layout, StepSchedule.build(plan), ex, groups=groups, step_timeout=300)

    def ours_step(mbs: Sequence[Batch], key: str) -> float:
        async def go() -> tuple[float, Any]:
            dist.barrier()
            t0 = time.perf_counter()
            stats = await ds.run_step(mbs)
            return time.perf_counter() - t0, stats

        t, stats = loop.run_until_complete(go())
        if cfg.meter:
            nbytes = ex.activation_bytes()
            held[key].append(stats.held_peak(nbytes))
            if key == "ours variable":
                measured.append(nbytes)
        if last:
            results[key][1].append(statistics.fmean(ex.losses.values()))
        for m in omods.values():
            m.zero_grad(set_to_none=True)
        return t

    results: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in RUNS}
    # With the meter: each step's peak bytes on this rank per run, torch's order of each
    # step and ours' measured bytes on the real lengths (replayed on each other at the end).
    held: dict[str, list[int]] = {k: [] for k in RUNS}
    orders: list[list[tuple[int, int, int]]] = []
    measured: list[dict[tuple[int, int], int]] = []
    fns: dict[str, Callable[[int], float]] = {
        "torch padded": torch_step,
        "ours variable": lambda s: ours_step(steps[s], "ours variable"),
        "ours padded": lambda s: ours_step(padded[s], "ours padded"),
    }
    loop.run_until_complete(ds.__aenter__())
    try:
        # Untimed: every padded length torch will meet (its shape inference), and our
        # first step (plan check, tie discovery).
        seen: set[int] = set()
        for s, batch in enumerate(padded):
            if batch[0].ids.shape[1] not in seen:
                seen.add(batch[0].ids.shape[1])
                torch_step(s)
        fns["ours variable"](0)
        for v in results.values():
            v[0].clear()
            v[1].clear()
        for h in held.values():
            h.clear()
        orders.clear()
        measured.clear()
        for s in range(1, len(steps)):
            order = RUNS[s % 3 :] + RUNS[: s % 3]
            for key in order:
                results[key][0].append(fns[key](s))
            if rank == 0:
                from rrfp_async.distributed import report_progress

                report_progress(s)
    finally:
        loop.run_until_complete(ds.__aexit__(None, None, None))
        ex.close()
        loop.close()
    times = torch.tensor([results[k][0] for k in RUNS])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {
        "times": times.tolist(),
        "losses": [results[k][1] for k in RUNS],
        "bytes": [held[k] for k in RUNS],
        "real": [replay_peak(o, b) for o, b in zip(orders, measured, strict=True)],
    }


def hf_benchmark(
    cfg: HFConfig, *, on_progress: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.stages`` gloo processes; return the step times, the paired
    ratios and the loss checks.

    Returns:
        ``{"config", "step_s": {run: median}, "speedup": {"ours variable" | "ours padded":
        {"median", "min", "max", "per_step"}}, "loss_check": {...}, "tokens": {...},
        "bytes": hf_bytes(...) or None without the meter}``; a speedup is torch padded's step
        time / ours in the same step (> 1: ours is faster).
    """
    from rrfp_async.distributed import spawn

    res = spawn(hf_worker, cfg.stages, cfg, timeout=cfg.timeout, on_progress=on_progress)
    w = cfg.warmup_steps
    times = {k: res[0]["times"][i][w:] for i, k in enumerate(RUNS)}
    losses = {k: res[-1]["losses"][i] for i, k in enumerate(RUNS)}
    steps = make_steps(cfg)[1:]
    ref = reference_losses(cfg, steps)
    speedup = {}
    for k in RUNS[1:]:
        r = [a / b for a, b in zip(times["torch padded"], times[k], strict=True)]
        speedup[k] = {"median": statistics.median(r), "min": min(r), "max": max(r), "per_step": r}

    def diff(a: Sequence[float], b: Sequence[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    loss_check = {
        "torch_padded_vs_ours_padded": diff(losses["torch padded"], losses["ours padded"]),
        "ours_variable_vs_reference": diff(losses["ours variable"], ref),
        "torch_padded_vs_reference": diff(losses["torch padded"], ref),
        "tolerance": 1e-5,
    }
    loss_check["passed"] = (
        loss_check["torch_padded_vs_ours_padded"] <= 1e-5
        and loss_check["ours_variable_vs_reference"] <= 1e-5
    )
    timed = steps[w:]
    real = sum(b.ids.numel() for st in timed for b in st)
    padded_tokens = sum(max(b.ids.shape[1] for b in st) * cfg.seqs * len(st) for st in timed)
    return {
        "config": asdict(cfg),
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "speedup": speedup,
        "loss_check": loss_check,
        "tokens": {"real": real, "padded": padded_tokens, "padding_factor": padded_tokens / real},
        "bytes": hf_bytes(res, w) if cfg.meter else None,
    }


def hf_bytes(res: Sequence[dict[str, Any]], w: int) -> dict[str, dict[str, Any]]:
    """Each run's peak activation bytes from every rank's measurements (timed steps only,
    after ``w`` warm-up ones), and ``torch real lengths`` (torch's order on ours' bytes of
    the real lengths).

    Returns:
        ``{run: {"peak_bytes", "peak_bytes_per_rank", "vs_torch_padded",
        "vs_torch_padded_per_rank"}}`` (a rank's most held in a timed step, the largest of
        them, their ratios to torch padded's); ``ours variable`` also has
        ``vs_torch_real_lengths`` (its peak / torch's order's on the same real lengths).
    """
    per = {k: [max(r["bytes"][i][w:]) for r in res] for i, k in enumerate(RUNS)}
    per["torch real lengths"] = [max(r["real"][w:]) for r in res]
    ref = per["torch padded"]
    out = {
        k: {
            "peak_bytes": max(b),
            "peak_bytes_per_rank": b,
            "vs_torch_padded": max(b) / max(ref),
            "vs_torch_padded_per_rank": [x / y for x, y in zip(b, ref, strict=True)],
        }
        for k, b in per.items()
    }
    out["ours variable"]["vs_torch_real_lengths"] = max(per["ours variable"]) / max(
        per["torch real lengths"]
    )
    return out
