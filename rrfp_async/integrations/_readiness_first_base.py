"""The step of the torch drop-in: what ``ScheduleReadinessFirst`` and
``ScheduleInterleavedReadinessFirst`` share (``ReadinessFirstBase``).

The schedule classes (``_torch_pipelining``, whose design note describes the adapter) are
torch's kinds; this mixin is their step. ``_setup`` reads the user's stages
(``_torch_stages``), picks the hint (``_torch_schedule_hint``) and builds one
``TorchStageExecutor`` over the stages' submodules; ``step``, ``eval``,
``step_microbatches`` and ``step_async`` turn torch's call styles (``_torch_step_inputs``)
into one ``rr.DistributedStage`` step each and return what torch's would: the merged outputs
and per-microbatch losses on the last stage, gradients scaled by ``1/M`` with
``scale_grads``.

``step`` is synchronous like torch's: the stage runs on an event loop thread of its own
(``DistributedStage``'s sync face), opened at the first step and kept until ``close()``.
``step_async`` is the same step for code that already runs an event loop; a schedule keeps
the face it was first stepped with.

One call at a time: torch's schedules are not thread-safe, and two steps of one schedule
at once would build its stage twice and mix their messages (two threads that step it
together ended in the step's timeout, and broke the next step too). A call made while
another runs on this rank (from another thread, or a concurrent ``step_async``) is refused
at once with a ``PlanError`` that names both; it changes nothing, and the running step goes
on. Serialising them instead would run the two steps in an order each rank picks by itself,
pairing one thread's batch on one rank with the other's on the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._costs import Durations
from .._errors import PeerStepError, PlanError
from .._memory import ActivationBytes, MemoryBudget, parse_memory_budgets
from .._tasks import StepPlan
from ..distributed import (
    DistributedStage,
    EmulatedCost,
    LearnedBytes,
    LearnedDurations,
    SharedSpec,
    TorchStageExecutor,
    build_groups,
    close_quietly,
)
from ..loop import StepStats
from ..policies import StepSchedule
from ._timeouts import StepTimeout, resolve_step_timeout
from ._torch_fsdp import check_finalize, refuse_fsdp_split
from ._torch_learning import SizesFn, StepLearning
from ._torch_schedule_hint import hint_source
from ._torch_stages import layout_of_group, placement_note, stage_topologies
from ._torch_step_inputs import (
    Chunk,
    first_input,
    listed_chunks,
    split_step_inputs,
    stage_side_inputs,
)

__all__ = ["ChunkLoss", "ReadinessFirstBase"]


class ChunkLoss:
    """The executor's loss function: the user's ``loss_fn(output, target, **loss_kwargs)``
    on one microbatch (a ``Chunk``), its detached value kept on the chunk for ``losses``.

    An object of its own, not a method of the schedule: the executor must hold no reference
    to the schedule, or the schedule would never be garbage-collected (and so never
    released) while its executor lives."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: Any, mb: Chunk) -> torch.Tensor:
        try:
            loss = self.loss_fn(output, mb.target, **mb.loss_kwargs)
        except Exception as e:
            if mb.target is None:  # torch calls loss_fn(output, None) alike, and fails alike
                e.add_note(
                    "loss_fn(output, target) got target=None: the rank that holds the last"
                    " stage passes the targets to step() (step(target=y) or target_mbs=[...],"
                    " as torch's schedules need them)"
                )
            raise
        if isinstance(loss, torch.Tensor):
            mb.loss = loss.detach()
        return loss


class _Resources:
    """What a schedule holds open, released once (``release``): its stage, once opened, and
    its executor's compute thread. Holds no reference to the schedule (its finalizer's
    argument: see ``weakref.finalize``)."""

    def __init__(self, executor: TorchStageExecutor) -> None:
        self.executor = executor
        self.stage: DistributedStage | None = None

    def release(self) -> None:
        stage, self.stage = self.stage, None
        try:
            if stage is not None:
                if _on_a_loop_thread():
                    # Collected on an event loop's thread (a garbage collection that ran
                    # during a step): a blocking close there could wait for itself.
                    threading.Thread(
                        target=close_quietly,
                        args=(stage, "after its schedule was garbage-collected"),
                        name="rrfp-release",
                        daemon=True,
                    ).start()
                    return
                stage.close()
        finally:
            self.executor.close()


def _on_a_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _why_not_learned(sizes: object, memory_factor: object) -> str:
    """Why a schedule does not learn its steps' bytes (for ``memory_budget``'s refusal)."""
    if sizes is False:
        return "sizes=False switched the learning off"
    if memory_factor is not None:
        return "memory_factor= bounds a count of activations, not bytes: give one of the two"
    return "there is no loss_fn (forward-only steps)"


class ReadinessFirstBase:
    """The implementation both schedule classes share: a mixin placed before torch's
    ``PipelineScheduleSingle`` / ``PipelineScheduleMulti`` (whose constructors run first and
    store the arguments this class reads: ``_n_microbatches``, ``_loss_fn``, the chunk
    specs, ``scale_grads``), so every method that runs a step is this class's."""

    _default_hint: Any = None  # a subclass made by name (torchtitan) binds its hint here
    _stages: list[Any]
    _n_microbatches: int
    _loss_fn: Callable[..., torch.Tensor] | None
    _args_chunk_spec: Any
    _kwargs_chunk_spec: Any
    _output_merge_spec: Any
    scale_grads: bool

    def _setup(
        self,
        stages: list[Any],
        *,
        hint: Any,
        policy: Any,
        memory_factor: float | None,
        split_backward: bool | None,
        step_timeout: StepTimeout,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None,
        emulate: EmulatedCost | None,
        activation_bytes: Callable[[StepPlan, Sequence[Any]], ActivationBytes] | None = None,
        memory_budget: MemoryBudget | None = None,
        sizes: SizesFn | bool | None = None,
        measure_activations: bool = False,
        shared: SharedSpec | None,
        stage_kwargs: dict[str, Any],
    ) -> None:
        n = self._n_microbatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"n_microbatches must be an int >= 1, got {n!r}")
        first = stages[0]
        group, size, grank = first.group, first.group_size, first.group_rank
        fits = stage_topologies(stages)
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        hint_named = hint is not None or self._default_hint is not None
        hint = self._default_hint if hint is None else hint
        self._topology, self._hint, torch_split = hint_source(hint, fits, self._n_microbatches)
        # With no hint the placement is read off this rank's stages alone: where another
        # rank may read it otherwise, a failed first step says so (``_note_first_step``).
        self._placement_note = None if hint_named else placement_note(self._topology, grank)
        # Refused now, not at the first step: a value no step could take.
        parse_memory_budgets(memory_budget, self._topology.stages)
        if split_backward is None:
            split_backward = torch_split
        elif torch_split and not split_backward:
            raise PlanError(
                f"hint {hint!r} splits the backward into input and weight gradients (its I/W"
                " actions): split_backward=False does not fit it"
            )
        if split_backward:
            refuse_fsdp_split(self._stages, getattr(self._hint, "__name__", self._hint))
        self._policy = policy
        self._memory_factor = memory_factor
        self._split = bool(split_backward)
        self._plan = StepPlan(
            topology=self._topology,
            microbatches=n,
            split_backward=self._split,
            ordered_weights=self._split,
        )
        self._step_timeout = resolve_step_timeout(step_timeout, group)
        self._stage_kwargs = stage_kwargs
        self._group = group
        self._group_rank = grank
        self._size = size
        self._has_last = any(s.is_last for s in self._stages)
        self._has_first = any(s.is_first for s in self._stages)
        self._executor = TorchStageExecutor(
            {s.stage_index: s.submod for s in self._stages},
            None if self._loss_fn is None else ChunkLoss(self._loss_fn),
            input_fn=first_input,
            side_inputs=stage_side_inputs,
            loss_scale="sum",
            return_outputs=True,
            rank=dist.get_rank(),
            emulate=emulate,
            shared=shared,
            measure_activations=measure_activations,
        )
        self._measure_all = measure_activations
        self._calling = threading.Lock()  # one call at a time (see the module's note)
        self._caller = ""  # the running call, for the message of a refused one
        self._durations = durations
        if sizes is True or (sizes is not None and sizes is not False and not callable(sizes)):
            raise PlanError(
                "sizes must be a function (plan, microbatches) -> one {feature: value}"
                " mapping per microbatch, or False (no learning; None, the default, reads"
                f" the sizes off the microbatches), got {sizes!r}"
            )
        if callable(sizes):
            if activation_bytes is not None or memory_factor is not None:
                raise PlanError(
                    "sizes= learns each forward's activation bytes from the run: give it, or"
                    " activation_bytes= (the bytes yourself), or memory_factor= (a count of"
                    " activations), one of them"
                )
            if size != dist.get_world_size():
                raise PlanError(
                    f"sizes= learns the bytes across the pipeline's ranks, and this pipeline"
                    f" has {size} of the job's {dist.get_world_size()} ranks (data parallel"
                    " replicas): pass activation_bytes= instead"
                )
        # With no argument, learn from the microbatches themselves (``_torch_learning``)
        # where nothing else was chosen: see its design note for when.
        auto = (
            sizes is None
            and activation_bytes is None
            and memory_factor is None
            and (memory_budget is not None or (not hint_named and policy != "strict"))
            and self._loss_fn is not None
        )
        self._sizes: SizesFn | None = sizes if callable(sizes) else None
        self._learns = auto or callable(sizes)
        self._learning: StepLearning | None = None
        if memory_budget is not None and activation_bytes is None and not self._learns:
            why = _why_not_learned(sizes, memory_factor)
            raise PlanError(
                "memory_budget is a byte budget: it needs the step's bytes, learned from the"
                " run (with a loss_fn, unless sizes=False), or"
                " activation_bytes=(plan, microbatches) -> rr.ActivationBytes (or bound the"
                f" count with memory_factor=); here {why}"
            )
        if activation_bytes is not None and memory_factor is not None:
            raise PlanError(
                "give activation_bytes (memory in bytes, with memory_budget=) or"
                " memory_factor (a count of activations), not both"
            )
        if activation_bytes is not None and not callable(activation_bytes):
            raise PlanError(
                "activation_bytes must be a function (plan, microbatches) -> rr.ActivationBytes,"
                f" got {type(activation_bytes).__name__}"
            )
        self._activation_bytes = activation_bytes
        self._memory_budget = memory_budget
        self._rr: DistributedStage | None = None
        self._mode: str | None = None  # "sync" or "async", once opened
        self.last_stats: StepStats | None = None
        # What the schedule holds open (its stage, the executor's compute thread) is released
        # when the schedule is garbage-collected, as torch's schedules need no close(); the
        # stages still open at destroy_process_group or at exit close there (_lifetime).
        self._resources = _Resources(self._executor)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._finalizer.atexit = False  # (at exit, _lifetime closes the stages in order)

    # ------------------------------------------------------------------ torch's API

    def _chunks(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        loss_kwargs: Any,
        arg_mbs: Any,
        kwarg_mbs: Any,
        target_mbs: Any,
    ) -> list[Chunk]:
        """The step's microbatches, as torch makes them (``split_step_inputs``)."""
        return split_step_inputs(
            self._n_microbatches,
            self._args_chunk_spec,
            self._kwargs_chunk_spec,
            args,
            kwargs,
            target,
            loss_kwargs,
            arg_mbs,
            kwarg_mbs,
            target_mbs,
            rank=dist.get_rank(),
        )

    @contextlib.contextmanager
    def _one_call(self, what: str) -> Iterator[None]:
        """Run the body as this schedule's only call on this rank (see the module's note).

        Raises:
            PlanError: Another call of this schedule runs (refused: nothing changed).
        """
        me = f"{what}() on thread {threading.current_thread().name!r}"
        if not self._calling.acquire(blocking=False):
            raise PlanError(
                f"rank {dist.get_rank()}: {type(self).__name__}.{me} while {self._caller}"
                " runs a step of this schedule: a schedule runs one step at a time (torch's"
                " schedules are not thread-safe either). Call step() from one thread, one"
                " step after the other, or give each thread a schedule of its own (its own"
                " stages and process group). This call was refused and changed nothing; the"
                " running step goes on"
            )
        self._caller = me
        try:
            yield
        finally:
            self._caller = ""
            self._calling.release()

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One training step, as torch's ``step``: the whole batch (``*args``, ``**kwargs``,
        ``target``) chunked into ``n_microbatches``, or microbatches already split
        (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``: one entry per microbatch; torch 2.14's
        call). Returns the merged outputs on the last stage's rank (None elsewhere, or with
        ``return_outputs=False``); ``losses`` (last stage) is filled with each microbatch's
        loss; ``loss_kwargs`` go to every ``loss_fn`` call. ``finalize_gradients`` (torch
        2.15) defers FSDP's gradient reduction and has no effect on other stages, as in
        torch; FSDP stages are not supported. Blocks until this rank's part of the step is
        done.

        Raises:
            RuntimeError: Called under ``torch.no_grad()`` with a ``loss_fn`` (as torch).
            TypeError, ValueError: Inputs as torch refuses them (pre-split lists of the wrong
                type or length, whole-batch and pre-split inputs mixed).
            PlanError: A batch that does not split into ``n_microbatches`` (on every rank:
                the others' ``PeerPlanError`` carries the message); a call while another
                call of this schedule runs on this rank (refused, nothing changed); and see
                ``rr.DistributedStage.run_step``.
            StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        with self._one_call("step"):
            check_finalize(finalize_gradients, self._stages)
            chunks = self._chunks(args, kwargs, target, loss_kwargs, arg_mbs, kwarg_mbs, target_mbs)
            return self._sync(chunks, losses, return_outputs)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """A forward-only step (torch's ``eval``), with ``step``'s inputs: outputs merged on
        the last stage, the losses computed when targets and a ``loss_fn`` are given."""
        with self._one_call("eval"):
            chunks = self._chunks(args, kwargs, target, loss_kwargs, arg_mbs, kwarg_mbs, target_mbs)
            if any(c.target is not None for c in chunks) or not self._has_last:
                return self._sync(chunks, losses, return_outputs, train=False)
            # No target: outputs only (the loss function would get None).
            loss_fn, self._executor.loss_fn = self._executor.loss_fn, None
            try:
                return self._sync(chunks, losses, return_outputs, train=False)
            finally:
                self._executor.loss_fn = loss_fn

    def step_microbatches(
        self,
        arg_mbs: Sequence[tuple[Any, ...]] | None = None,
        kwarg_mbs: Sequence[dict[str, Any]] | None = None,
        target_mbs: Sequence[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        *,
        n_microbatches: int | None = None,
        train: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """One step on microbatches already split, of any sizes and any count (torch needs
        ``n_microbatches`` equal chunks of one shape). Every rank must step the same number
        of microbatches: ranks that pass no list give ``n_microbatches``. The outputs come
        back as a list (not merged)."""
        n = n_microbatches if n_microbatches is not None else self._n_microbatches
        with self._one_call("step_microbatches"):
            chunks = listed_chunks(arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, n)
            return self._sync(chunks, losses, return_outputs, train=train, merge=False)

    async def step_async(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """``step`` for code that runs an event loop: the stage opens on the running loop
        (and must be stepped on it from then on); ``aclose()`` closes it. One call at a
        time, as ``step`` (a concurrent one is refused with a ``PlanError``)."""
        with self._one_call("step_async"):
            check_finalize(finalize_gradients, self._stages)
            chunks = self._chunks(args, kwargs, target, loss_kwargs, arg_mbs, kwarg_mbs, target_mbs)
            train = self._check_grad_mode(True)
            if self._rr is None:
                self._rr = self._build()
                await self._rr.__aenter__()
                self._resources.stage = self._rr
                self._mode = "async"
            self._refuse("async")
            sched = self._schedule_for(chunks)
            try:
                stats = await self._rr.run_step(chunks, schedule=sched, train=train)
            except PlanError as e:
                self._note_first_step(e, chunks)
                raise
            self._learn(stats, train)
            return self._finish(stats, chunks, losses, return_outputs, train, merge=True)

    # ------------------------------------------------------------------ lifecycle

    @property
    def plan(self) -> StepPlan:
        """The step plan of this schedule's steps: the pipeline's topology (its ranks, the
        stages each holds and their placement, as read off the stages and the hint),
        ``n_microbatches`` microbatches, and whether each backward is split
        (``split_backward``); set at construction. A step of another count
        (``step_microbatches(n_microbatches=...)``) runs this plan with that count
        (``dataclasses.replace(schedule.plan, microbatches=m)``); what a fit learned from
        the run is read with it (``schedule.learned_bytes.error(schedule.plan)``)."""
        return self._plan

    @property
    def split_backward(self) -> bool:
        """Whether each backward runs as an input-gradient ``I`` and a weight-gradient ``W``
        task (given, or as the hint splits it)."""
        return self._split

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread) and the compute thread
        now; idempotent. Optional, as with torch's schedules: a schedule that is not closed
        is closed when it is garbage-collected, before ``dist.destroy_process_group()``
        destroys its groups, or at interpreter exit, whichever comes first. A schedule
        stepped with ``step_async`` closes here too; called on its event loop's thread, the
        close only starts (``await schedule.aclose()`` waits for it)."""
        self._rr = None
        self._finalizer()

    async def aclose(self) -> None:
        """Close a schedule stepped with ``step_async``, on its event loop."""
        stage, self._rr = self._rr, None
        if stage is not None:
            await stage.__aexit__(None, None, None)
        self._finalizer()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _refuse(self, mode: str) -> None:
        if self._mode != mode:
            first = "step_async" if self._mode == "async" else "step"
            raise PlanError(
                f"this schedule was first stepped with {first}; use that one throughout (or"
                " close() it and build another)"
            )

    def _note_first_step(self, e: PlanError, chunks: Sequence[Chunk]) -> None:
        """A first step refused by the plan check may be ranks that read different
        placements off their stages (``_torch_stages.placement_note``): say so, and the fix.
        Not on a misuse the step found (a refused batch, here or on another rank)."""
        if isinstance(e, PeerStepError) or any(c.error is e for c in chunks):
            return
        if self.last_stats is None and self._placement_note is not None:
            e.add_note(self._placement_note)

    def _check_grad_mode(self, train: bool) -> bool:
        if train and self._loss_fn is not None and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should"
                " not be used under torch.no_grad() context. Please call eval() instead."
            )
        return train and self._loss_fn is not None

    def _build(self) -> DistributedStage:
        layout = layout_of_group(self._group, self._group_rank, self._size)
        # This pipeline's ranks (its stage 0's first), and so its replica in the layout.
        mine = [
            i if self._group is None else dist.get_global_rank(self._group, i)
            for i in range(self._size)
        ]
        plan = self._plan
        if self._learns:
            replica = next(d for d, plane in enumerate(layout.grid) if plane[0][0] == mine[0])
            self._learning = StepLearning(
                self._sizes,
                self._executor,
                plan=plan,
                hint=self._hint,
                memory_budget=self._memory_budget,
                learn_costs=self._durations is None,
                measure_all=self._measure_all,
                source=mine[0],
                replica=replica,
                replicas=layout.dp,
            )
        if self._activation_bytes is not None or self._sizes is not None:
            # Bytes come with each step (``_schedule_for``); the base has a byte budget on
            # uniform bytes, which every rank builds alike (the plan check compares it).
            schedule = StepSchedule.build(
                plan,
                self._hint,
                activation_bytes=ActivationBytes.uniform(plan),
                memory_budget=self._memory_budget,
            )
        else:
            schedule = StepSchedule.build(plan, self._hint, memory_factor=self._memory_factor)
        self._base = schedule
        return DistributedStage(
            layout,
            schedule,
            self._executor,
            groups=build_groups(layout),
            policy=self._policy,
            step_timeout=self._step_timeout,
            **self._stage_kwargs,
        )

    def _learn(self, stats: StepStats, train: bool) -> None:
        """After a step: what the schedule learns from it (a collective on every rank)."""
        if self._learning is not None:
            self._learning.observe(stats, train)

    def activation_bytes(self) -> dict[tuple[int, int], int]:
        """The activation bytes of the last training step's forwards on this rank,
        ``{(virtual stage, microbatch): bytes}``, as measured (``TorchStageExecutor``'s):
        every step with ``measure_activations=True``, else the steps it learned from (empty
        for the others)."""
        return self._executor.activation_bytes()

    @property
    def learned_bytes(self) -> LearnedBytes | None:
        """The activation bytes learned from the run (its ``model`` and ``error``), where
        the schedule learns (by default, or with ``sizes=``), after its first step."""
        return None if self._learning is None else self._learning.learned_bytes

    @property
    def learned_durations(self) -> LearnedDurations | None:
        """The task times learned from the run where the schedule learns and no
        ``durations=`` were given, after its first step."""
        return None if self._learning is None else self._learning.learned_durations

    def _schedule_for(self, chunks: Sequence[Chunk]) -> StepSchedule:
        sched = self._base.for_microbatches(len(chunks))
        durations = None if self._durations is None else self._durations(sched.plan, chunks)
        if self._learning is not None:
            return self._learning.schedule(chunks, durations)
        if self._activation_bytes is not None:
            nbytes = self._activation_bytes(sched.plan, chunks)
            if not isinstance(nbytes, ActivationBytes):
                raise PlanError(
                    "activation_bytes(plan, microbatches) must return rr.ActivationBytes,"
                    f" got {type(nbytes).__name__}"
                )
            return sched.with_durations(durations, activation_bytes=nbytes)
        if durations is not None:
            sched = sched.with_durations(durations)
        return sched

    def _sync(
        self,
        chunks: list[Chunk],
        losses: list[Any] | None,
        return_outputs: bool,
        *,
        train: bool = True,
        merge: bool = True,
    ) -> Any:
        train = self._check_grad_mode(train)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise PlanError(
                "step() blocks; inside a running event loop use `await schedule.step_async(...)`"
            )
        if self._rr is None:
            stage = self._build()
            stage.__enter__()
            self._rr = self._resources.stage = stage
            self._mode = "sync"
        self._refuse("sync")
        try:
            stats = self._rr.run_step_sync(chunks, schedule=self._schedule_for(chunks), train=train)
        except PlanError as e:
            self._note_first_step(e, chunks)
            raise
        self._learn(stats, train)
        return self._finish(stats, chunks, losses, return_outputs, train, merge=merge)

    def _finish(
        self,
        stats: StepStats,
        chunks: Sequence[Chunk],
        losses: list[Any] | None,
        return_outputs: bool,
        train: bool,
        *,
        merge: bool,
    ) -> Any:
        self.last_stats = stats
        if train and self.scale_grads:
            # torch's scale_grads: the gradients of the summed losses, divided by M.
            for s in self._stages:
                for p in s.submod.parameters():
                    if p.grad is not None:
                        p.grad.div_(len(chunks))
        if not self._has_last:
            return None
        if losses is not None and stats.losses is not None:
            # The loss tensors as loss_fn returned them (their dtype and device), detached.
            losses.clear()
            losses.extend(
                c.loss if c.loss is not None else torch.tensor(x)
                for c, x in zip(chunks, stats.losses, strict=True)
            )
        if not return_outputs or stats.outputs is None:
            return None
        outs = list(stats.outputs)
        if not merge:
            return outs
        from torch.distributed.pipelining.microbatch import merge_chunks

        return merge_chunks(outs, self._output_merge_spec)
