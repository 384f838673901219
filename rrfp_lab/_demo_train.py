"""Training the example image-text model through a real multi-process pipeline.

``train_worker`` is the body of every process (under ``rrfp_async.spawn`` or torchrun): it
builds this rank's model chunks, runs several policies on the same microbatches (same
initial weights, same emulated noise; their steps interleaved, so that load drift hits them
alike), and returns per policy the final
parameters, the step times and the stage statistics. The demo, the benchmarks and the
equivalence tests all use it, so what they compare is one code path. Public as
``rrfp_lab.TrainConfig``, ``TrainResult``, ``train_worker`` and ``image_text_cost``.

Data: the PP and TP ranks of one data-parallel replica see the same microbatches; each DP
replica draws its own (``TrainConfig.batches(dp_rank)``), and the gradients are averaged
over the replicas before every optimizer step.

Time on a CPU: real torch compute of a tiny model plus *emulated GPU time* (the compute
thread sleeps for the declared cost of each task: per token, per image patch, backward 2x,
seeded jitter). Reports say so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rrfp_async import (
    ActivationBytes,
    CostModel,
    Microbatch,
    PlanError,
    StageProfile,
    StepPlan,
    Topology,
)
from rrfp_async.distributed import (
    DistributedStage,
    EmulatedCost,
    LearnedBytes,
    ProcessLayout,
    TorchStageExecutor,
    build_groups,
    report_progress,
)
from rrfp_async.loop import StepStats, run
from rrfp_async.observability import (
    LogFormat,
    LogObserver,
    MultiObserver,
    TraceData,
    TraceRecorder,
    chrome_trace,
    configure_logging,
    rank_trace_path,
    write_trace,
)
from rrfp_async.policies import StepSchedule
from rrfp_lab.models import TPContext
from rrfp_lab.models.image_text import (
    ImageTextConfig,
    build_stage_modules,
    loss_fn,
    make_microbatches,
)

__all__ = [
    "TrainConfig",
    "TrainResult",
    "fixed_microbatches",
    "image_text_cost",
    "train_worker",
]


def image_text_cost(
    *,
    per_token: float = 4e-5,
    per_patch: float = 4e-5,
    jitter: float = 0.2,
    multimodal: bool = True,
) -> CostModel:
    """The declared GPU cost model of the example image-text model.

    LLM stages cost by tokens; with ``multimodal``, virtual stage 0 is a vision encoder that
    costs mostly by image patches. Every stage adds a fixed 0.2 ms; backward costs 2x
    forward (``CostModel``'s default). This is the *model* of the costs (a ``CostModel``):
    ``TrainConfig(cost=...)`` takes it, and wraps it in an ``rr.EmulatedCost`` that makes
    each task sleep for its realized duration on a CPU.

    Args:
        per_token: Forward seconds per token of an LLM stage.
        per_patch: Forward seconds per image patch of the vision stage.
        jitter: Sigma of the mean-one lognormal noise on every realized duration.
        multimodal: Give virtual stage 0 the vision profile (else all stages are LLM).

    Returns:
        The ``CostModel``.
    """
    llm = StageProfile(per_token=per_token, fixed=2e-4)
    vision = StageProfile(per_patch=per_patch, per_token=per_token / 10, fixed=2e-4)
    return CostModel(profiles=(vision,) if multimodal else (), default=llm, jitter=jitter)


def fixed_microbatches(
    n: int, cfg: ImageTextConfig, *, seed: int, text: int = 24
) -> list[Microbatch]:
    """``n`` text-only microbatches of one length: equal tensor shapes everywhere.

    With equal shapes a mismatched collective does not fail on a size check, it silently
    mixes microbatches; the TP divergence tests need exactly that (``equal_lengths``).

    Args:
        n: Number of microbatches.
        cfg: Model sizes (``vocab`` and the empty image tensor's shape).
        seed: Seed of the ``torch.Generator`` that draws the tokens.
        text: Text tokens per microbatch.

    Returns:
        ``Microbatch(index=i, tokens=text, data={"images": <0 images>, "text": ...})`` for
        ``i`` in ``0..n-1``.
    """
    g = torch.Generator().manual_seed(seed)
    return [
        Microbatch(
            index=i,
            tokens=text,
            data={
                "images": torch.zeros((0, cfg.channels, cfg.image_size, cfg.image_size)),
                "text": torch.randint(0, cfg.vocab, (text,), generator=g),
            },
        )
        for i in range(n)
    ]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What ``train_worker`` runs (every process gets the same config).

    Validated on construction (``PlanError``). The DP degree is not a field: it is
    ``world / (pp * tp)`` of the job that runs it.

    Attributes:
        pp: Pipeline ranks.
        tp: TP ranks per stage.
        chunks: Model chunks per rank.
        microbatches: Microbatches per step.
        steps: Optimizer steps per policy.
        warmup_steps: Extra steps run first and not timed (not in the returned params'
            history either: they are part of training).
        policies: Policies to run, each from the same initial weights; ``"policy@hint"``
            runs that policy on another hint than ``hint`` (``"strict@1f1b"``: the fixed
            order torch and Megatron run, as the peer's baseline).
        interleave: Run the policies' steps in turn (step s of every policy, in an order
            that rotates each step, then step s + 1; each policy has its own model copy,
            process groups and stage), so that drift of the machine's load hits every
            policy alike and step s of two policies can be compared as a pair. False: one
            policy's steps after the other's.
        hint: Hint name.
        memory_factor: Bound the count of activations instead of bytes: a scale of the
            default count bound (1F1B's in-flight count).
        memory_budget: The byte budget (without ``memory_factor``): a float scales what
            strict 1F1B holds on each step's microbatches (the default, 1.0: the same
            bytes), or bytes. Bytes are the declared activation model: each microbatch's
            tokens (image tokens included) on every virtual stage.
        split_backward: Split backwards into I and W.
        ordered_weights: Run W in microbatch order (bitwise order-independent gradients).
        model: Model sizes.
        cost: Emulated GPU cost model (None: no emulated time).
        per_rank_noise: Emulated jitter drawn per process (TP ranks see different timings).
        equal_lengths: Use equal-shape text-only microbatches (divergence tests).
        lr: SGD learning rate.
        seed: Data seed (and the emulated noise's); see ``batches``.
        coordinate_tp: TP followers run the leader's decisions.
        verify_tp: Cross-check the TP ranks' sequences after each step.
        step_timeout: Watchdog per step, seconds.
        return_params: Return the final parameters (for equivalence checks).
        trace_steps: Steps (counting warm-up) whose trace is recorded and returned
            (``TrainResult.trace``); with ``trace_dir`` and no ``trace_steps``, the last step.
        trace_dir: Every process writes its recording of ``trace_steps`` (default: the last
            step) as a Chrome / Perfetto JSON file ``{trace_dir}/{policy}/rank{r}.json`` (one
            directory per policy, one file per global rank, written when the policy's
            training ends, and when it fails). Merge a policy's files into one timeline with
            ``rrfp-async trace {trace_dir}/{policy}`` or ``rr.observability.merge_traces``.
        log_format: Configure step-traced logs in every process ("json" / "console").
        log_level: Their level.
        progress: Rank 0 reports ``(policy, step)`` after each step (``report_progress``).
        measure_activations: Measure each forward's activation bytes (saved-tensor hooks;
            ``TrainResult.measured_peak_bytes``). Every policy pays the meter alike. With a
            byte budget, the measured bytes are also learned (``LearnedBytes``: exchanged
            after each step, fitted on every rank alike) and plan the steps once every
            stage's fit is ready; until then, the declared bytes (tokens) do.
    """

    pp: int
    tp: int = 1
    chunks: int = 1
    microbatches: int = 8
    steps: int = 5
    warmup_steps: int = 0
    policies: tuple[str, ...] = ("strict", "readiness_first")
    interleave: bool = True
    hint: str = "breadth_first_weighted"
    memory_factor: float | None = None
    memory_budget: float | int | str | None = None
    split_backward: bool = False
    ordered_weights: bool = False
    model: ImageTextConfig = field(default_factory=ImageTextConfig)
    cost: CostModel | None = None
    per_rank_noise: bool = False
    equal_lengths: bool = False
    lr: float = 0.05
    seed: int = 0
    coordinate_tp: bool = True
    verify_tp: bool = True
    step_timeout: float | None = 120.0
    measure_activations: bool = False
    return_params: bool = True
    trace_steps: tuple[int, ...] = ()
    trace_dir: str | Path | None = None
    log_format: LogFormat | None = None
    log_level: str = "info"
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "chunks", "microbatches", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"TrainConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise PlanError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not self.policies:
            raise PlanError("TrainConfig.policies is empty: name at least one policy")
        twice = sorted({p for p in self.policies if self.policies.count(p) > 1})
        if twice and self.trace_dir is not None:
            raise PlanError(
                f"TrainConfig: policy {', '.join(map(repr, twice))} named twice with trace_dir:"
                " both would write {trace_dir}/{policy}/; name each policy once, or no"
                " trace_dir"
            )
        if not isinstance(self.interleave, bool):
            raise PlanError(f"TrainConfig.interleave must be a bool, got {self.interleave!r}")
        if self.trace_dir is not None and not isinstance(self.trace_dir, str | Path):
            raise PlanError(
                f"TrainConfig.trace_dir must be a directory path (str or Path), got"
                f" {self.trace_dir!r}"
            )
        if not self.lr > 0:
            raise PlanError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        bad = [s for s in self.trace_steps if not 0 <= s < self.warmup_steps + self.steps]
        if bad:
            raise PlanError(
                f"TrainConfig.trace_steps {bad} are outside the"
                f" {self.warmup_steps + self.steps} steps run (warm-up counted)"
            )

    @property
    def traced_steps(self) -> tuple[int, ...]:
        """The steps recorded: ``trace_steps``, or the last step when only ``trace_dir`` is
        given."""
        if self.trace_steps or self.trace_dir is None:
            return self.trace_steps
        return (self.warmup_steps + self.steps - 1,)

    def batches(self, dp_rank: int = 0) -> list[list[Microbatch]]:
        """The microbatches of every step (warm-up steps first) of one DP replica.

        Every PP and TP rank of a replica gets the same; replicas get different ones (data
        parallelism splits the data): step ``s`` of replica ``d`` is drawn with seed
        ``seed * 1000 + s + 1_000_000 * d`` (replica 0: ``seed * 1000 + s``).

        Args:
            dp_rank: The data-parallel replica.

        Returns:
            One list of ``microbatches`` microbatches per step.

        Raises:
            PlanError: ``dp_rank`` is negative.
        """
        if dp_rank < 0:
            raise PlanError(f"dp_rank must be >= 0, got {dp_rank}")
        draw = fixed_microbatches if self.equal_lengths else make_microbatches
        return [
            draw(self.microbatches, self.model, seed=self.seed * 1000 + s + 1_000_000 * dp_rank)
            for s in range(self.warmup_steps + self.steps)
        ]


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What one process returns for one policy.

    Attributes:
        policy: The policy.
        rank: Global rank.
        pp_rank: Its pipeline rank.
        tp_rank: Its rank in its stage's TP group.
        dp_rank: Its data-parallel replica.
        params: ``{virtual_stage: state_dict}`` after training (empty unless asked).
        step_times: Seconds of each timed step on this process (barrier to last task).
        stats: The stage's ``StepStats`` of each timed step.
        losses: ``{step: {microbatch: loss}}`` on the last stage's ranks.
        compute_seconds: Real torch compute seconds (all steps).
        emulated_seconds: Emulated GPU seconds slept (all steps).
        trace: The recording of the traced steps (``TrainConfig.traced_steps``) on this
            process.
        measured_peak_bytes: With ``TrainConfig.measure_activations``, each timed step's
            most measured activation bytes held at once on this process (saved-tensor
            hooks, in the order its tasks ran); else empty.
    """

    policy: str
    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    params: dict[int, dict[str, torch.Tensor]]
    step_times: list[float]
    stats: list[StepStats]
    losses: dict[int, dict[int, float]]
    compute_seconds: float
    emulated_seconds: float
    trace: TraceData | None = None
    measured_peak_bytes: list[int] = field(default_factory=list)


class _PolicyRun:
    """One policy's training in this process: its own model copy, optimizer, executor,
    process groups and ``DistributedStage`` (so that several policies can be open at once
    and take their steps in turn)."""

    def __init__(
        self,
        cfg: TrainConfig,
        layout: ProcessLayout,
        groups: Any,
        policy: str,
        first: list[Microbatch],
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.policy = policy  # its label: "policy" or "policy@hint"
        name, _, hint = policy.partition("@")
        self.hint = hint or cfg.hint
        # Bytes learned from the run (every rank, after each step; with one replica only:
        # replicas see other microbatches, and one group would mix their tables).
        self.learner = (
            LearnedBytes(dist.new_group(backend="gloo"))
            if cfg.measure_activations and cfg.memory_factor is None and layout.dp == 1
            else None
        )
        nv = cfg.pp * cfg.chunks
        self.plan = StepPlan(
            topology=Topology(stages=cfg.pp, chunks=cfg.chunks),
            microbatches=cfg.microbatches,
            split_backward=cfg.split_backward or cfg.ordered_weights,
            ordered_weights=cfg.ordered_weights,
        )
        tp = TPContext(group=groups.tp, size=cfg.tp, rank=layout.tp_rank) if cfg.tp > 1 else None
        self.modules = build_stage_modules(
            cfg.model, nv, self.plan.topology.stages_of(layout.pp_rank), tp
        )
        self.params = [p for m in self.modules.values() for p in m.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=cfg.lr, momentum=0.0)
        emulate = (
            EmulatedCost(cost=cfg.cost, seed=cfg.seed, per_rank_noise=cfg.per_rank_noise)
            if cfg.cost is not None
            else None
        )
        self.executor = TorchStageExecutor(
            self.modules,
            loss_fn,
            emulate=emulate,
            rank=layout.rank,
            measure_activations=cfg.measure_activations,
        )
        traced = cfg.traced_steps
        self.recorder = TraceRecorder(layout.pipeline_peers()) if traced else None
        logger = LogObserver(rank=layout.rank) if cfg.log_format is not None else None
        self.stage = DistributedStage(
            layout,
            self.schedule_for(first),
            self.executor,
            groups=groups,
            policy=name,
            coordinate_tp=cfg.coordinate_tp,
            verify_tp=cfg.verify_tp,
            step_timeout=cfg.step_timeout,
            observer=MultiObserver(logger, _StepFilter(self.recorder, set(traced))),
        )
        self.times: list[float] = []
        self.stats: list[StepStats] = []
        self.measured: list[int] = []
        self.losses: dict[int, dict[int, float]] = {}

    def schedule_for(self, mbs: list[Microbatch]) -> StepSchedule:
        declared = (self.cfg.cost or image_text_cost()).declared(self.plan, mbs)
        if self.cfg.memory_factor is not None:
            return StepSchedule.build(
                self.plan, self.hint, durations=declared, memory_factor=self.cfg.memory_factor
            )
        return StepSchedule.build(
            self.plan,
            self.hint,
            durations=declared,
            activation_bytes=self.bytes_for(mbs),
            memory_budget=self.cfg.memory_budget,
        )

    def bytes_for(self, mbs: list[Microbatch]) -> ActivationBytes:
        """A step's activation bytes: learned from the run once every stage's fit is ready,
        the declared model (a microbatch's tokens) until then."""
        learned = None if self.learner is None else self.learner.predict(self.plan, mbs)
        if learned is not None:
            return learned
        return ActivationBytes.from_sizes(self.plan, [mb.tokens for mb in mbs])

    async def step(self, s: int, mbs: list[Microbatch]) -> None:
        cfg = self.cfg
        sched = self.schedule_for(mbs)
        dist.barrier()  # synchronized step starts: step times are comparable
        t0 = time.perf_counter()
        st = await self.stage.run_step(mbs, step=s, schedule=sched)
        dt = time.perf_counter() - t0
        self.stage.allreduce_gradients(self.params)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.executor.losses:
            self.losses[s] = dict(self.executor.losses)
        if s >= cfg.warmup_steps:
            self.times.append(dt)
            self.stats.append(st)
            if cfg.measure_activations:
                self.measured.append(st.held_peak(self.executor.activation_bytes()))
        if self.learner is not None:  # (a collective, after the step: off its clock)
            self.learner.observe(self.plan, mbs, self.executor.activation_bytes())
        if cfg.progress and self.layout.rank == 0:
            report_progress((self.policy, s))

    def write_trace(self) -> None:
        """Write this policy's recording to ``trace_dir`` (when both are set); after a
        failure a write error is logged, never raised over the step's own error."""
        if self.recorder is not None and self.cfg.trace_dir is not None:
            _write_rank_trace(self.cfg, self.layout.rank, self.policy, self.recorder.data)

    def result(self) -> TrainResult:
        layout = self.layout
        return TrainResult(
            policy=self.policy,
            rank=layout.rank,
            pp_rank=layout.pp_rank,
            tp_rank=layout.tp_rank,
            dp_rank=layout.dp_rank,
            params={
                v: {k: t.detach().clone() for k, t in m.state_dict().items()}
                for v, m in self.modules.items()
            }
            if self.cfg.return_params
            else {},
            step_times=self.times,
            stats=self.stats,
            losses=self.losses,
            compute_seconds=self.executor.compute_seconds,
            emulated_seconds=self.executor.emulated_seconds,
            trace=None if self.recorder is None else self.recorder.data,
            measured_peak_bytes=self.measured,
        )


async def _train(
    cfg: TrainConfig,
    layout: ProcessLayout,
    runs: list[_PolicyRun],
    batches: list[list[Microbatch]],
) -> list[TrainResult]:
    """Run ``runs``: interleaved (step s of every policy, in an order that rotates each
    step, before step s + 1: machine drift hits every policy alike), or, with
    ``cfg.interleave=False`` (one run given at a time), one policy's steps in a row."""
    async with contextlib.AsyncExitStack() as stack:
        for r in runs:
            await stack.enter_async_context(r.stage)
        try:
            for s, mbs in enumerate(batches):
                k = s % len(runs)
                for r in runs[k:] + runs[:k]:
                    await r.step(s, mbs)
        except BaseException:
            for r in runs:  # the failed step's trace helps most; its error stays the error
                try:
                    r.write_trace()
                except Exception as e:
                    _log.warning("rank %d: could not write its trace: %r", layout.rank, e)
            raise
        for r in runs:
            r.write_trace()
    return [r.result() for r in runs]


def train_worker(rank: int, world: int, cfg: TrainConfig) -> list[TrainResult]:
    """Body of one process: train with every policy in ``cfg.policies`` (their steps in
    turn, see ``TrainConfig.interleave``).

    Each policy starts from the same initial weights and meets the same microbatches and
    emulated noise. The layout is ``ProcessLayout.from_world(pp=cfg.pp, tp=cfg.tp)``
    (Megatron's rank order; DP = world / (pp * tp)). Run it under ``rr.spawn`` or torchrun::

        results = rr.spawn(lab.train_worker, world, cfg)  # results[rank][policy index]

    Args:
        rank: This process's global rank (``spawn``'s calling convention; the layout reads
            it from the initialised default process group).
        world: The world size (likewise).
        cfg: What to train; the same in every process.

    Returns:
        One ``TrainResult`` per policy, in ``cfg.policies`` order.

    Raises:
        PlanError: The world size is not a multiple of ``pp * tp``, or the plan is invalid.
        StepTimeoutError, DivergenceError, PeerError: A step failed (see ``DistributedStage``).
    """
    if cfg.log_format is not None:
        configure_logging(format=cfg.log_format, level=cfg.log_level)
    layout = ProcessLayout.from_world(pp=cfg.pp, tp=cfg.tp)
    batches = cfg.batches(layout.dp_rank)
    if cfg.interleave:
        # Process groups of its own per policy (a stage claims its p2p group), built in
        # the same order on every rank.
        runs = [_PolicyRun(cfg, layout, build_groups(layout), p, batches[0]) for p in cfg.policies]
        try:
            return run(_train(cfg, layout, runs, batches))
        finally:
            for r in runs:
                r.executor.close()
    groups = build_groups(layout)
    out = []
    for policy in cfg.policies:
        one = _PolicyRun(cfg, layout, groups, policy, batches[0])
        try:
            out += run(_train(cfg, layout, [one], batches))
        finally:
            one.executor.close()
        dist.barrier()
    return out


_log = logging.getLogger(__name__)


def _write_rank_trace(cfg: TrainConfig, rank: int, policy: str, data: TraceData) -> Path:
    """``{trace_dir}/{policy}/rank{rank}.json``: this process's recording (see
    ``TrainConfig.trace_dir``)."""
    assert cfg.trace_dir is not None
    steps = sorted({s.step for s in data.spans})
    tr = chrome_trace(
        data,
        clock="real",
        emulated=cfg.cost is not None,
        policy=policy,
        hint=cfg.hint,
        title=f"rank {rank}, {policy}, steps {steps}: CPU compute"
        + (" + EMULATED GPU time" if cfg.cost is not None else ""),
    )
    return write_trace(rank_trace_path(Path(cfg.trace_dir) / policy, rank), tr)


class _StepFilter:
    """Passes a recorder's events through only during the chosen steps."""

    def __init__(self, inner: TraceRecorder | None, steps: set[int]) -> None:
        self.inner = inner
        self.steps = steps
        self._on = False

    @property
    def active(self) -> bool:
        return self.inner is not None

    def step_start(self, stage: Any) -> None:
        self._on = stage.step in self.steps

    def __getattr__(self, name: str) -> Any:
        # Transitions only: a TraceRecorder has no ``failed`` hook (``loop.FailedObserver``),
        # so neither has its filter (a forwarder for it would raise on every failed step).
        if name == "failed":
            raise AttributeError(name)

        def call(*args: Any) -> None:
            if self._on and self.inner is not None:
                getattr(self.inner, name)(*args)

        return call
