"""Side by side with torch.distributed.pipelining: the same stage modules, the same
microbatches, the same emulated GPU time, real processes on gloo, interleaved in one run.

Design note
-----------
A benchmark against a peer is only fair if both systems run the *same* work. Here every
virtual stage is one module (``PeerStage``): a ``Linear`` whose forward and backward also
sleep for a declared, seeded duration (emulated GPU time: the host waits, like for a CUDA
kernel). The sleep sits in two autograd ops, so that a split backward pays for what it
computes: the input-gradient pass (``I``) sleeps in an op on the activation path, the
weight-gradient pass (``W``) in an op on the weight (``linear(x, sleep_w(weight))``); a full
backward (``B``) passes both. Durations are looked up per (step, virtual stage, microbatch,
kind) in a table every process computes from the same seed: per token of the microbatch's
*real* length, backward = 2x forward (I = W = forward), lognormal jitter. Each activation
carries its microbatch's metadata (real tokens, index, step) in three trailing columns, so a
module knows what it is costing under either runtime.

torch's runtime can only be charged inside its modules, where the weight-gradient sleep
has to be a custom autograd op on the weight; the executor's real I/W split falls back to
recomputing for such ops (it would charge W = I + W). So rrfp_async's rows run the same
modules without that one op, and the executor sleeps the weight-gradient share after the
task's real compute (``TableCost``: 0 for F and I, W's share for B and W). Every task
sleeps as many times as under torch (F once, I once, W once, B twice: I in the module, W
after it), so sleep overshoot and cold caches after a sleep cost both systems alike.

torch freezes shapes at its first step: it gets microbatches padded to the longest of the
run, with the emulated cost of the real tokens (this isolates scheduling); a second row per
torch schedule (``padded_cost``) charges the padded length, which is what torch really pays
on variable-length data. rrfp_async gets the real shapes.

Per step and configuration, every process enters a barrier, runs one training step (no
optimizer step: the weights stay put, so every configuration computes the same losses,
which the benchmark checks), and the slowest rank's time is the step time. Configurations
are interleaved step by step (the machine is noisy); the median over the timed steps is
reported. Efficiency = a lower bound of the step (``rrfp_async.lower_bound`` of the
realized emulated durations, no communication, no host compute) / the measured step.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._costs import CostModel, Durations, make_workload
from .._tasks import StepPlan, Topology
from ..distributed._torch_executor import EmulatedCost

__all__ = [
    "TORCH_SCHEDULES",
    "PeerConfig",
    "PeerRun",
    "peer_benchmark",
]

TORCH_SCHEDULES: dict[str, tuple[int, str]] = {
    "Schedule1F1B": (1, "interleaved"),
    "ScheduleGPipe": (1, "interleaved"),
    "ScheduleInterleaved1F1B": (2, "interleaved"),
    "ScheduleLoopedBFS": (2, "interleaved"),
    "ScheduleInterleavedZeroBubble": (2, "interleaved"),
    "ScheduleZBVZeroBubble": (2, "vshape"),
    "ScheduleDualPipeV": (2, "vshape"),
}
"""torch schedule class name -> (model chunks per rank, placement of virtual stages)."""

_TORCH_SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_META = 3  # trailing columns: real tokens, microbatch index, step


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """What ``peer_benchmark`` runs.

    Attributes:
        stages: Pipeline ranks (one process each).
        microbatches: Microbatches per step.
        steps: Timed steps per configuration.
        warmup_steps: Untimed steps first (torch infers shapes, threads start).
        us_per_token: Emulated forward µs per token of a rank's model share (backward 2x).
        hidden: Feature width of the activations (sets the message size).
        jitter: Sigma of the lognormal noise on every emulated duration.
        seed: Seed of the microbatch sizes and of the noise.
        torch_schedules: torch schedule class names (``TORCH_SCHEDULES``).
        padded_cost: torch schedules that get a second row charged at the padded length.
        hints: rrfp_async hints; ``interleaved_1f1b`` runs on 2 chunks per rank; ``name:split``
            runs the hint on a split backward (I/W), as ``zb_h1`` always does.
        policies: rrfp_async policies.
        memory_factors: Admission bounds as multiples of 1F1B's.
        timeout: Seconds for the whole run.
    """

    stages: int = 4
    microbatches: int = 16
    steps: int = 7
    warmup_steps: int = 1
    us_per_token: float = 2.0
    hidden: int = 32
    jitter: float = 0.3
    seed: int = 0
    torch_schedules: tuple[str, ...] = (
        "Schedule1F1B",
        "ScheduleGPipe",
        "ScheduleInterleaved1F1B",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
    )
    padded_cost: tuple[str, ...] = ("Schedule1F1B",)
    hints: tuple[str, ...] = (
        "1f1b",
        "breadth_first_weighted",
        "breadth_first_weighted:split",
        "zb_h1",
    )
    policies: tuple[str, ...] = ("strict", "readiness_first", "backfill")
    memory_factors: tuple[float, ...] = (1.0, 2.0)
    timeout: float = 1200.0

    def __post_init__(self) -> None:
        if self.stages < 2 or self.microbatches < 1 or self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("need stages >= 2, microbatches >= 1, steps >= 1, warmup >= 0")
        if not (math.isfinite(self.us_per_token) and self.us_per_token > 0):
            raise ValueError(f"us_per_token must be > 0, got {self.us_per_token!r}")
        for s in self.torch_schedules + self.padded_cost:
            if s not in TORCH_SCHEDULES:
                raise ValueError(
                    f"unknown torch schedule {s!r}; choose from {list(TORCH_SCHEDULES)}"
                )


@dataclass(frozen=True, kw_only=True)
class PeerRun:
    """One configuration's result (the fields of ``--json``'s runs)."""

    system: str
    schedule: str | None
    hint: str | None
    policy: str | None
    memory_factor: float | None
    step_s: float
    speedup_vs_torch_1f1b: float
    efficiency: float
    peak_inflight: int
    steps_s: tuple[float, ...] = field(default=())
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON row."""
        return {
            "system": self.system,
            "schedule": self.schedule,
            "hint": self.hint,
            "policy": self.policy,
            "memory_factor": self.memory_factor,
            "step_s": self.step_s,
            "speedup_vs_torch_1f1b": self.speedup_vs_torch_1f1b,
            "efficiency": self.efficiency,
            "peak_inflight": self.peak_inflight,
            "steps_s": list(self.steps_s),
            "note": self.note,
        }


# ---------------------------------------------------------------------- the stage module

_TABLE: dict[tuple[int, int, int, str], float] = {}
"""(step, virtual stage, microbatch, kind) -> emulated seconds, for this process."""


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd`` s and whose backward sleeps ``bwd`` s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.bwd = bwd
        if fwd > 0:
            time.sleep(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd > 0:
            time.sleep(ctx.bwd)
        return g, None, None


class PeerStage(nn.Module):
    """One virtual stage: ``Linear`` + emulated GPU time (see the module's design note).

    The input is ``[1, rows, hidden + 3]``: features, then real tokens, microbatch index and
    step in every row (rows past the real tokens are padding). With ``weight_sleep=False``
    the weight-gradient share is not slept here: the caller's executor sleeps it
    (``TableCost``).
    """

    def __init__(
        self, hidden: int, vstage: int, *, padded_cost: bool = False, weight_sleep: bool = True
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.vstage = vstage
        self.padded_cost = padded_cost
        self.weight_sleep = weight_sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats, meta = x[..., :-_META], x[..., -_META:].detach()
        tokens, mb, step = (int(v) for v in meta[0, 0].tolist())
        key = (step, self.vstage, mb)
        # torch's shape inference runs the module on placeholder data: no cost then.
        scale = x.shape[1] / tokens if self.padded_cost and tokens > 0 else 1.0
        f, i, w = (_TABLE.get((*key, k), 0.0) * scale for k in ("F", "I", "W"))
        weight = self.lin.weight
        if self.weight_sleep:
            weight = _Sleep.apply(weight, 0.0, w)  # type: ignore[no-untyped-call]
        h = torch.nn.functional.linear(feats, weight, self.lin.bias)
        h = _Sleep.apply(torch.tanh(h), f, i)  # type: ignore[no-untyped-call]
        return torch.cat([h, meta], dim=-1)


def _loss(out: torch.Tensor, _target: Any) -> torch.Tensor:
    feats, meta = out[..., :-_META], out[..., -_META:]
    n = int(meta[0, 0, 0])
    return feats[:, :n].pow(2).mean()


# ---------------------------------------------------------------------- data and costs


@dataclass(frozen=True)
class _Step:
    tokens: tuple[int, ...]
    # [chunks][vstage][mb] forward/backward seconds for V = 1 and V = 2
    forward: dict[int, list[list[float]]]
    backward: dict[int, list[list[float]]]


def _make_steps(cfg: PeerConfig) -> list[_Step]:
    out = []
    total = cfg.warmup_steps + cfg.steps
    for s in range(total):
        wl = make_workload("multimodal", cfg.microbatches, virtual_stages=1, seed=cfg.seed + s)
        tokens = tuple(mb.tokens for mb in wl.microbatches)
        rng = random.Random(hash((cfg.seed, s, "noise")) & 0xFFFFFFFF)
        fw: dict[int, list[list[float]]] = {}
        bw: dict[int, list[list[float]]] = {}
        for v in (1, 2):
            nv = cfg.stages * v
            per = cfg.us_per_token * 1e-6 / v
            fw[v] = [[per * t * _noise(rng, cfg.jitter) for t in tokens] for _ in range(nv)]
            bw[v] = [[2 * per * t * _noise(rng, cfg.jitter) for t in tokens] for _ in range(nv)]
        out.append(_Step(tokens, fw, bw))
    return out


def _noise(rng: random.Random, sigma: float) -> float:
    return math.exp(rng.gauss(0.0, sigma) - 0.5 * sigma * sigma) if sigma > 0 else 1.0


def _fill_table(steps: Sequence[_Step], chunks: int) -> None:
    _TABLE.clear()
    for s, st in enumerate(steps):
        for v, row in enumerate(st.forward[chunks]):
            for m, f in enumerate(row):
                b = st.backward[chunks][v][m]
                _TABLE[(s, v, m, "F")] = f
                _TABLE[(s, v, m, "I")] = b / 2
                _TABLE[(s, v, m, "W")] = b / 2


def _inputs(
    cfg: PeerConfig, step: int, tokens: Sequence[int], pad: int | None
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    out = []
    for m, t in enumerate(tokens):
        rows = pad if pad is not None else t
        x = torch.zeros(1, rows, cfg.hidden + _META)
        x[0, :t, : cfg.hidden] = torch.randn(t, cfg.hidden, generator=g)
        x[0, :, cfg.hidden :] = torch.tensor([t, m, step], dtype=torch.float32)
        out.append(x)
    return out


def _plan(cfg: PeerConfig, chunks: int, placement: str, split: bool) -> StepPlan:
    topo = Topology(stages=cfg.stages, chunks=chunks, placement=placement)  # type: ignore[arg-type]
    return StepPlan(topology=topo, microbatches=cfg.microbatches, split_backward=split)


def _lower_bound(cfg: PeerConfig, st: _Step, chunks: int, placement: str, split: bool) -> float:
    from ..sim._simulate import lower_bound

    plan = _plan(cfg, chunks, placement, split)
    return lower_bound(plan, Durations.from_arrays(plan, st.forward[chunks], st.backward[chunks]))


# ---------------------------------------------------------------------- the worker


def _modules(
    cfg: PeerConfig, rank: int, chunks: int, placement: str, padded: bool, weight_sleep: bool = True
) -> dict[int, PeerStage]:
    topo = Topology(stages=cfg.stages, chunks=chunks, placement=placement)  # type: ignore[arg-type]
    mods = {}
    for v in topo.stages_of(rank):
        torch.manual_seed(10_000 + v)
        mods[v] = PeerStage(cfg.hidden, v, padded_cost=padded, weight_sleep=weight_sleep)
    return mods


@dataclass(frozen=True, kw_only=True)
class TableCost(EmulatedCost):
    """The weight-gradient share of the benchmark's emulated time, slept by a
    ``TorchStageExecutor`` after a task's real compute: W's share of the step's table for B
    and W tasks, nothing for F and I (the module sleeps those). See the module's note.

    Attributes:
        steps: The run's steps (their duration tables).
        chunks: Model chunks per rank (which table).
    """

    cost: CostModel = field(default_factory=CostModel)
    steps: tuple[_Step, ...] = ()
    chunks: int = 1

    def durations(
        self, plan: StepPlan, microbatches: Sequence[Any], step: int, rank: int
    ) -> Durations:
        """Seconds per task of ``step``: B and W get W's share, F and I nothing."""
        st = self.steps[step]
        zeros = [[0.0] * len(row) for row in st.forward[self.chunks]]
        w = [[b / 2 for b in row] for row in st.backward[self.chunks]]
        return Durations.from_arrays(plan, zeros, w, input_grad_share=0.0)


def _torch_peak(order: Sequence[Any]) -> int:
    live = peak = 0
    for a in order:
        if a is None:
            continue
        kind = str(a.computation_type)
        if "FORWARD" in kind and "BACKWARD" not in kind:
            live += 1
        elif "FULL_BACKWARD" in kind or "WEIGHT" in kind:
            live -= 1
        peak = max(peak, live)
    return peak


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Every rank enters a barrier, then runs ``fn``: its seconds and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peer_worker(rank: int, world: int, cfg: PeerConfig) -> dict[str, Any]:
    """One process of ``peer_benchmark`` (module-level, so that ``spawn`` can pickle it)."""
    import torch.distributed.pipelining as tpp

    from ..distributed._layout import ProcessLayout, build_groups
    from ..distributed._stage import DistributedStage
    from ..distributed._torch_executor import TorchStageExecutor
    from ..loop._runner import loop_factory
    from ..policies._schedule import StepSchedule

    steps = _make_steps(cfg)
    total = len(steps)
    pad = max(max(st.tokens) for st in steps)
    layout = ProcessLayout.from_world(pp=cfg.stages)
    groups = build_groups(layout)
    one_way = _raw_one_way(cfg, rank, steps)

    runs: list[_Run] = []
    closers: list[Callable[[], None]] = []

    for name in cfg.torch_schedules:
        chunks, placement = TORCH_SCHEDULES[name]
        for padded in (False, True) if name in cfg.padded_cost else (False,):
            mods = _modules(cfg, rank, chunks, placement, padded)
            tstages = [
                tpp.PipelineStage(mod, v, cfg.stages * chunks, torch.device("cpu"))
                for v, mod in sorted(mods.items())
            ]
            cls = getattr(tpp, name)
            try:
                sched = (
                    cls(tstages[0], n_microbatches=cfg.microbatches, loss_fn=_loss)
                    if chunks == 1
                    else cls(tstages, n_microbatches=cfg.microbatches, loss_fn=_loss)
                )
            except Exception as e:  # e.g. a schedule that needs more microbatches
                runs.append(_Run(("torch", name, padded), chunks, placement, None, error=str(e)))
                continue
            order = getattr(sched, "pipeline_order", None)
            run = _Run(("torch", name, padded), chunks, placement, None, split=name in _TORCH_SPLIT)
            run.peak = (
                _torch_peak(order.get(rank, []))
                if isinstance(order, dict)
                else (cfg.microbatches if name == "ScheduleGPipe" else cfg.stages - rank)
            )

            def run_torch(
                s: int, sched: Any = sched, mods: dict[int, PeerStage] = mods, run: _Run = run
            ) -> float:
                batch = torch.cat(_inputs(cfg, s, steps[s].tokens, pad), dim=0)
                out: list[torch.Tensor] = []
                args = (batch,) if 0 in mods else ()
                if cfg.stages * len(mods) - 1 in mods:  # the last virtual stage is here
                    t, _ = _timed(lambda: sched.step(*args, target=batch, losses=out))
                    run.losses.append(sum(float(x.detach()) for x in out) / cfg.microbatches)
                else:
                    t, _ = _timed(lambda: sched.step(*args))
                for m in mods.values():
                    m.zero_grad(set_to_none=True)
                return t

            run.fn = run_torch
            runs.append(run)

    factory = loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    for hint in cfg.hints:
        name, split = _rr_split(hint)
        chunks, placement = _rr_chunks(name)
        plan = _plan(cfg, chunks, placement, split)
        mods = _modules(cfg, rank, chunks, placement, False, weight_sleep=False)
        executor = TorchStageExecutor(
            mods, _loss, rank=rank, emulate=TableCost(steps=tuple(steps), chunks=chunks)
        )
        closers.append(executor.close)
        for mf in cfg.memory_factors:
            for pol in cfg.policies:
                run = _Run(("rrfp_async", hint, pol, mf), chunks, placement, None, split=split)
                first = StepSchedule.build(plan, name, memory_factor=mf)

                def run_rr(
                    s: int,
                    pol: str = pol,
                    plan: StepPlan = plan,
                    chunks: int = chunks,
                    executor: TorchStageExecutor = executor,
                    mods: dict[int, PeerStage] = mods,
                    run: _Run = run,
                    first: StepSchedule = first,
                ) -> float:
                    st = steps[s]
                    declared = Durations.from_arrays(
                        plan,
                        [[cfg.us_per_token * 1e-6 / chunks * t for t in st.tokens]]
                        * plan.num_virtual,
                    )
                    xs = _inputs(cfg, s, st.tokens, None)

                    async def go() -> tuple[float, Any]:
                        # The channel opens and closes outside the timed part; the per-step
                        # hint (a cost-aware one reads this step's sizes) is inside it.
                        async with DistributedStage(
                            layout, first, executor, groups=groups, policy=pol, step_timeout=120
                        ) as ds:
                            dist.barrier()
                            t0 = time.perf_counter()
                            sch = first.with_durations(declared)
                            stats = await ds.run_step(xs, step=s, schedule=sch)
                            return time.perf_counter() - t0, stats

                    t, stats = loop.run_until_complete(go())
                    run.peak = max(run.peak, stats.peak_inflight)
                    if executor.losses:
                        run.losses.append(sum(executor.losses.values()) / cfg.microbatches)
                    for m in mods.values():
                        m.zero_grad(set_to_none=True)
                    return t

                run.fn = run_rr
                runs.append(run)

    _fill_table(steps, 1)
    current = 1
    try:
        for s in range(total):
            for run in runs:
                if run.fn is None:
                    continue
                if run.chunks != current:
                    _fill_table(steps, run.chunks)
                    current = run.chunks
                run.times.append(run.fn(s))
            if rank == 0:
                from ..distributed._spawn import report_progress

                report_progress(s)
    finally:
        for c in closers:
            c()
        loop.close()
    lbs = {
        (c, p, sp): [_lower_bound(cfg, st, c, p, sp) for st in steps]
        for c, p, sp in {(r.chunks, r.placement, r.split) for r in runs}
    }
    # The step time is the slowest rank's; the peak the largest of any rank.
    local = torch.tensor([r.times[i] if r.times else 0.0 for r in runs for i in range(total)])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    peaks = torch.tensor([r.peak for r in runs], dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    # Losses live on the last rank; everyone reports them, the caller reads rank P-1's.
    return {
        "one_way_s": one_way,
        "keys": [r.key for r in runs],
        "errors": [r.error for r in runs],
        "times": local.view(len(runs), total).tolist(),
        "peaks": peaks.tolist(),
        "losses": [r.losses for r in runs],
        "lower_bounds": [lbs[(r.chunks, r.placement, r.split)] for r in runs],
    }


def _raw_one_way(cfg: PeerConfig, rank: int, steps: Sequence[_Step], reps: int = 20) -> float:
    """One-way seconds of a raw blocking gloo send of a mean-sized activation (rank 0 <-> 1)."""
    rows = round(statistics.mean(t for st in steps for t in st.tokens))
    x = torch.zeros(1, rows, cfg.hidden + _META)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
    return (time.perf_counter() - t0) / (2 * reps)


@dataclass(eq=False)
class _Run:
    """One configuration in a worker: what it runs and what it measured."""

    key: tuple[Any, ...]
    chunks: int
    placement: str
    fn: Callable[[int], float] | None
    split: bool = False
    error: str = ""
    peak: int = 0
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------- the driver


def peer_benchmark(
    cfg: PeerConfig, *, on_progress: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.stages`` gloo processes (127.0.0.1); return the runs.

    Returns:
        ``{"config": ..., "runs": [PeerRun.to_dict(), ...], "loss_max_diff": float,
        "comm_share": ...}``; ``speedup_vs_torch_1f1b`` is the median over the timed steps
        of torch ``Schedule1F1B``'s step time (real-token cost) / the configuration's in the
        same step (1.0 there; NaN when it was not run); ``efficiency`` the median of
        lower bound / step time.
    """
    from ..distributed._spawn import spawn

    res = spawn(peer_worker, cfg.stages, cfg, timeout=cfg.timeout, on_progress=on_progress)
    r0, last = res[0], res[-1]
    w = cfg.warmup_steps
    keys = [tuple(k) for k in r0["keys"]]
    med = {k: statistics.median(r0["times"][i][w:]) for i, k in enumerate(keys)}
    # Every step has its own microbatches: compare configurations step by step (paired),
    # then take the median of those ratios; a ratio of medians would compare different steps.
    bi = (
        keys.index(("torch", "Schedule1F1B", False))
        if ("torch", "Schedule1F1B", False) in keys
        else -1
    )
    base_steps = r0["times"][bi][w:] if bi >= 0 else None
    ref: list[float] = next((ls for ls in last["losses"] if ls), [])
    diff = 0.0
    checked = 0
    rows: list[PeerRun] = []
    for i, key in enumerate(keys):
        err = r0["errors"][i]
        lbs = r0["lower_bounds"][i]
        steps_s = tuple(r0["times"][i][w:])
        ok = not err
        eff = (
            statistics.median(lb / t for lb, t in zip(lbs[w:], steps_s, strict=True))
            if ok
            else math.nan
        )
        ls = last["losses"][i]
        if ls and ref:
            diff = max(diff, max(abs(a - b) for a, b in zip(ls, ref, strict=True)))
            checked += 1
        torch_row = key[0] == "torch"
        rows.append(
            PeerRun(
                system=key[0],
                schedule=key[1] if torch_row else None,
                hint=None if torch_row else key[1],
                policy=None if torch_row else key[2],
                memory_factor=None if torch_row else key[3],
                step_s=med[key] if ok else math.nan,
                speedup_vs_torch_1f1b=(
                    statistics.median(b / t for b, t in zip(base_steps, steps_s, strict=True))
                    if ok and base_steps is not None
                    else math.nan
                ),
                efficiency=eff,
                peak_inflight=int(r0["peaks"][i]),
                steps_s=steps_s if ok else (),
                note=(
                    f"cannot run: {err}" if err else "padded cost" if torch_row and key[2] else ""
                ),
            )
        )
    steps = _make_steps(cfg)
    mean_task = statistics.mean(
        x for st in steps[w:] for tab in (st.forward[1], st.backward[1]) for row in tab for x in row
    )
    return {
        "config": cfg,
        "runs": [r.to_dict() for r in rows],
        "loss_max_diff": diff,
        "losses_checked": checked,
        "one_way_s": r0["one_way_s"],
        "mean_task_s": mean_task,
        "comm_share": r0["one_way_s"] / mean_task,
    }


def _rr_split(hint: str) -> tuple[str, bool]:
    """``"name:split"`` runs the hint on a split backward (I/W); ``zb_h1`` always splits."""
    name, _, flag = hint.partition(":")
    return name, flag == "split" or name in ("zb_h1", "zbh1")


def _rr_chunks(hint: str) -> tuple[int, str]:
    return (2, "interleaved") if hint in _TWO_CHUNK_HINTS else (1, "interleaved")


_TWO_CHUNK_HINTS = ("interleaved_1f1b", "interleaved", "looped_bfs")


SIMULATED: tuple[tuple[str, str, float, bool], ...] = (
    ("1f1b", "strict", 1.0, False),
    ("gpipe", "strict", 1.0, False),
    ("breadth_first_weighted", "strict", 1.0, False),
    ("breadth_first_weighted", "readiness_first", 1.0, False),
    ("breadth_first_weighted", "readiness_first", 2.0, False),
    ("breadth_first_weighted", "readiness_first", 1.0, True),
    ("breadth_first_weighted", "readiness_first", 2.0, True),
)
"""(hint, policy, memory factor, split backward) rows of ``peer_simulated``."""

_GUIDED = ("breadth_first_weighted", "backward_first", "1f1b", "zb_h1")


def peer_simulated(
    cfg: PeerConfig, *, latency: float = 0.0, guided: bool = True
) -> list[dict[str, Any]]:
    """The same steps in the simulator (virtual time, no host cost): each configuration's
    median ratio to strict 1F1B and median efficiency, step by step as in the real run.

    With ``guided``, two more rows per memory factor: a *simulation-guided* hint (each step,
    simulate every hint of ``_GUIDED`` under ``readiness_first`` on the declared durations,
    keep the fastest) and the *oracle* (the fastest on the realized durations).
    """
    from ..sim._simulate import simulate

    steps = _make_steps(cfg)[cfg.warmup_steps :]
    p, m = cfg.stages, cfg.microbatches

    def run(st: _Step, i: int, hint: str, pol: str, mf: float, split: bool, jitter: float) -> Any:
        fw = [[cfg.us_per_token * 1e-6 * t for t in st.tokens]] * p
        return simulate(
            stages=p,
            microbatches=m,
            forward=fw,
            hint=hint,
            policy=pol,
            memory_factor=mf,
            jitter=jitter,
            seed=cfg.seed * 1000 + i,
            latency=latency,
            split_backward=split,
        )

    base = [run(st, i, "1f1b", "strict", 1.0, False, cfg.jitter) for i, st in enumerate(steps)]
    rows = []
    for hint, pol, mf, split in SIMULATED:
        res = [run(st, i, hint, pol, mf, split, cfg.jitter) for i, st in enumerate(steps)]
        rows.append(_sim_row(f"{hint} {pol} {mf:g}x" + (" split" if split else ""), base, res))
    if guided:
        for mf in (1.0, 2.0):
            picked, best = [], []
            for i, st in enumerate(steps):
                cands = {h: run(st, i, h, "readiness_first", mf, True, cfg.jitter) for h in _GUIDED}
                plan = {h: run(st, i, h, "readiness_first", mf, True, 0.0) for h in _GUIDED}
                picked.append(cands[min(plan, key=lambda h: plan[h].makespan)])
                best.append(min(cands.values(), key=lambda r: r.makespan))
            rows.append(_sim_row(f"simulation-guided readiness_first {mf:g}x split", base, picked))
            rows.append(_sim_row(f"oracle readiness_first {mf:g}x split", base, best))
    return rows


def _sim_row(name: str, base: Sequence[Any], res: Sequence[Any]) -> dict[str, Any]:
    return {
        "configuration": name,
        "vs_strict_1f1b": statistics.median(
            b.makespan / r.makespan for b, r in zip(base, res, strict=True)
        ),
        "efficiency": statistics.median(r.lower_bound / r.makespan for r in res),
    }


def module_host_time(cfg: PeerConfig, *, repeats: int = 2) -> dict[str, float]:
    """Host time of one ``PeerStage`` task beyond its emulated duration, in this process
    (one torch thread): what the efficiency's lower bound does not count, for either system.

    Runs the first timed step's microbatches through a middle stage, forward then full
    backward, ``repeats`` rounds after one warm-up round, with the emulated sleeps and
    without them (real compute only).

    Returns:
        Medians in seconds: ``f_over`` / ``b_over`` (wall time minus emulated time, sleeps on),
        ``f_compute`` / ``b_compute`` (sleeps off), and ``cap``: the efficiency any runtime is
        held to by this alone (mean emulated task / mean emulated task + its overshoot).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    saved = dict(_TABLE)
    try:
        steps = _make_steps(cfg)
        s = cfg.warmup_steps
        mod = PeerStage(cfg.hidden, 1)
        xs = _inputs(cfg, s, steps[s].tokens, None)

        def rounds(sleeps: bool) -> tuple[list[float], list[float], list[float], list[float]]:
            _TABLE.clear()
            if sleeps:
                _fill_table(steps, 1)
            f_over, b_over, f_emu, b_emu = [], [], [], []
            for rep in range(repeats + 1):
                for mb, x0 in enumerate(xs):
                    x = x0.detach().requires_grad_()
                    t0 = time.perf_counter()
                    out = mod(x)
                    t1 = time.perf_counter()
                    torch.autograd.backward(out, torch.ones_like(out))
                    t2 = time.perf_counter()
                    f = _TABLE.get((s, 1, mb, "F"), 0.0)
                    b = _TABLE.get((s, 1, mb, "I"), 0.0) + _TABLE.get((s, 1, mb, "W"), 0.0)
                    if rep:  # the first round warms up (autograd's first backward is slow)
                        f_over.append(t1 - t0 - f)
                        b_over.append(t2 - t1 - b)
                        f_emu.append(f)
                        b_emu.append(b)
            return f_over, b_over, f_emu, b_emu

        f_over, b_over, f_emu, b_emu = rounds(True)
        f_cpu, b_cpu, _, _ = rounds(False)
    finally:
        _TABLE.clear()
        _TABLE.update(saved)
        torch.set_num_threads(threads)
    emu = statistics.mean(f_emu + b_emu)
    over = statistics.mean(f_over + b_over)
    return {
        "f_over": statistics.median(f_over),
        "b_over": statistics.median(b_over),
        "f_compute": statistics.median(f_cpu),
        "b_compute": statistics.median(b_cpu),
        "cap": emu / (emu + over),
    }
