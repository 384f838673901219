"""Train the example image-text model through a multi-process readiness-first pipeline.

Under torchrun (one process per rank, gloo on CPU):

    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29511 \
        examples/train_image_text.py --pp 4 --policy readiness_first --memory-factor 2

or without torchrun (no ``RANK`` / ``WORLD_SIZE`` in the environment: the script starts the
``pp * tp`` processes itself on 127.0.0.1; ``--spawn``, once needed for this, is still
accepted and changes nothing):

    python examples/train_image_text.py
    python examples/train_image_text.py --pp 2 --tp 2

The training loop is the lab's harness for the example model (``rrfp_lab.train_worker``:
the one the demo and the benchmarks run); for your own model and loop see
docs/distributed.md. Microbatches have 0-4 images and 8-48 text tokens (variable shapes
cross the pipeline without padding). Time is real CPU compute of a tiny model plus EMULATED
GPU time: each task also sleeps for its declared cost (per token, per image patch; backward
2x; seeded jitter).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import rrfp_async as rr
import rrfp_lab as lab


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, lab.TrainConfig]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    ap.add_argument("--chunks", type=int, default=1, help="model chunks per rank")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6, help="timed steps (a verdict needs >= 6)")
    ap.add_argument("--hint", default="1f1b")
    ap.add_argument(
        "--policy", action="append", help="repeatable; default strict + readiness_first"
    )
    ap.add_argument("--memory-factor", type=float, default=None)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument(
        "--spawn",
        action="store_true",
        help="accepted for old command lines: without torchrun the script starts its processes",
    )
    ap.add_argument(
        "--trace-dir",
        default=None,
        help="each process writes its trace of the last step to DIR/POLICY/rankR.json;"
        " merge them with: rrfp-async trace DIR/POLICY",
    )
    args = ap.parse_args(argv)
    cfg = lab.TrainConfig(
        pp=args.pp,
        tp=args.tp,
        chunks=args.chunks,
        microbatches=args.microbatches,
        steps=args.steps,
        hint=args.hint,
        memory_factor=args.memory_factor,
        policies=tuple(args.policy or ("strict", "readiness_first")),
        cost=lab.image_text_cost(jitter=args.jitter),
        return_params=False,
        trace_dir=args.trace_dir,
    )
    return args, cfg


def summarize(mine: list[lab.TrainResult], cfg: lab.TrainConfig) -> torch.Tensor:
    """This process's figures as one float64 tensor ``[policy, 2 * steps + 1]``: the timed
    step times, the mean loss of each step (NaN where this rank computes no loss) and the
    number of deviations from the hint. Tensors, not objects, cross the network: nothing a
    peer sends is unpickled."""
    n = cfg.warmup_steps + cfg.steps
    out = torch.full((len(cfg.policies), cfg.steps + n + 1), float("nan"), dtype=torch.float64)
    for i, r in enumerate(mine):
        out[i, : cfg.steps] = torch.tensor(r.step_times, dtype=torch.float64)
        for s, v in r.losses.items():
            out[i, cfg.steps + s] = statistics.mean(v.values())
        out[i, -1] = sum(st.deviations for st in r.stats)
    return out


def report(figures: list[torch.Tensor], cfg: lab.TrainConfig) -> None:
    """Print two lines per policy from every process's ``summarize`` tensor: the median step,
    the speedup over the first policy, deviations and losses; then each timed step (the
    slowest rank's) and the speedup step by step, with its min-max and whether it is noise.

    Step ``i`` of every policy trains on the same microbatches with the same emulated noise,
    so the speedup is paired step by step (``rr.observability.paired_ratio``): the median of
    the per-step ratios, "within noise" unless the signed-rank test finds a difference ("too
    few steps to judge" below 6 steps, where it cannot), and "same order as <first>" when
    neither policy ever left the hint's order (then the ratio is noise whatever it is)."""
    base: tuple[str, list[float], int] | None = None
    print(
        f"{cfg.steps} timed steps per policy, taken in turn; a step = the slowest rank,"
        " from a common barrier (CPU + emulated GPU time)"
    )
    for i, policy in enumerate(cfg.policies):
        rows = [f[i] for f in figures]
        steps = [max(float(r[s]) for r in rows) for s in range(cfg.steps)]
        losses = [float(x) for r in rows for x in r[cfg.steps : -1] if not torch.isnan(x)]
        deviations = int(sum(float(r[-1]) for r in rows))
        base = base or (policy, steps, deviations)
        vs = rr.observability.paired_ratio(base[1], steps, same_order=base[2] == deviations == 0)
        print(
            f"{policy:16} median step {statistics.median(steps) * 1e3:7.1f} ms"
            f"  speedup {vs.median:.3f}x  deviations {deviations:4d}"
            f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}  (CPU + emulated GPU time)"
        )
        per_step = " ".join(f"{t * 1e3:.1f}" for t in steps)
        if i == 0:
            verdict = "the baseline"
        else:
            ratios = " ".join(f"{x:.3f}" for x in vs.ratios)
            verdict = f"vs {base[0]} step by step {ratios}: min-max {vs.spread}, {vs.note(base[0])}"
        print(f"{'':16} steps (ms) {per_step}; {verdict}")


def main(argv: list[str] | None = None) -> None:
    _, cfg = parse(argv)
    if not {"RANK", "WORLD_SIZE"} <= os.environ.keys():  # not under torchrun: start them here
        results = rr.spawn(lab.train_worker, cfg.pp * cfg.tp, cfg, timeout=900)
        report([summarize(r, cfg) for r in results], cfg)
        return
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    try:
        mine = summarize(lab.train_worker(dist.get_rank(), dist.get_world_size(), cfg), cfg)
        rank0 = dist.get_rank() == 0
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.gather(mine, gathered if rank0 else None, dst=0)
        if rank0:
            report(gathered, cfg)
        # Nobody tears the group down while a peer still communicates (a rank whose gather
        # send is still in flight when its group is destroyed can abort).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
