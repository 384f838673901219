"""A readiness-first schedule with torch.distributed.pipelining's API (``rr.pipelining``).

A torch pipelining script switches by one line::

    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    schedule = ScheduleReadinessFirst(stage, n_microbatches, loss_fn=loss_fn)

and keeps the rest: its ``PipelineStage`` (built by hand or from ``pipeline()``), its
``step(x)`` on the first rank, ``step(target=y, losses=losses)`` on the last, ``step()`` in
between, the merged outputs returned on the last rank, ``eval(...)``.

Design note
-----------
The adapter takes from the user's stage objects what they describe (the submodule, the
stage index, the number of stages, the process group and its ranks) and never runs their
communication: no shape inference, no fixed receive buffers. The chunks that ``step``
makes with torch's own ``split_args_kwargs_into_chunks`` become the microbatches of an
``rr.DistributedStage`` step, whose channel (on a p2p group of its own, so torch's group
stays free) carries each activation with its own shape: every microbatch may have a
different length, which torch cannot take (``step_microbatches`` takes such lists as they
are). The loss follows torch exactly: the loss of each microbatch unscaled, and with
``scale_grads=True`` the accumulated gradients divided by the number of microbatches at the
end of the step, so with the same order (``hint=Schedule1F1B, policy="strict"``) the
parameters are bitwise torch's.

``step`` is synchronous like torch's: the stage runs on an event loop thread of its own
(``DistributedStage``'s sync face), opened at the first step and kept until ``close()``.
``step_async`` is the same step for code that already runs an event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._costs import Durations
from .._errors import PlanError
from .._pytree import Args
from .._tasks import StepPlan, Task, Topology
from ..distributed._layout import ProcessLayout, build_groups
from ..distributed._stage import DEFAULT_STEP_TIMEOUT, DistributedStage
from ..distributed._torch_executor import EmulatedCost, TorchStageExecutor
from ..loop._records import StepStats
from ..policies._schedule import StepSchedule
from ..policies._torch_hints import hint_from_torch

__all__ = ["ScheduleInterleavedReadinessFirst", "ScheduleReadinessFirst"]


class _Chunk:
    """One microbatch as torch's ``step`` splits it."""

    __slots__ = ("args", "kwargs", "loss_kwargs", "target")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_kwargs: Any
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.target = target
        self.loss_kwargs = loss_kwargs or {}


def _first_input(mb: _Chunk) -> Args:
    return Args(*mb.args, **mb.kwargs)


def _stage_kwargs(stage: int, mb: _Chunk) -> dict[str, Any]:
    """torch's rule (``forward_one_chunk``): positional inputs feed the first stage only, the
    microbatch's keyword inputs feed every stage (torchtitan sends ``positions`` and
    ``attention_masks`` that way). The first stage has them in its input already."""
    return {} if stage == 0 else mb.kwargs


def _torch_stage_class() -> type:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


def _layout_of(group: Any, group_rank: int, size: int) -> ProcessLayout:
    """The ``ProcessLayout`` of a pipeline process group: PP = the group, DP = the other
    groups like it (every rank all-gathers its group's global ranks as int64, no pickle)."""
    world = dist.get_world_size()
    mine = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    grid: tuple[tuple[tuple[int, ...], ...], ...]
    if world == size:
        grid = (tuple((r,) for r in mine),)
        return ProcessLayout(pp=size, rank=dist.get_rank(), grid=grid)
    rows = [torch.empty(size, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(mine, dtype=torch.int64))
    pipes = sorted({tuple(int(x) for x in r.tolist()) for r in rows})
    flat = sorted(r for p in pipes for r in p)
    if flat != list(range(world)):
        raise PlanError(
            f"the pipeline groups of the {world} ranks do not partition the world (each rank"
            " in exactly one pipeline group of the same size): ScheduleReadinessFirst needs"
            f" PP x DP; got pipelines {pipes[:4]}"
        )
    grid = tuple(tuple((r,) for r in p) for p in pipes)
    return ProcessLayout(pp=size, dp=len(pipes), rank=dist.get_rank(), grid=grid)


class ScheduleReadinessFirst:
    """torch pipelining's schedule API over rrfp_async's readiness-first runtime.

    Takes the same arguments as torch's ``Schedule1F1B`` (and, given a list of stages, as
    ``ScheduleInterleaved1F1B``), plus rrfp_async's own keywords.

    Args:
        stage: The user's ``PipelineStage`` (or a list of them, one per virtual stage of
            this rank, for interleaved placement: stage ``i`` on group rank ``i % P``).
        n_microbatches: Microbatches per ``step`` (``step_microbatches`` takes any count).
        loss_fn: ``loss_fn(output, target)`` per microbatch (None: forward-only steps).
        args_chunk_spec: How ``step``'s positional inputs are chunked (torch's
            ``TensorChunkSpec``s; default: dim 0).
        kwargs_chunk_spec: The same for keyword inputs.
        output_merge_spec: How the last stage's outputs are merged (default: dim 0).
        scale_grads: Divide the accumulated gradients by the number of microbatches (torch's
            default; False: the gradients of the summed losses).
        hint: The schedule used as the hint: a torch schedule class or name
            (``Schedule1F1B``, ``"Interleaved1F1B"``: its order, task for task), an
            rrfp_async hint name, or None for the project's default
            (``breadth_first_weighted``).
        policy: The dispatch policy (default ``readiness_first``; ``strict`` runs the hint's
            order like torch does).
        memory_factor: Scale of the admission bound (default: what 1F1B holds).
        split_backward: Split each backward into input and weight gradients (``I``/``W``).
        step_timeout: Seconds a step may take before every rank fails it (None: no limit).
        durations: ``(plan, microbatches) -> rr.Durations``: the declared durations of a
            step's tasks from its microbatches (``_Chunk`` objects with ``args``,
            ``kwargs``, ``target``), so that a cost-aware hint (the default
            ``breadth_first_weighted``) orders the heavy microbatches first; every rank
            must compute the same. Without it the default hint is cost-blind (1F1B's order).
        emulate: Emulated GPU time for CPU benchmarks (``rr.EmulatedCost``).
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``observer``,
            ``check_ties``, ...).

    Raises:
        PlanError: Something torch's API offers that this adapter does not support (named in
            the message): stages of different process groups, V-shape placement, a stage
            with a ``dw_builder``, pipeline groups that are not PP x DP; or bad values.
    """

    def __init__(
        self,
        stage: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        hint: Any = None,
        policy: Any = "readiness_first",
        memory_factor: float | None = None,
        split_backward: bool = False,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None = None,
        emulate: EmulatedCost | None = None,
        **stage_kwargs: Any,
    ) -> None:
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        base = _torch_stage_class()
        if not stages or not all(isinstance(s, base) for s in stages):
            raise PlanError(
                "ScheduleReadinessFirst takes the torch.distributed.pipelining PipelineStage of"
                " this rank (or a list of them), got"
                f" {[type(s).__name__ for s in stages] or 'nothing'}"
            )
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
            raise PlanError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if n_microbatches < 1:
            raise PlanError(f"n_microbatches must be an int >= 1, got {n_microbatches}")
        first = stages[0]
        group, size, grank, n_stages = (
            first.group,
            first.group_size,
            first.group_rank,
            (first.num_stages),
        )
        for s in stages:
            if s.group is not group or s.num_stages != n_stages:
                raise PlanError(
                    "every stage given to one schedule must share one process group and"
                    " number of stages (stages of several pipelines in one schedule are not"
                    " supported)"
                )
            if getattr(s, "dw_builder", None) is not None:
                raise PlanError(
                    f"stage {s.stage_index} has a dw_builder (torch's custom weight-gradient"
                    " builder): not supported by ScheduleReadinessFirst; use"
                    " split_backward=True for the runtime's own I/W split"
                )
            if s.stage_index % size != grank:
                raise PlanError(
                    f"stage {s.stage_index} is on group rank {grank}, not {s.stage_index % size}:"
                    " only interleaved placement (stage i on group rank i % P) is supported;"
                    " V-shape placement (ScheduleZBVZeroBubble, ScheduleDualPipeV) is not"
                )
        if n_stages % size:
            raise PlanError(f"{n_stages} stages do not divide over {size} ranks")
        chunks = n_stages // size
        if len(stages) != chunks:
            raise PlanError(
                f"this rank holds {chunks} of the {n_stages} stages (i % {size} == {grank}),"
                f" but {len(stages)} were given"
            )
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._topology = Topology(stages=size, chunks=chunks)
        self._hint = self._hint_source(hint)
        self._policy = policy
        self._memory_factor = memory_factor
        self._split = split_backward
        self._step_timeout = step_timeout
        self._stage_kwargs = stage_kwargs
        self._group = group
        self._group_rank = grank
        self._size = size
        self._has_last = any(s.is_last for s in self._stages)
        self._has_first = any(s.is_first for s in self._stages)
        self._executor = TorchStageExecutor(
            {s.stage_index: s.submod for s in self._stages},
            None if loss_fn is None else self._loss,
            input_fn=_first_input,
            side_inputs=_stage_kwargs,
            loss_scale="sum",
            return_outputs=True,
            rank=dist.get_rank(),
            emulate=emulate,
        )
        self._durations = durations
        self._rr: DistributedStage | None = None
        self._mode: str | None = None  # "sync" or "async", once opened
        self.last_stats: StepStats | None = None

    def _hint_source(self, hint: Any) -> Any:
        """A hint name, or a generator that asks torch for its order at each step's size."""
        if hint is None:
            return "breadth_first_weighted"
        if isinstance(hint, str):
            from ..policies._hints import canonical_hint_name

            try:
                canonical_hint_name(hint)
            except Exception:
                pass  # not one of ours: a torch schedule name
            else:
                return hint
        topo = self._topology
        # Checked now, so that a bad schedule fails here and not at the first step.
        hint_from_torch(
            hint, stages=topo.stages, microbatches=self._n_microbatches, chunks=topo.chunks
        )

        def from_torch(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
            _, order = hint_from_torch(
                hint,
                stages=topo.stages,
                microbatches=plan.microbatches,
                chunks=topo.chunks,
                split_backward=plan.split_backward,
            )
            return order

        name = hint if isinstance(hint, str) else getattr(hint, "__name__", "torch")
        from_torch.__name__ = f"torch:{name}"
        return from_torch

    # ------------------------------------------------------------------ torch's API

    def _loss(self, output: Any, mb: _Chunk) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, mb.target, **mb.loss_kwargs)

    def _chunks(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_kwargs: Any
    ) -> list[_Chunk]:
        from torch.distributed.pipelining.microbatch import (
            TensorChunkSpec,
            _split_tensor,
            split_args_kwargs_into_chunks,
        )

        n = self._n_microbatches
        if args or kwargs:
            a, k = split_args_kwargs_into_chunks(
                args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec
            )
        else:
            a, k = [()] * n, [{}] * n
        spec = TensorChunkSpec(0)  # type: ignore[no-untyped-call]
        t = list(_split_tensor(target, spec, n)) if target is not None else [None] * n
        if len(a) != n or len(t) != n:
            raise PlanError(
                f"the batch splits into {len(a)} chunks (target: {len(t)}), not"
                f" n_microbatches={n}: its batch dimension is smaller than {n}"
            )
        return [_Chunk(tuple(a[i]), dict(k[i]), t[i], loss_kwargs) for i in range(n)]

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step on the whole batch, as torch's ``step``: chunked into
        ``n_microbatches``; returns the merged outputs on the last stage's rank (None
        elsewhere, or with ``return_outputs=False``); ``losses`` (last stage) is filled with
        each microbatch's loss. Blocks until this rank's part of the step is done.

        Raises:
            RuntimeError: Called under ``torch.no_grad()`` with a ``loss_fn`` (as torch).
            PlanError, StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        return self._sync(self._chunks(args, kwargs, target, loss_kwargs), losses, return_outputs)

    def eval(
        self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any
    ) -> Any:
        """A forward-only step (torch's ``eval``): outputs merged on the last stage, the
        losses computed when ``target`` and a ``loss_fn`` are given."""
        chunks = self._chunks(args, kwargs, target, None)
        if target is not None or not self._has_last:
            return self._sync(chunks, losses, True, train=False)
        # No target: outputs only (the loss function would get None).
        loss_fn, self._executor.loss_fn = self._executor.loss_fn, None
        try:
            return self._sync(chunks, losses, True, train=False)
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
    ) -> Any:
        """One step on microbatches already split, of any sizes and any count (torch needs
        ``n_microbatches`` equal chunks of one shape). Every rank must step the same number
        of microbatches: ranks that pass no list give ``n_microbatches``. The outputs come
        back as a list (not merged)."""
        n = next(
            (len(x) for x in (arg_mbs, kwarg_mbs, target_mbs) if x is not None),
            n_microbatches if n_microbatches is not None else self._n_microbatches,
        )
        for name, x in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
            if x is not None and len(x) != n:
                raise PlanError(f"{name} has {len(x)} microbatches, the others {n}")
        chunks = [
            _Chunk(
                tuple(arg_mbs[i]) if arg_mbs is not None else (),
                dict(kwarg_mbs[i]) if kwarg_mbs is not None else {},
                target_mbs[i] if target_mbs is not None else None,
                None,
            )
            for i in range(n)
        ]
        return self._sync(chunks, losses, return_outputs, train=train, merge=False)

    async def step_async(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``step`` for code that runs an event loop: the stage opens on the running loop
        (and must be stepped on it from then on); ``aclose()`` closes it."""
        chunks = self._chunks(args, kwargs, target, loss_kwargs)
        train = self._check_grad_mode(True)
        if self._rr is None:
            self._rr = self._build()
            await self._rr.__aenter__()
            self._mode = "async"
        self._refuse("async")
        stats = await self._rr.run_step(chunks, schedule=self._schedule_for(chunks), train=train)
        return self._finish(stats, losses, return_outputs, train, merge=True, count=len(chunks))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread). Call it (or use the
        schedule as a context manager) before ``dist.destroy_process_group()``."""
        stage, self._rr = self._rr, None
        if stage is not None and self._mode == "sync":
            stage.__exit__(None, None, None)
        self._executor.close()

    async def aclose(self) -> None:
        """Close a schedule stepped with ``step_async``."""
        stage, self._rr = self._rr, None
        if stage is not None:
            await stage.__aexit__(None, None, None)
        self._executor.close()

    def __enter__(self) -> ScheduleReadinessFirst:
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

    def _check_grad_mode(self, train: bool) -> bool:
        if train and self._loss_fn is not None and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should"
                " not be used under torch.no_grad() context. Please call eval() instead."
            )
        return train and self._loss_fn is not None

    def _build(self) -> DistributedStage:
        layout = _layout_of(self._group, self._group_rank, self._size)
        plan = StepPlan(
            topology=self._topology,
            microbatches=self._n_microbatches,
            split_backward=self._split,
            ordered_weights=self._split,
        )
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

    def _schedule_for(self, chunks: Sequence[_Chunk]) -> StepSchedule:
        sched = self._base.for_microbatches(len(chunks))
        if self._durations is not None:
            sched = sched.with_durations(self._durations(sched.plan, chunks))
        return sched

    def _sync(
        self,
        chunks: list[_Chunk],
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
            self._rr = stage
            self._mode = "sync"
        self._refuse("sync")
        stats = self._rr.run_step_sync(chunks, schedule=self._schedule_for(chunks), train=train)
        return self._finish(stats, losses, return_outputs, train, merge=merge, count=len(chunks))

    def _finish(
        self,
        stats: StepStats,
        losses: list[Any] | None,
        return_outputs: bool,
        train: bool,
        *,
        merge: bool,
        count: int,
    ) -> Any:
        self.last_stats = stats
        if train and self.scale_grads:
            # torch's scale_grads: the gradients of the summed losses, divided by M.
            for s in self._stages:
                for p in s.submod.parameters():
                    if p.grad is not None:
                        p.grad.div_(count)
        if not self._has_last:
            return None
        if losses is not None and stats.losses is not None:
            losses.clear()
            losses.extend(torch.tensor(x) for x in stats.losses)
        if not return_outputs or stats.outputs is None:
            return None
        outs = list(stats.outputs)
        if not merge:
            return outs
        from torch.distributed.pipelining.microbatch import merge_chunks

        return merge_chunks(outs, self._output_merge_spec)


ScheduleInterleavedReadinessFirst = ScheduleReadinessFirst
"""The same class: given a list of this rank's stages it runs them interleaved (torch's
``ScheduleInterleaved1F1B`` constructor shape)."""
