"""Side by side with DeepSpeed's own ``PipelineEngine``: the same ``PipelineModule``, the
same microbatches, the same emulated GPU time, real processes on gloo, interleaved in one run.

Design note
-----------
Each rank builds the same ``PipelineModule`` four times (one stage per rank, each the peer
benchmark's ``PeerStage``: a ``Linear`` whose forward and backward also sleep for a declared,
seeded duration per token, emulated GPU time; see ``_peer``) and hands each to
``deepspeed.initialize``: DeepSpeed's own engine (its ``TrainSchedule``, 1F1B), and
``rrfp_async.deepspeed``'s with ``policy="strict"`` (DeepSpeed's order on the runtime) and
with no argument (the default: it learns each batch's sizes, bytes and task times and plans
a batch of varying sizes cost-aware within the bytes DeepSpeed's order holds on it), and
with ``memory_budget=1.5`` (1.5x those bytes: speed bought with memory, reported as such).
The four train on the same data and take the same
optimizer steps (plain SGD), so their losses agree, which is checked.

Per step every rank enters a barrier and runs one ``train_batch`` per engine, the engines
in a rotating order; a step's time is the slowest rank's (an all-reduce of each rank's
time); engines are compared step by step (paired ratios, their median). Activation bytes:
the peer benchmark's saved-tensor meter (``LiveBytes``) inside each ``PeerStage``, alike for
every engine (a forward's saved tensors, its input and output, from the forward until its
backward reaches the output); a row's peak is its largest over timed steps and ranks.

Two workloads: ``uniform`` (every microbatch of a step the step's mean length, no jitter)
and ``variable`` (the peer benchmark's multimodal lengths with lognormal jitter on every
duration; DeepSpeed with ``dynamic_shape=True``, which sends each tensor's shape ahead).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["DeepSpeedBenchConfig", "deepspeed_benchmark", "main"]

ENGINES = ("deepspeed", "rr_strict", "rr_default", "rr_bytes_1.5")
"""DeepSpeed's engine; ours strict (DeepSpeed's order); ours with no argument; ours with
``memory_budget=1.5`` (speed bought with memory: 1.5x the bytes DeepSpeed's order holds)."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedBenchConfig:
    """What ``deepspeed_benchmark`` runs.

    Attributes:
        stages: Pipeline stages (one process each).
        microbatches: Microbatches per step (``gradient_accumulation_steps``).
        steps: Timed steps per engine.
        warmup_steps: Untimed steps first.
        workload: ``"uniform"`` or ``"variable"``.
        us_per_token: Emulated forward µs per token of a stage (backward 2x).
        jitter: Sigma of the lognormal noise on every emulated duration (variable only).
        hidden: Feature width of the activations.
        seed: Seed of the sizes and the noise.
    """

    stages: int = 4
    microbatches: int = 8
    steps: int = 6
    warmup_steps: int = 2
    workload: str = "variable"
    us_per_token: float = 40.0
    jitter: float = 0.3
    hidden: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.stages < 2 or self.microbatches < 1 or self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("need stages >= 2, microbatches >= 1, steps >= 1, warmup >= 0")
        if self.workload not in ("uniform", "variable"):
            raise ValueError(f"workload must be 'uniform' or 'variable', got {self.workload!r}")


def _peer_config(cfg: DeepSpeedBenchConfig) -> Any:
    from ._peer_config import PeerConfig

    return PeerConfig(
        stages=cfg.stages,
        microbatches=cfg.microbatches,
        steps=cfg.steps,
        warmup_steps=cfg.warmup_steps,
        us_per_token=cfg.us_per_token,
        hidden=cfg.hidden,
        jitter=cfg.jitter if cfg.workload == "variable" else 0.0,
        seed=cfg.seed,
        workload="multimodal" if cfg.workload == "variable" else "uniform",
    )


def _engine(kind: str, cfg: DeepSpeedBenchConfig) -> Any:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    import rrfp_async.deepspeed as rr_ds

    from ._peer_stage import PeerStage, peer_loss

    if kind == "deepspeed":
        rr_ds.uninstall()
    elif kind == "rr_strict":
        rr_ds.install(policy="strict")
    elif kind == "rr_bytes_1.5":
        rr_ds.install(memory_budget=1.5)
    else:
        rr_ds.install()
    torch.manual_seed(0)
    module = PipelineModule(
        layers=[LayerSpec(PeerStage, cfg.hidden, v) for v in range(cfg.stages)],
        num_stages=cfg.stages,
        loss_fn=peer_loss,
        partition_method="uniform",
        dynamic_shape=cfg.workload == "variable",
    )
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.microbatches,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "steps_per_print": 1_000_000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        config=ds_cfg,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
    )
    return engine


def worker(cfg: DeepSpeedBenchConfig, out: Path) -> None:
    """One rank of the benchmark (under torchrun): rank 0 writes ``out`` (JSON)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from ._peer_config import make_steps
    from ._peer_stage import LiveBytes, PeerStage, fill_table, make_inputs

    deepspeed.init_distributed(dist_backend="gloo")
    pcfg = _peer_config(cfg)
    steps = make_steps(pcfg)
    fill_table(steps, 1)
    engines = {k: _engine(k, cfg) for k in ENGINES}
    stages = {
        k: [m for m in e.module.modules() if isinstance(m, PeerStage)] for k, e in engines.items()
    }
    times: dict[str, list[float]] = {k: [] for k in ENGINES}
    peaks: dict[str, int] = dict.fromkeys(ENGINES, 0)
    losses: dict[str, list[float]] = {k: [] for k in ENGINES}
    deviations = 0
    for s, st in enumerate(steps):
        batch = [(x, torch.zeros(1)) for x in make_inputs(pcfg, s, st.tokens, None)]
        order = ENGINES[s % len(ENGINES) :] + ENGINES[: s % len(ENGINES)]
        for k in order:
            live = LiveBytes()
            for m in stages[k]:
                m.live = live
            live.begin()
            if cfg.workload == "uniform":  # (each step's length differs: DeepSpeed's rule)
                engines[k].reset_activation_shape()
            dist.barrier()
            t0 = time.perf_counter()
            loss = engines[k].train_batch(iter(batch))
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            live.end()
            for m in stages[k]:
                m.live = None
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            peak = torch.tensor([live.peak], dtype=torch.int64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if s >= cfg.warmup_steps:
                times[k].append(float(took))
                peaks[k] = max(peaks[k], int(peak))
                if k.startswith("rr_") and k != "rr_strict":
                    stats = engines[k].rrfp.last_stats
                    deviations += 0 if stats is None else stats.deviations
            losses[k].append(float(loss))
    dev = torch.tensor([deviations], dtype=torch.int64)
    dist.all_reduce(dev)
    if dist.get_rank() == 0:
        out.write_text(
            json.dumps(
                {
                    "config": asdict(cfg),
                    "times": times,
                    "peak_bytes": peaks,
                    "losses": losses,
                    "deviations": int(dev),
                    "tokens": [list(st.tokens) for st in steps],
                }
            )
        )
    for e in engines.values():
        e.destroy()
    dist.barrier()


def deepspeed_benchmark(cfg: DeepSpeedBenchConfig, *, timeout: float = 1800.0) -> dict[str, Any]:
    """Run the benchmark (``cfg.stages`` processes under torchrun, this Python) and return
    rank 0's results with the paired ratios (``speedup``: DeepSpeed's step time over the
    row's, the median over steps; ``bytes_ratio``: the row's peak over DeepSpeed's)."""
    with tempfile.TemporaryDirectory(prefix="rrfp-ds-bench-") as d:
        out = Path(d) / "result.json"
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(cfg.stages), "-m", "rrfp_lab._deepspeed_bench"]
        cmd += [str(out), json.dumps(asdict(cfg))]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not out.exists():
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-40:])
            raise RuntimeError(f"the DeepSpeed benchmark failed ({r.returncode}):\n{tail}")
        res: dict[str, Any] = json.loads(out.read_text())
    base = res["times"]["deepspeed"]
    res["speedup"] = {
        k: statistics.median(b / t for b, t in zip(base, res["times"][k], strict=True))
        for k in ENGINES
    }
    ref = res["peak_bytes"]["deepspeed"]
    res["bytes_ratio"] = {
        k: (v / ref if ref else float("nan")) for k, v in res["peak_bytes"].items()
    }
    first = res["losses"]["deepspeed"]
    res["losses_agree"] = all(
        max(abs(a - b) for a, b in zip(first, res["losses"][k], strict=True))
        <= 1e-5 * max(1.0, abs(first[0]))
        for k in ENGINES
    )
    return res


def report(res: dict[str, Any]) -> str:
    """The table ``rrfp-async bench deepspeed`` prints."""
    cfg = res["config"]
    lines = [
        f"DeepSpeed PipelineEngine vs rrfp_async.deepspeed: {cfg['workload']} workload, "
        f"{cfg['stages']} stages, {cfg['microbatches']} microbatches, {cfg['steps']} timed steps",
        "(EMULATED GPU time: real torch compute on CPU plus a sleep of "
        f"{cfg['us_per_token']:g} us per token forward, 2x backward; gloo on 127.0.0.1)",
        f"{'engine':<12} {'median step s':>14} {'speedup vs DS':>14}"
        f" {'peak act. bytes':>16} {'bytes vs DS':>12}",
    ]
    for k in ENGINES:
        t = statistics.median(res["times"][k])
        lines.append(
            f"{k:<12} {t:>14.4f} {res['speedup'][k]:>13.3f}x {res['peak_bytes'][k]:>16d}"
            f" {res['bytes_ratio'][k]:>11.3f}x"
        )
    lines.append(
        f"losses agree across engines: {res['losses_agree']}; "
        f"readiness-first deviations from DeepSpeed's order: {res['deviations']}"
    )
    return "\n".join(lines)


def main() -> None:
    """torchrun entry: ``python -m rrfp_lab._deepspeed_bench OUT CONFIG_JSON``."""
    out = Path(sys.argv[1])
    cfg = DeepSpeedBenchConfig(**json.loads(sys.argv[2]))
    worker(cfg, out)


if __name__ == "__main__":
    main()
