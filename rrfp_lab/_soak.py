"""Soak: hundreds of steps of one local pipeline in real time; does anything grow?

Design note
-----------
A leak in a step runtime is small per step and only shows over many: a task group child
that outlives its step, a thread per step, a failed step's messages or bookkeeping kept
forever, a record per task appended to a list nobody drains. So :func:`soak` runs one
``LocalPipeline`` (every stage a coroutine, ``CostModelExecutor`` tasks that only sleep)
for many steps on a *real* event loop (uvloop by default): real timers, real callbacks, the
watchdog armed, the code paths a training run takes, not the virtual clock's. Each step draws
new microbatch sizes and rebuilds its schedule from them (as training does), and the
realized durations carry seeded lognormal jitter, so the dispatch order changes from step
to step (the result counts the deviations from the hint to show it did). With
``fail_every`` an executor raises on one chosen task every k-th step, in the middle of the
step: the other stages are cancelled mid-sleep and messages are in flight, which is the
path most likely to leave something behind.

Between steps, on the loop, it samples every ``sample_every`` steps (and before the first):
resident memory (``/proc/self/statm``; the peak ``ru_maxrss`` where there is none), live
asyncio tasks, live threads, and the number of objects the garbage collector tracks (after
a full collection, so only what is still reachable counts).

The verdict: the first ``warmup`` steps (a fifth by default) fill caches, the allocator's
arenas and the schedule memos; after them nothing may grow. Live tasks and threads must be
exactly equal in every sample (the pipeline owns nothing between steps), and from the end
of warm-up to the last sample the resident memory may grow by at most
``rss_tolerance_mib`` and the tracked objects by at most ``gc_tolerance``. The defaults
(4 MiB, 1000 objects) are far above what 500 healthy steps of 4 x 8 grow (under 0.1 MiB;
about 40 objects, the samples themselves) and below what one object or ~200 bytes leaked per
task would add over 400 steps (25600 objects; 5 MiB).
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rrfp_async import (
    CostModel,
    Microbatch,
    PlanError,
    StageProfile,
    StepPlan,
    Task,
    Topology,
    make_workload,
)
from rrfp_async._check import check_int, check_real, describe
from rrfp_async.loop import CostModelExecutor, LocalPipeline, TaskContext, run
from rrfp_async.policies import StepSchedule

__all__ = [
    "GC_TOLERANCE",
    "RSS_TOLERANCE_MIB",
    "InjectedFailure",
    "SoakResult",
    "SoakSample",
    "format_soak",
    "soak",
]

RSS_TOLERANCE_MIB = 4.0
"""Default bound on resident-memory growth from the end of warm-up to the last sample."""
GC_TOLERANCE = 1000
"""Default bound on the growth of gc-tracked objects over the same span."""

_MIB = float(1 << 20)
_COUNTS = (
    ("tasks", "live asyncio tasks"),
    ("threads", "live threads"),
    ("inflight", "messages in flight"),
)


class InjectedFailure(RuntimeError):
    """Raised on purpose by the soak's failing executor (``fail_every``); the soak counts the
    step as failed and goes on with the next one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakSample:
    """What was alive between two steps.

    Attributes:
        step: Steps run (completed or failed) when the sample was taken.
        elapsed_s: Wall seconds since the first step started.
        rss_bytes: Resident memory of the process.
        tasks: Live asyncio tasks of the loop (the soak's own task included).
        threads: Live threads of the process.
        gc_objects: Objects tracked by the garbage collector after a full collection
            (None when not counted).
        failed: Injected step failures so far.
        inflight: Messages the pipeline's channel still counts in flight (0 between steps).
    """

    step: int
    elapsed_s: float
    rss_bytes: int
    tasks: int
    threads: int
    gc_objects: int | None
    failed: int
    inflight: int


@dataclass(frozen=True, kw_only=True)
class SoakResult:
    """The samples of a soak and their verdict (see the module's design note).

    Attributes:
        steps: Steps run.
        stages: Pipeline ranks.
        microbatches: Microbatches per step.
        policy: The policy.
        hint: The hint.
        loop: The event loop's class (``uvloop.Loop`` or asyncio's).
        task_ms: Mean declared task duration, milliseconds.
        jitter: Sigma of the realized durations' lognormal noise.
        fail_every: Every how many steps a step fails on purpose (None: never).
        fail_task: The task that raises in those steps.
        warmup: Steps before the growth baseline.
        rss_tolerance_mib: Allowed resident-memory growth after warm-up.
        gc_tolerance: Allowed growth of gc-tracked objects after warm-up.
        rss_source: Where resident memory was read.
        samples: The samples, in step order (the first before any step).
        failed_steps: Steps that failed on purpose.
        decisions: Dispatch decisions of the completed steps.
        deviations: Decisions that ran another task than the next hinted one.
        wall_s: Wall seconds of the whole soak.
    """

    steps: int
    stages: int
    microbatches: int
    policy: str
    hint: str
    loop: str
    task_ms: float
    jitter: float
    fail_every: int | None
    fail_task: Task | None
    warmup: int
    rss_tolerance_mib: float
    gc_tolerance: int
    rss_source: str
    samples: tuple[SoakSample, ...]
    failed_steps: int
    decisions: int
    deviations: int
    wall_s: float

    @property
    def baseline(self) -> SoakSample:
        """The first sample at or after the end of warm-up."""
        return next(s for s in self.samples if s.step >= self.warmup)

    @property
    def rss_growth_mib(self) -> float:
        """Resident-memory growth, MiB, from the baseline to the last sample."""
        return (self.samples[-1].rss_bytes - self.baseline.rss_bytes) / _MIB

    @property
    def rss_slope_mib_per_100(self) -> float:
        """Least-squares slope of resident memory after warm-up, MiB per 100 steps."""
        pts = [(s.step, s.rss_bytes / _MIB) for s in self.samples if s.step >= self.warmup]
        return 100.0 * _slope(pts)

    @property
    def gc_growth(self) -> int | None:
        """Growth of gc-tracked objects from the baseline to the last sample (None when not
        counted)."""
        a, b = self.baseline.gc_objects, self.samples[-1].gc_objects
        return None if a is None or b is None else b - a

    @property
    def problems(self) -> tuple[str, ...]:
        """What grew, one line each; empty when the soak is flat."""
        out = []
        for name, what in _COUNTS:
            first = getattr(self.samples[0], name)
            changed = [s for s in self.samples if getattr(s, name) != first]
            if changed:
                seen = sorted({getattr(s, name) for s in self.samples})
                out.append(
                    f"{what} not constant between steps: {seen} (first change at step"
                    f" {changed[0].step})"
                )
        if self.rss_growth_mib > self.rss_tolerance_mib:
            out.append(
                f"resident memory grew {self.rss_growth_mib:.1f} MiB after warm-up (steps"
                f" {self.baseline.step}-{self.samples[-1].step}), more than"
                f" {self.rss_tolerance_mib:g} MiB"
            )
        g = self.gc_growth
        if g is not None and g > self.gc_tolerance:
            out.append(
                f"gc-tracked objects grew by {g} after warm-up (steps"
                f" {self.baseline.step}-{self.samples[-1].step}), more than {self.gc_tolerance}"
            )
        return tuple(out)

    @property
    def flat(self) -> bool:
        """Nothing grew beyond its tolerance (see ``problems``)."""
        return not self.problems


def _slope(pts: Sequence[tuple[float, float]]) -> float:
    n = len(pts)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def _rss_reader() -> tuple[Callable[[], int], str]:
    """A function returning the resident bytes now, and what it reads."""
    # os.sysconf is POSIX only.
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        with open("/proc/self/statm") as f:
            f.read()
    except OSError:
        # macOS reports bytes, Linux KiB; a peak, so it can only reveal growth, never a drop.
        unit = 1 if sys.platform == "darwin" else 1024
        return (
            lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit,
            "peak RSS (getrusage ru_maxrss)",
        )

    def statm() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    return statm, "/proc/self/statm"


class _FailingExecutor:
    """Wraps an executor; raises ``InjectedFailure`` on ``task`` in every ``every``-th step
    (steps ``every - 1``, ``2 * every - 1``, ...), other tasks run normally."""

    def __init__(self, inner: CostModelExecutor, task: Task, every: int) -> None:
        self.inner = inner
        self.task = task
        self.every = every

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        if task == self.task and ctx.step % self.every == self.every - 1:
            raise InjectedFailure(f"injected failure: rank {ctx.rank} step {ctx.step} task {task}")
        return await self.inner.execute(task, data, ctx)


def _fail_task(value: Task | str | None, plan: StepPlan) -> Task:
    if value is None:
        # Mid-pipeline and mid-step: stages before it have sent on, stages after it wait.
        return Task(plan.stages // 2, "F", plan.microbatches // 2)
    task = Task.parse(value) if isinstance(value, str) else value
    if not isinstance(task, Task) or not plan.contains(task):
        raise PlanError(
            f"fail_task {describe(value)} is not a task of the {plan.stages} x"
            f" {plan.microbatches} plan"
        )
    return task


def soak(
    steps: int = 500,
    stages: int = 4,
    microbatches: int = 8,
    *,
    policy: str = "readiness_first",
    hint: str = "breadth_first_weighted",
    memory_factor: float | None = 2.0,
    task_ms: float = 0.2,
    jitter: float = 0.5,
    fail_every: int | None = None,
    fail_task: Task | str | None = None,
    sample_every: int | None = None,
    warmup: int | None = None,
    count_objects: bool = True,
    rss_tolerance_mib: float = RSS_TOLERANCE_MIB,
    gc_tolerance: int = GC_TOLERANCE,
    use_uvloop: bool = True,
    step_timeout: float = 30.0,
    seed: int = 0,
    on_sample: Callable[[SoakSample], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SoakResult:
    """Run ``steps`` steps of a local pipeline in real time and sample what stays alive.

    Args:
        steps: Steps to run.
        stages: Pipeline ranks (one coroutine each).
        microbatches: Microbatches per step.
        policy: Policy name.
        hint: Hint name; the schedule is rebuilt from each step's microbatch sizes.
        memory_factor: Scale of the default admission bound (slack lets the order vary).
        task_ms: Mean declared forward duration, milliseconds (backward 2x); text-like
            microbatch sizes (lognormal tokens) spread the tasks around it.
        jitter: Sigma of the lognormal noise on every realized duration (seeded per step).
        fail_every: Make every ``fail_every``-th step fail on purpose (None: never).
        fail_task: The task that raises then (default: the forward of the middle
            microbatch on the middle rank).
        sample_every: Steps between samples (default: ``steps // 50``, at least 1).
        warmup: Steps before the growth baseline (default: ``steps // 5``).
        count_objects: Count gc-tracked objects in each sample (costs a few ms each).
        rss_tolerance_mib: Allowed resident-memory growth after warm-up, MiB.
        gc_tolerance: Allowed growth of gc-tracked objects after warm-up.
        use_uvloop: Run on uvloop when installed (else asyncio's own loop).
        step_timeout: Watchdog per step, seconds.
        seed: Seed of the microbatch sizes and the noise.
        on_sample: Called with each sample as it is taken (progress).
        on_step: Called on the loop after every step (failed ones too) with the step number
            (tests inject leaks through it to check the verdict).

    Returns:
        The samples and the verdict (``SoakResult.flat``, ``SoakResult.problems``).

    Raises:
        PlanError: An argument out of range or an unknown ``fail_task``.
        HintError, PolicyError: An unknown hint or policy.
        RRFPError: A step failed for another reason than the injected failure.
    """
    steps = check_int("steps", steps, minimum=1)
    stages = check_int("stages", stages, minimum=1)
    microbatches = check_int("microbatches", microbatches, minimum=1)
    task_ms = check_real("task_ms", task_ms, minimum=0.0)
    if fail_every is not None:
        fail_every = check_int("fail_every", fail_every, minimum=1)
    every = (
        max(1, steps // 50)
        if sample_every is None
        else check_int("sample_every", sample_every, minimum=1)
    )
    warm = steps // 5 if warmup is None else check_int("warmup", warmup, minimum=0, maximum=steps)
    rss_tolerance_mib = check_real("rss_tolerance_mib", rss_tolerance_mib, minimum=0.0)
    gc_tolerance = check_int("gc_tolerance", gc_tolerance, minimum=0)

    plan = StepPlan(topology=Topology(stages=stages), microbatches=microbatches)
    failing = _fail_task(fail_task, plan) if fail_every is not None else None
    # Text-like sizes (median ~900 tokens): a forward of a median microbatch takes ~task_ms.
    cost = CostModel(default=StageProfile(per_token=task_ms * 1e-6), jitter=jitter)

    def batch(step: int) -> tuple[Microbatch, ...]:
        return make_workload(
            "text", microbatches, virtual_stages=stages, seed=seed * 1_000_003 + step
        ).microbatches

    base = StepSchedule.build(
        plan, hint, durations=cost.declared(plan, batch(0)), memory_factor=memory_factor
    )
    inner = CostModelExecutor(cost, seed=seed)
    executor = inner if failing is None else _FailingExecutor(inner, failing, fail_every or 1)
    pipe = LocalPipeline(base, executor, policy=policy, step_timeout=step_timeout)
    read_rss, rss_source = _rss_reader()

    async def main() -> SoakResult:
        loop = asyncio.get_running_loop()
        samples: list[SoakSample] = []
        failed = decisions = deviations = 0
        t0 = time.perf_counter()

        def sample(step: int) -> None:
            gc.collect()
            rss = read_rss()  # before counting: the object list is itself an allocation
            s = SoakSample(
                step=step,
                elapsed_s=time.perf_counter() - t0,
                rss_bytes=rss,
                tasks=len(asyncio.all_tasks(loop)),
                threads=threading.active_count(),
                gc_objects=len(gc.get_objects()) if count_objects else None,
                failed=failed,
                inflight=pipe.channel.inflight,
            )
            samples.append(s)
            if on_sample is not None:
                on_sample(s)

        sample(0)
        for step in range(steps):
            mbs = batch(step)
            sched = base.with_durations(cost.declared(plan, mbs))
            try:
                stats = await pipe.run_step(mbs, step=step, schedule=sched)
            except InjectedFailure:
                failed += 1
            else:
                decisions += sum(s.decisions for s in stats)
                deviations += sum(s.deviations for s in stats)
            if on_step is not None:
                on_step(step)
            done = step + 1
            if done % every == 0 or done == steps:
                sample(done)
        kind = type(loop)
        return SoakResult(
            steps=steps,
            stages=stages,
            microbatches=microbatches,
            policy=pipe.stages[0].policy_name,
            hint=base.hint_name,
            loop=f"{kind.__module__}.{kind.__qualname__}",
            task_ms=task_ms,
            jitter=jitter,
            fail_every=fail_every,
            fail_task=failing,
            warmup=warm,
            rss_tolerance_mib=rss_tolerance_mib,
            gc_tolerance=gc_tolerance,
            rss_source=rss_source,
            samples=tuple(samples),
            failed_steps=failed,
            decisions=decisions,
            deviations=deviations,
            wall_s=time.perf_counter() - t0,
        )

    return run(main(), use_uvloop=use_uvloop)


def format_soak(result: SoakResult, *, rows: int | None = 12) -> str:
    """The soak as text: its configuration, a table of samples (step, RSS MiB, tasks,
    threads, gc objects, failed steps), the growth figures and the verdict.

    Args:
        result: What ``soak`` returned.
        rows: Show at most about this many samples, evenly spaced (the first, the baseline
            and the last always); None shows every sample.

    Returns:
        The report, lines joined by newlines (no trailing newline).
    """
    r = result
    fail = (
        "no injected failures"
        if r.fail_every is None
        else f"step fails on purpose every {r.fail_every} (task {r.fail_task})"
    )
    lines = [
        f"soak: {r.steps} steps, {r.stages} stages x {r.microbatches} microbatches, policy"
        f" {r.policy}, hint {r.hint}, loop {r.loop}",
        f"  forward ~{r.task_ms:g} ms (jitter {r.jitter:g}); {fail}; {r.failed_steps} failed,"
        f" {r.steps - r.failed_steps} completed; {r.deviations} of {r.decisions} decisions"
        f" left the hint's order; wall {r.wall_s:.1f} s",
        "",
        f"{'step':>6} {'elapsed s':>9} {'RSS MiB':>9} {'tasks':>6} {'threads':>7}"
        f" {'gc objects':>10} {'failed':>6}",
    ]
    shown = list(r.samples)
    if rows is not None and len(shown) > rows:
        stride = (len(shown) - 1) / max(1, rows - 1)
        keep = {round(i * stride) for i in range(rows)} | {0, len(shown) - 1}
        keep.add(r.samples.index(r.baseline))
        shown = [s for i, s in enumerate(r.samples) if i in keep]
    for s in shown:
        mark = "  <- baseline (end of warm-up)" if s is r.baseline else ""
        objs = "-" if s.gc_objects is None else str(s.gc_objects)
        lines.append(
            f"{s.step:>6} {s.elapsed_s:>9.2f} {s.rss_bytes / _MIB:>9.1f} {s.tasks:>6}"
            f" {s.threads:>7} {objs:>10} {s.failed:>6}{mark}"
        )
    g = r.gc_growth
    lines += [
        "",
        f"after warm-up (steps {r.baseline.step}-{r.samples[-1].step}, {r.rss_source}):",
        f"  RSS growth {r.rss_growth_mib:+.2f} MiB (tolerance {r.rss_tolerance_mib:g}),"
        f" slope {r.rss_slope_mib_per_100:+.3f} MiB per 100 steps",
        f"  gc objects growth {'-' if g is None else f'{g:+d}'} (tolerance {r.gc_tolerance})",
        f"  live tasks {sorted({s.tasks for s in r.samples})}, threads"
        f" {sorted({s.threads for s in r.samples})}, messages in flight between steps"
        f" {sorted({s.inflight for s in r.samples})}",
        "verdict: " + ("flat" if r.flat else "GROWTH: " + "; ".join(r.problems)),
    ]
    return "\n".join(lines)
