"""Side by side with megatron-core's own schedules: the same model chunks, the same
microbatches, the same emulated GPU time, real processes on gloo, interleaved in one run.

Design note
-----------
Every configuration runs on the same modules: each virtual stage is the peer benchmark's
``PeerStage`` (a ``Linear`` whose forward and backward also sleep for a declared, seeded
duration per token: emulated GPU time, the host waits as for a CUDA kernel; see ``_peer``),
wrapped as a megatron-core module (``set_input_tensor``) and driven by
``forward_step_func(data_iterator, model) -> (output, loss_func)``. Megatron's rows call
megatron's own ``get_forward_backward_func(pp_size=, vp_size=)`` (1F1B, and interleaved over
``vp`` chunks per rank, with Megatron-LM's p2p settings: ``overlap_p2p_comm`` for the
interleaved one); the drop-in's rows call ``rrfp_async.megatron.get_forward_backward_func``
with the same arguments (Megatron-Bridge's call: ``p2p_communicator=``, ``pg_collection=``)
and rrfp_async's own keywords: megatron's order as the hint (``sizes=False``: it learns
nothing, so the order stays megatron's), the cost-aware hint on declared durations, and the
default (readiness_first, no hint: it learns each call's sizes, bytes and task times from
the run and plans a call of varying sizes with the cost-aware hint within the bytes
megatron's order holds on it). The sleep runs where each system computes: megatron's main
thread, the drop-in's compute thread.

Two workloads, in the same run: ``uniform`` (every microbatch of a step the same length,
no jitter: megatron's fixed-shape path) and ``variable`` (the peer benchmark's multimodal
lengths with lognormal jitter on every duration; megatron with ``variable_seq_lengths``,
which sends each tensor's shape ahead of it). Per step and configuration every process
enters a barrier, runs one training step (no optimizer step, so every configuration
computes the same losses, which is checked) and the slowest rank's time is the step time;
configurations are interleaved step by step and compared step by step (paired ratios). The
efficiency is the lower bound of the step (``rrfp_async.sim.lower_bound`` of the realised
emulated durations) over the measured step.

Bytes (``meter``, on by default): every row's activation bytes are measured on every step
with the same saved-tensor meter, so its cost lands in every row's time alike. Megatron's
rows are metered inside their model chunks (``_peer_stage.LiveBytes`` in the ``PeerStage``
each chunk wraps: a forward's saved tensors, its received input and its output, from the
forward's end until its backward reaches the output), the drop-in's by its executor
(``get_forward_backward_func(measure_activations=True)``: the same meter around megatron's
``forward_step``, so the loss's saved tensors too, until the backward ends). A rank's peak
is the most it held in a step; a row's the largest over its timed steps and ranks, with its
ratio to megatron 1F1B's of the same workload. As in the peer benchmark, a row of ``c``
chunks per rank counts ``1/c`` of what its modules measured (each chunk is a whole
``PeerStage`` standing for ``1/c`` of the rank's model: its emulated time is ``1/c``).

megatron-core assumes a GPU; the worker processes map it to the CPU (``_megatron_cpu``).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rrfp_async import Durations, StepPlan

from ._peer_config import PeerConfig, Step, WorkerRun, make_steps, step_lower_bound

if TYPE_CHECKING:
    from ._peer_stage import LiveBytes

__all__ = ["MegatronBenchConfig", "megatron_benchmark", "megatron_worker"]

WORKLOADS = ("uniform", "variable")


@dataclass(frozen=True, kw_only=True)
class MegatronBenchConfig:
    """What ``megatron_benchmark`` runs.

    Attributes:
        stages: Pipeline ranks (one process each).
        vp: Model chunks per rank of the interleaved rows (2: the peer benchmark's step
            tables hold 1 and 2 chunks).
        microbatches: Microbatches per step.
        steps: Timed steps per configuration.
        warmup_steps: Untimed steps first.
        us_per_token: Emulated forward µs per token of a rank's model share (backward 2x).
        hidden: Feature width of the activations.
        jitter: Sigma of the lognormal noise on every emulated duration (variable workload).
        seed: Seed of the microbatch sizes and of the noise.
        workloads: ``"uniform"`` and / or ``"variable"``.
        policies: The drop-in's policies (with megatron's order as the hint; with
            ``readiness_first``, also the default row: no hint, learned from the run).
        memory_factors: The drop-in's admission bounds, as multiples of megatron's order's.
        cost_aware: Also rows with the cost-aware hint (``breadth_first_weighted``) and each
            step's declared durations (``durations=``).
        timeout: Seconds for the whole run.
        meter: Measure every row's activation bytes on every step (the saved-tensor meter,
            on for all rows alike: its hooks cost every forward a Python call per saved
            tensor); False: no bytes are reported.
    """

    stages: int = 4
    vp: int = 2
    microbatches: int = 16
    steps: int = 5
    warmup_steps: int = 1
    us_per_token: float = 2.0
    hidden: int = 32
    jitter: float = 0.3
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    policies: tuple[str, ...] = ("strict", "readiness_first")
    memory_factors: tuple[float, ...] = (1.0, 2.0)
    cost_aware: bool = True
    timeout: float = 1200.0
    meter: bool = True

    def __post_init__(self) -> None:
        if self.stages < 2 or self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("need stages >= 2, steps >= 1, warmup >= 0")
        if self.vp != 2:
            raise ValueError(f"vp must be 2 (the step tables hold 1 and 2 chunks), got {self.vp}")
        if self.microbatches < self.stages:
            raise ValueError("megatron's interleaved schedule needs microbatches >= stages")
        if not self.workloads or set(self.workloads) - set(WORKLOADS):
            raise ValueError(f"workloads: choose from {WORKLOADS}, got {self.workloads}")
        if not (math.isfinite(self.us_per_token) and self.us_per_token > 0):
            raise ValueError(f"us_per_token must be > 0, got {self.us_per_token!r}")

    def peer(self, workload: str) -> PeerConfig:
        """The peer benchmark's configuration of the same steps (its step tables)."""
        return PeerConfig(
            stages=self.stages,
            microbatches=self.microbatches,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            us_per_token=self.us_per_token,
            hidden=self.hidden,
            jitter=self.jitter if workload == "variable" else 0.0,
            seed=self.seed,
        )


def bench_steps(cfg: MegatronBenchConfig, workload: str) -> list[Step]:
    """Each step's tokens and emulated durations: the peer benchmark's multimodal steps, or
    (uniform) the same steps with every microbatch at the step's mean length, no jitter."""
    steps = make_steps(cfg.peer(workload))
    if workload == "variable":
        return steps
    out = []
    for st in steps:
        t = round(statistics.mean(st.tokens))
        tokens = (t,) * len(st.tokens)
        fw, bw = {}, {}
        for v in (1, cfg.vp):
            per = cfg.us_per_token * 1e-6 / v * t
            fw[v] = [[per] * len(tokens) for _ in range(cfg.stages * v)]
            bw[v] = [[2 * per] * len(tokens) for _ in range(cfg.stages * v)]
        out.append(Step(tokens, fw, bw))
    return out


def _stage_module(config: Any, hidden: int, vstage: int) -> Any:
    """``PeerStage`` as a megatron-core module: the first virtual stage reads the data, the
    others the received tensor (``set_input_tensor``)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.module import MegatronModule

    from ._peer_stage import PeerStage

    class MegatronPeerStage(MegatronModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(config)
            import torch

            self.model_type = ModelType.encoder_or_decoder
            torch.manual_seed(10_000 + vstage)
            self.stage = PeerStage(hidden, vstage)
            self.input_tensor: Any = None

        def set_input_tensor(self, input_tensor: Any) -> None:
            self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

        def forward(self, x: Any) -> Any:
            return self.stage(x if vstage == 0 else self.input_tensor)

    return MegatronPeerStage()


def _forward_step(hidden: int, data_iterator: Any, model: Any) -> Any:
    from ._peer_stage import META

    x = next(data_iterator)
    out = model(x)

    def loss_func(out: Any) -> Any:
        n = int(out[0, 0, -META])  # the microbatch's real tokens
        loss = out[:n, :, :hidden].pow(2).mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def _inputs(cfg: MegatronBenchConfig, workload: str, s: int, st: Step) -> list[Any]:
    """Step ``s``'s microbatches in megatron's ``[seq, batch, hidden]`` layout."""
    from ._peer_stage import make_inputs

    return [
        x.transpose(0, 1).contiguous() for x in make_inputs(cfg.peer(workload), s, st.tokens, None)
    ]


def megatron_worker(rank: int, world: int, cfg: MegatronBenchConfig) -> dict[str, Any]:
    """One process of ``megatron_benchmark`` (module-level, so that ``spawn`` can pickle it):
    builds every configuration's run, then runs each once per step, interleaved."""
    import torch

    from ._megatron_cpu import install

    install()
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rrfp_async.integrations import get_forward_backward_func as rr_fb
    from rrfp_async.integrations import megatron_order
    from rrfp_async.policies import hint_peak

    from ._peer import slowest
    from ._peer_stage import LiveBytes, fill_table

    p = cfg.stages
    ps.initialize_model_parallel(pipeline_model_parallel_size=p)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    r = ps.get_pipeline_model_parallel_rank()
    tables = {w: bench_steps(cfg, w) for w in cfg.workloads}
    total = cfg.warmup_steps + cfg.steps
    runs: list[WorkerRun] = []
    closers: list[Callable[[], None]] = []
    current: list[Any] = [None]  # (workload, chunks) of the filled duration table
    for workload in cfg.workloads:
        steps = tables[workload]
        for chunks in (1, cfg.vp):
            vp = chunks if chunks > 1 else None
            kw: dict[str, Any] = {}
            if vp is not None:  # Megatron-LM's interleaved p2p setting
                kw.update(
                    virtual_pipeline_model_parallel_size=vp,
                    overlap_p2p_comm=True,
                    batch_p2p_comm=False,
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron's notes on options it deprecates
                config = TransformerConfig(
                    num_layers=p * chunks,
                    hidden_size=cfg.hidden + 3,
                    num_attention_heads=1,
                    pipeline_model_parallel_size=p,
                    pipeline_dtype=torch.float32,
                    variable_seq_lengths=workload == "variable",
                    moe_token_dispatcher_type="alltoall",
                    **kw,
                )
            models = [_stage_module(config, cfg.hidden, c * p + r) for c in range(chunks)]
            comm = P2PCommunicator(pp_group=pgc.pp, config=config)
            # Megatron's own, then the drop-in's rows.
            variants: list[tuple[tuple[Any, ...], Any]] = [
                (("megatron", "interleaved" if vp else "1F1B", None, None), megatron_fb(p, vp))
            ]
            done: list[int] = [0]

            def declared(
                plan: StepPlan, steps: list[Step] = steps, done: list[int] = done, v: int = chunks
            ) -> Durations:
                per = cfg.us_per_token * 1e-6 / v
                fw = [[per * t for t in steps[done[0]].tokens]] * plan.num_virtual
                return Durations.from_arrays(plan, fw)

            # Megatron's order as the hint (sizes=False: it learns nothing, so it stays
            # that order), the cost-aware hint on declared durations, and the default: no
            # hint, learned from the run (readiness_first within megatron's order's bytes).
            hints: list[tuple[str, Any, dict[str, Any]]] = [("megatron", None, {"sizes": False})]
            if cfg.cost_aware:
                hints.append(("bfw", "breadth_first_weighted", {"durations": declared}))
            hints.append(("default", None, {}))
            for pol in cfg.policies:
                for label, hint, extra in hints:
                    for mf in cfg.memory_factors if pol != "strict" else (1.0,):
                        if pol == "strict" and label != "megatron":
                            continue
                        if label == "default" and (pol != "readiness_first" or mf != 1.0):
                            continue
                        fb = rr_fb(
                            p,
                            vp,
                            policy=pol,
                            hint=hint,
                            memory_factor=None if mf == 1.0 else mf,
                            step_timeout=120,
                            measure_activations=cfg.meter,
                            **extra,
                        )
                        variants.append((("drop-in", label, pol, mf), fb))
                        closers.append(fb.close)
            for key, fb in variants:
                run = WorkerRun((workload, chunks, *key), chunks, "interleaved", None)
                if key[0] == "megatron":  # what its fixed order holds on this rank
                    order = megatron_order(
                        p, chunks, cfg.microbatches, p, interleaved=vp is not None
                    )
                    run.peak = hint_peak(order[r])
                run.fn = functools.partial(
                    _one_step,
                    cfg=cfg,
                    workload=workload,
                    steps=steps,
                    models=models,
                    fb=fb,
                    comm=comm,
                    pgc=pgc,
                    run=run,
                    done=done,
                    current=current,
                    fill=fill_table,
                    live=LiveBytes() if cfg.meter and key[0] == "megatron" else None,
                )
                runs.append(run)
    try:
        for s in range(total):
            for run in runs:
                assert run.fn is not None
                run.times.append(run.fn(s))
            if rank == 0:
                from rrfp_async.distributed import report_progress

                report_progress(s)
    finally:
        for c in closers:
            c()
    times, peaks = slowest(runs, total)
    ps.destroy_model_parallel()
    return {
        "keys": [run.key for run in runs],
        "times": times,
        "peaks": peaks,
        "losses": [run.losses for run in runs],
        "bytes": [run.peak_bytes for run in runs],
    }


def _one_step(
    s: int,
    *,
    cfg: MegatronBenchConfig,
    workload: str,
    steps: list[Step],
    models: list[Any],
    fb: Any,
    comm: Any,
    pgc: Any,
    run: WorkerRun,
    done: list[int],
    current: list[Any],
    fill: Callable[[Sequence[Step], int], None],
    live: LiveBytes | None = None,
) -> float:
    """Run and time step ``s`` of one configuration (every rank, after a barrier); with the
    meter, record this rank's peak activation bytes (megatron's rows: ``live`` in the
    chunks' modules for this step only; the drop-in's: its executor's)."""
    import torch.distributed as dist

    from rrfp_async.integrations import MegatronForwardBackward

    if current[0] != (workload, run.chunks):
        fill(steps, run.chunks)
        current[0] = (workload, run.chunks)
    done[0] = s
    xs = _inputs(cfg, workload, s, steps[s])
    chunks = len(models)
    iters: Any = [iter(xs) for _ in range(chunks)] if chunks > 1 else iter(xs)
    if live is not None:
        for m in models:
            m.stage.live = live
        live.begin()
    dist.barrier()
    t0 = time.perf_counter()
    losses = fb(
        forward_step_func=functools.partial(_forward_step, cfg.hidden),
        data_iterator=iters,
        model=models,
        num_microbatches=len(xs),
        seq_length=int(xs[0].shape[0]),
        micro_batch_size=1,
        decoder_seq_length=int(xs[0].shape[0]),
        forward_only=False,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=comm,
        pg_collection=pgc,
    )
    t = time.perf_counter() - t0
    if live is not None:
        live.end()
        run.peak_bytes.append(live.peak)
        for m in models:
            m.stage.live = None
    if losses:
        run.losses.append(sum(float(d["loss"]) for d in losses) / len(losses))
    # Megatron's own function has no stats; the drop-in keeps its last step's.
    stats = fb.last_stats if isinstance(fb, MegatronForwardBackward) else None
    if stats is not None:
        run.peak = max(run.peak, stats.peak_inflight)
        if cfg.meter:
            run.peak_bytes.append(stats.held_peak(fb.measured_bytes()))
    for m in models:
        m.zero_grad(set_to_none=True)
    return t


def megatron_benchmark(
    cfg: MegatronBenchConfig, *, on_progress: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.stages`` gloo processes (127.0.0.1); return its rows.

    Returns:
        ``{"config": cfg, "runs": [row, ...], "loss_max_diff": float}``; a row has
        ``workload``, ``chunks``, ``system`` (``megatron`` / ``drop-in``), ``schedule`` (the
        megatron schedule, or the drop-in's hint: ``megatron`` = megatron's order (learning
        off), ``bfw`` = breadth_first_weighted with declared durations, ``default`` = no
        hint: learned from the run), ``policy``, ``memory_factor``,
        ``step_s`` (median of the timed steps), ``vs_megatron_1f1b`` and
        ``vs_megatron_interleaved`` (medians of the paired ratios megatron's step / the
        row's, same workload), ``spread_1f1b`` / ``spread_interleaved`` (their min and max),
        ``efficiency`` (median lower bound / step) and ``peak_inflight``; with
        ``cfg.meter`` the measured activation bytes (``bytes_fields``).
    """
    from rrfp_async.distributed import spawn

    res = spawn(megatron_worker, cfg.stages, cfg, timeout=cfg.timeout, on_progress=on_progress)
    r0, last = res[0], res[-1]
    w = cfg.warmup_steps
    keys = [tuple(k) for k in r0["keys"]]
    times = {k: r0["times"][i][w:] for i, k in enumerate(keys)}
    rows: list[dict[str, Any]] = []
    diff = 0.0
    for workload in cfg.workloads:
        steps = bench_steps(cfg, workload)
        peer = cfg.peer(workload)
        base = {
            c: times[(workload, c, "megatron", "1F1B" if c == 1 else "interleaved", None, None)]
            for c in (1, cfg.vp)
        }
        ref = {
            c: last["losses"][keys.index((workload, c, "megatron", name, None, None))]
            for c, name in ((1, "1F1B"), (cfg.vp, "interleaved"))
        }
        for i, key in enumerate(keys):
            if key[0] != workload:
                continue
            chunks = key[1]
            mine = times[key]
            lbs = [step_lower_bound(peer, st, chunks, "interleaved", False) for st in steps[w:]]
            losses = last["losses"][i]
            for a, b in zip(losses, ref[chunks], strict=True):
                diff = max(diff, abs(a - b))
            row = {
                "workload": workload,
                "chunks": chunks,
                "system": key[2],
                "schedule": key[3],
                "policy": key[4],
                "memory_factor": key[5],
                "step_s": statistics.median(mine),
                "efficiency": statistics.median(lb / t for lb, t in zip(lbs, mine, strict=True)),
                "peak_inflight": int(r0["peaks"][i]),
                "steps_s": list(mine),
            }
            for name, c in (("1f1b", 1), ("interleaved", cfg.vp)):
                ratios = [b / t for b, t in zip(base[c], mine, strict=True)]
                row[f"vs_megatron_{name}"] = statistics.median(ratios)
                row[f"spread_{name}"] = (min(ratios), max(ratios))
            if cfg.meter:
                b1 = keys.index((workload, 1, "megatron", "1F1B", None, None))
                row.update(bytes_fields(res, i, b1, w))
            rows.append(row)
    return {"config": replace(cfg), "runs": rows, "loss_max_diff": diff}


def bytes_fields(res: Sequence[dict[str, Any]], i: int, base: int, w: int) -> dict[str, Any]:
    """Row ``i``'s bytes from every rank's measured peaks (timed steps only), against row
    ``base`` (megatron 1F1B, same workload).

    Returns:
        ``measured_peak_bytes_per_rank`` (each rank's most held in a timed step),
        ``peak_bytes_per_rank`` (the same / the row's chunks per rank: see the design note),
        ``peak_bytes`` (their largest), ``bytes_vs_megatron_1f1b`` (/ megatron 1F1B's
        ``peak_bytes``) and ``bytes_vs_megatron_1f1b_per_rank``.
    """
    chunks = int(res[0]["keys"][i][1])
    measured = [max(r["bytes"][i][w:]) for r in res]
    mine = [b / chunks for b in measured]
    ref = [max(r["bytes"][base][w:]) for r in res]
    return {
        "peak_bytes": int(max(mine)),
        "peak_bytes_per_rank": [int(b) for b in mine],
        "measured_peak_bytes_per_rank": measured,
        "bytes_vs_megatron_1f1b": max(mine) / max(ref),
        "bytes_vs_megatron_1f1b_per_rank": [a / b for a, b in zip(mine, ref, strict=True)],
    }
