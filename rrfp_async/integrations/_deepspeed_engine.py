"""The readiness-first ``PipelineEngine``: DeepSpeed's engine, each batch a runtime step.

Design note: what is replaced, and what is DeepSpeed's
------------------------------------------------------
``PipelineEngine.train_batch`` builds a ``TrainSchedule`` (a synchronous 1F1B instruction
stream) and runs it through ``_exec_schedule``; ``eval_batch`` does the same with an
``InferenceSchedule``. The subclass replaces ``_exec_schedule`` alone, so everything around
it stays the installed DeepSpeed's own: ``train_batch``'s and ``eval_batch``'s arguments,
the loss aggregation over data-parallel ranks and its broadcast along the pipeline, timers,
monitors, ``set_batch_fn``, ``set_train_batch_size``, the eval barrier.

Inside, one ``_exec_schedule`` is one ``rr.DistributedStage`` step (``DeepSpeedRunner.run``):

* the tasks are the engine's own ``ForwardPass`` / ``BackwardPass`` handlers, run by
  ``DeepSpeedExecutor`` with per-microbatch buffers and losses (its design note);
* the hint is DeepSpeed's own order of that schedule (``deepspeed_order``), so ``strict``
  runs DeepSpeed's order exactly; ``readiness_first`` (the default) runs a ready task when
  the hinted one waits, within the activations DeepSpeed's order keeps (its
  ``memory_factor``: 1 by default);
* activations and gradients go over the runtime's channels (any shape each microbatch, so
  DeepSpeed's ``dynamic_shape`` and ``reset_activation_shape`` need nothing here);
* the step's end is DeepSpeed's: ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``,
  in that order on every rank (its collectives: the tied all-reduce, the data-parallel
  reduce, the optimizer's overflow and norm checks), then ``train_batch`` aggregates and
  broadcasts the loss as DeepSpeed does.

A schedule the drop-in cannot honour (a ``TrainSchedule`` subclass or a patched
``TrainSchedule.steps``, as diffusion-pipe does) is refused by name, unless ``install`` was
given a ``hint``: then the hint is the order, whatever the schedule's own; so are tensor-parallel
partitioned activations and topologies with a model axis (``_deepspeed_peer``), and the
``DualPipeVModule`` (its engine is DeepSpeed's ``DualPipeVEngine``, which ``install``
replaces by a refusal).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch

from .._errors import PlanError
from .._memory import MemoryBudget
from .._tasks import StepPlan, Task, Topology
from ..distributed import DistributedStage, LearnedBytes, LearnedDurations, build_groups
from ..loop import StepStats
from ..policies import StepSchedule
from ._deepspeed_executor import DeepSpeedExecutor
from ._deepspeed_peer import (
    WHO,
    deepspeed_order,
    layout_of_engine,
    refuse_config,
    refuse_unsupported,
)
from ._megatron_learning import learns
from ._timeouts import GROUP_TIMEOUT, StepTimeout, resolve_step_timeout
from ._torch_learning import StepLearning, item_sizes

__all__ = ["DeepSpeedOptions", "DeepSpeedRunner", "engine_class"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """What ``install`` was given: the runtime's keywords for every engine built after it.

    Attributes:
        policy: The dispatch policy (``"readiness_first"``; ``"strict"`` runs DeepSpeed's
            order exactly).
        hint: A hint name or generator in place of DeepSpeed's own order.
        memory_factor: Bound on the count of activations each stage keeps, as a multiple
            of what DeepSpeed's order keeps (the learning is then off).
        memory_budget: The byte budget of the learned plan: a factor of the bytes
            DeepSpeed's order holds on the step (default 1.0), or bytes.
        sizes: False: learn nothing (DeepSpeed's order, readiness-first, within its count
            of activations); None (default): learn where nothing else was chosen.
        step_timeout: The step watchdog: seconds, None, or ``"group"`` (as long as the
            process group waits; the default).
        stage_kwargs: Further ``rr.DistributedStage`` keywords.
    """

    policy: Any = "readiness_first"
    hint: Any = None
    memory_factor: float | None = None
    memory_budget: MemoryBudget | None = None
    sizes: bool | None = None
    step_timeout: StepTimeout = GROUP_TIMEOUT
    stage_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


class DeepSpeedRunner:
    """Runs a ``PipelineEngine``'s schedules as runtime steps (see the design note).

    Args:
        engine: The engine (built; its grid and stage are read here).
        options: The runtime's keywords.

    Raises:
        PlanError: What the drop-in does not run (``refuse_unsupported``).
    """

    def __init__(self, engine: Any, options: DeepSpeedOptions) -> None:
        refuse_unsupported(engine)
        self.engine = engine
        self.options = options
        self.layout = layout_of_engine(engine)
        self.last_stats: StepStats | None = None
        self._stage: DistributedStage | None = None
        self._executor: DeepSpeedExecutor | None = None
        self._schedules: dict[tuple[int, bool], StepSchedule] = {}
        self._learns = learns(
            sizes=options.sizes,
            hint=options.hint,
            policy=options.policy,
            memory_factor=options.memory_factor,
            activation_bytes=None,
            memory_budget=options.memory_budget,
        )
        self._learning: StepLearning | None = None
        self._learning_m = 0
        self.learning_off: str | None = None
        """Why the engine stopped learning after it started (None: it did not)."""

    def __repr__(self) -> str:
        state = "open" if self._stage is not None else "closed"
        return (
            f"<DeepSpeedRunner: policy={self.options.policy!r}, pp={self.layout.pp},"
            f" dp={self.layout.dp}, {state}>"
        )

    def schedule(self, microbatches: int, forward_only: bool) -> StepSchedule:
        """The step's schedule: DeepSpeed's order of ``microbatches`` (or the hint given to
        ``install``), built once per size."""
        key = (microbatches, forward_only)
        got = self._schedules.get(key)
        if got is None:
            topo = Topology(stages=self.layout.pp)
            opts = self.options
            if forward_only and opts.hint is None:
                plan = StepPlan(topology=topo, microbatches=microbatches, forward_only=True)
                got = StepSchedule.build(plan, _ds_source(True))
            else:
                plan = StepPlan(topology=topo, microbatches=microbatches)
                source = opts.hint if opts.hint is not None else _ds_source(False)
                got = StepSchedule.build(plan, source, memory_factor=opts.memory_factor)
                if forward_only:
                    got = got.forward_only()
            self._schedules[key] = got
        return got

    def run(self, pipe_schedule: Any) -> None:
        """Run one of DeepSpeed's schedules (``TrainSchedule``: a training step and then the
        engine's tied-gradient reduce, gradient reduce and optimizer step;
        ``InferenceSchedule``: a forward-only step) on the runtime.

        Raises:
            PlanError: A schedule the drop-in cannot honour, or what the step raised.
            StepTimeoutError, PeerError: See ``rr.DistributedStage.run_step``.
        """
        from deepspeed.runtime.pipe import schedule as ds

        kind = type(pipe_schedule)
        steps = getattr(kind, "steps", None)
        if kind is ds.TrainSchedule and steps is _STOCK_STEPS.get(ds.TrainSchedule):
            train = True
        elif kind is ds.InferenceSchedule and steps is _STOCK_STEPS.get(ds.InferenceSchedule):
            train = False
        elif self.options.hint is not None and issubclass(kind, ds.TrainSchedule):
            train = True  # (the user's hint is the order: the schedule's own is not read)
        elif self.options.hint is not None and issubclass(kind, ds.InferenceSchedule):
            train = False
        else:
            if kind in _STOCK_STEPS:
                by = getattr(steps, "__qualname__", repr(steps))
                what = f"DeepSpeed's {kind.__name__} whose steps() was replaced (by {by})"
            else:
                what = f"the schedule {kind.__module__}.{kind.__qualname__}"
            raise PlanError(
                f"{WHO}: the engine was asked to run {what}: the drop-in runs the order of"
                " DeepSpeed's own TrainSchedule and InferenceSchedule only. Run this"
                " schedule on DeepSpeed's PipelineEngine (rrfp_async.deepspeed.uninstall()"
                " before deepspeed.initialize), or give its order as install(hint=...)"
            )
        e = self.engine
        m = int(pipe_schedule.micro_batches)
        if m < 1:
            raise PlanError(f"{WHO}: a batch of {m} microbatches")
        schedule = self.schedule(m, not train)
        stage, executor = self._open()
        e._reserve_pipe_buffers(m)  # one per microbatch (buffer id = microbatch)
        e.fwd_outputs = []
        executor.grad_enabled = train and torch.is_grad_enabled()
        learning = self._learning_for(m) if train else None
        if learning is not None:
            items: list[Any] = [None] * m
            if learning.reads_sizes and self.layout.rank == learning.source:
                items = executor.preload(m)  # (the sizes of the step's inputs)
            schedule = learning.schedule(items, None)  # (a collective)
            if learning.off is not None:
                self._stop_learning(learning.off)
        stats = stage.run_step_sync(list(range(m)), schedule=schedule, train=train)
        self.last_stats = stats
        if learning is not None:
            learning.observe(stats, True)  # (a collective on the learning group)
        executor.fold(m)
        if train:
            # DeepSpeed's end of a TrainSchedule, in its order, on every rank.
            e._exec_reduce_tied_grads()
            e._exec_reduce_grads()
            e._exec_optimizer_step()

    def _learning_for(self, m: int) -> StepLearning | None:
        """The learning of ``m``-microbatch batches (``_torch_learning``'s design note; the
        fixed order is DeepSpeed's), or None where the drop-in does not learn."""
        if not self._learns:
            return None
        if self._learning is None or self._learning_m != m:
            assert self._executor is not None
            layout = self.layout
            replica = next(
                d for d, plane in enumerate(layout.grid) if any(layout.rank in r for r in plane)
            )
            opts = self.options
            self._learning = StepLearning(
                None,
                self._executor,
                plan=StepPlan(topology=Topology(stages=layout.pp), microbatches=m),
                hint="breadth_first_weighted" if opts.hint is None else opts.hint,
                memory_budget=opts.memory_budget,
                learn_costs=True,
                source=layout.grid[replica][0][0],
                fixed=_ds_source(False),
                read=item_sizes,
                replica=replica,
                replicas=layout.dp,
                draws=self._executor.draws,
            )
            self._learning_m = m
        return self._learning

    def _stop_learning(self, why: str) -> None:
        """Learning stopped on every rank alike (``StepLearning.off``: the forwards drew
        random numbers, ``_draws``' design note): this batch and the later ones run
        DeepSpeed's order readiness-first (forwards in microbatch order), within DeepSpeed's
        count of activations; said once."""
        self._learns = False
        self._learning = None
        self.learning_off = (
            f"{why}: its forwards keep DeepSpeed's order, so each microbatch draws what it"
            " draws under DeepSpeed; the learned, cost-aware plan is off"
        )
        warnings.warn(f"{WHO}: {self.learning_off}", RuntimeWarning, stacklevel=4)

    @property
    def learned_bytes(self) -> LearnedBytes | None:
        """The activation bytes learned from the run (after the first training batch, where
        the engine learns)."""
        return None if self._learning is None else self._learning.learned_bytes

    @property
    def learned_durations(self) -> LearnedDurations | None:
        """The task times learned from the run (after the first training batch, where the
        engine learns)."""
        return None if self._learning is None else self._learning.learned_durations

    def _open(self) -> tuple[DistributedStage, DeepSpeedExecutor]:
        if self._stage is not None and self._executor is not None:
            return self._stage, self._executor
        e = self.engine
        layout = self.layout
        executor = DeepSpeedExecutor(e, layout.rank)
        opts = self.options
        kwargs: dict[str, Any] = {"check_ties": False}  # DeepSpeed reduces its tied weights
        kwargs.update(opts.stage_kwargs)
        try:
            stage = DistributedStage(
                layout,
                self.schedule(int(e.micro_batches), False),
                executor,
                groups=build_groups(layout),
                policy=opts.policy,
                step_timeout=resolve_step_timeout(opts.step_timeout, None),
                **kwargs,
            )
            stage.__enter__()
        except BaseException:
            executor.close()
            raise
        self._stage, self._executor = stage, executor
        return stage, executor

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread) and compute thread; the
        next batch opens them again. Optional: ``deepspeed``'s ``engine.destroy()`` calls
        it, and an open stage closes before ``destroy_process_group`` or at exit."""
        stage, self._stage = self._stage, None
        executor, self._executor = self._executor, None
        self._learning = None  # (learned anew after a close)
        try:
            if stage is not None:
                stage.__exit__(None, None, None)
        finally:
            if executor is not None:
                executor.close()


def _ds_source(forward_only: bool) -> Any:
    def deepspeed(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
        return deepspeed_order(plan.topology.stages, plan.microbatches, forward_only=forward_only)

    deepspeed.__name__ = "deepspeed_inference" if forward_only else "deepspeed_1f1b"
    return deepspeed


_STOCK_STEPS: dict[type, Any] = {}


@functools.cache
def engine_class() -> type:
    """The readiness-first ``PipelineEngine`` subclass of the installed DeepSpeed (built
    once, on first use: DeepSpeed is imported then)."""
    from deepspeed.runtime.pipe import schedule as ds
    from deepspeed.runtime.pipe.engine import PipelineEngine

    # The schedules' own steps(), as this DeepSpeed shipped them (a later patch of
    # TrainSchedule.steps is a schedule the drop-in does not know: refused by name).
    _STOCK_STEPS.setdefault(ds.TrainSchedule, ds.TrainSchedule.steps)
    _STOCK_STEPS.setdefault(ds.InferenceSchedule, ds.InferenceSchedule.steps)

    class ReadinessFirstPipelineEngine(PipelineEngine):  # type: ignore[misc]
        """DeepSpeed's ``PipelineEngine`` with each ``train_batch`` / ``eval_batch`` run as
        a readiness-first step (``rrfp_async.deepspeed``; its public behaviour is
        DeepSpeed's). ``engine.rrfp`` is its ``DeepSpeedRunner`` (``last_stats``, the
        options, ``close()``)."""

        rrfp: DeepSpeedRunner

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = kwargs.pop("rrfp_options", None) or _installed_options()
            refuse_config(kwargs.get("config_class"))
            super().__init__(*args, **kwargs)
            self.rrfp = DeepSpeedRunner(self, options)

        def _exec_schedule(self, pipe_schedule: Any) -> None:
            self.rrfp.run(pipe_schedule)

        def destroy(self) -> None:
            self.rrfp.close()
            parent = getattr(super(), "destroy", None)
            if parent is not None:
                parent()

    ReadinessFirstPipelineEngine.__module__ = "rrfp_async.deepspeed"
    return ReadinessFirstPipelineEngine


_OPTIONS: list[DeepSpeedOptions] = []


def _installed_options() -> DeepSpeedOptions:
    return _OPTIONS[-1] if _OPTIONS else DeepSpeedOptions()


def set_options(options: DeepSpeedOptions | None) -> None:
    """The options engines built from now on take (None: the defaults)."""
    _OPTIONS[:] = [] if options is None else [options]
