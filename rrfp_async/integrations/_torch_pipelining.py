"""A readiness-first schedule with torch.distributed.pipelining's API (``rr.pipelining``).

A torch pipelining script switches by one line::

    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    schedule = ScheduleReadinessFirst(stage, n_microbatches, loss_fn=loss_fn)

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    schedule = ScheduleInterleavedReadinessFirst(stages, n_microbatches, loss_fn=loss_fn)

and keeps the rest: its ``PipelineStage`` (built by hand or from ``pipeline()``), its
``step(x)`` on the first rank, ``step(target=y, losses=losses)`` on the last, ``step()`` in
between (or torch 2.14's pre-split ``step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=,
loss_kwargs=, return_outputs=)``, as torchtitan's trainer calls it), the merged outputs
returned on the last rank, ``eval(...)``.

Design note
-----------
The two classes subclass torch's own ``PipelineScheduleSingle`` and ``PipelineScheduleMulti``,
so code that decides by ``issubclass`` (torchtitan builds ``cls(stages[0], ...)`` for a
single-stage class and ``cls(stages, ...)`` for a multi-stage one) takes them as it takes
torch's; the base constructors run (they only store arguments), and every method that runs a
step is ours. The adapter takes from the user's stage objects what they describe (the
submodule, the stage index, the number of stages, the process group and its ranks) and never
runs their communication: no shape inference, no fixed receive buffers. The microbatches
``step`` makes with torch's own ``split_args_kwargs_into_chunks`` (or the caller's pre-split
lists) become the microbatches of an ``rr.DistributedStage`` step, whose channel (on a p2p
group of its own, so torch's group stays free) carries each activation with its own shape:
every microbatch may have a different length, which torch cannot take.

torch's semantics, read from its ``schedules.py`` and ``stage.py`` (2.13, 2.14): positional
inputs feed the first stage, each microbatch's keyword inputs feed *every* stage
(``forward_one_chunk``); ``loss_fn(output, target, **loss_kwargs)`` per microbatch, unscaled;
with ``scale_grads=True`` the accumulated gradients are divided by the number of microbatches
at the end of the step. So with the same order (``hint=Schedule1F1B, policy="strict"``) the
parameters are bitwise torch's.

Placement is read off the stages a rank holds: stage ``i`` on group rank ``i % P``
(interleaved, torch's loop style) or V-shape (``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``: chunk 0 down the ranks, chunk 1 back up). A torch schedule given as the
hint brings its own order, its own input/weight split of the backward (``I``/``W``) and, for
V-shape, its placement.

``step`` is synchronous like torch's: the stage runs on an event loop thread of its own
(``DistributedStage``'s sync face), opened at the first step and kept until ``close()``.
``step_async`` is the same step for code that already runs an event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from .._costs import Durations
from .._errors import PlanError
from .._pytree import Args
from .._tasks import Placement, StepPlan, Task, Topology
from ..distributed._dist_stage import DEFAULT_STEP_TIMEOUT, DistributedStage
from ..distributed._layout import ProcessLayout, build_groups
from ..distributed._torch_executor import EmulatedCost, SharedSpec, TorchStageExecutor
from ..loop._records import StepStats
from ..policies._schedule import StepSchedule
from ..policies._torch_hints import hint_from_torch

__all__ = ["ScheduleInterleavedReadinessFirst", "ScheduleReadinessFirst"]


class _Chunk:
    """One microbatch as torch's ``step`` splits it (what ``durations`` callables see)."""

    __slots__ = ("args", "kwargs", "loss", "loss_kwargs", "target")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_kwargs: Any
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.target = target
        self.loss_kwargs = loss_kwargs or {}
        self.loss: torch.Tensor | None = None  # the last stage's loss, detached


def _first_input(mb: _Chunk) -> Args:
    return Args(*mb.args, **mb.kwargs)


def _stage_kwargs(stage: int, mb: _Chunk) -> dict[str, Any]:
    """torch's rule (``forward_one_chunk``): positional inputs feed the first stage only, the
    microbatch's keyword inputs feed every stage (torchtitan sends ``positions`` and
    ``attention_masks`` that way). The first stage has them in its input already."""
    return {} if stage == 0 else mb.kwargs


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


def _placement_of(indices: Sequence[int], size: int, grank: int, n_stages: int) -> Placement:
    """The placement the stages of this rank follow (interleaved or V-shape), or PlanError."""
    chunks = n_stages // size
    for placement in ("interleaved", "vshape"):
        topo = Topology(stages=size, chunks=chunks, placement=placement)
        if sorted(indices) == sorted(s for s in range(n_stages) if topo.rank_of(s) == grank):
            return placement
    raise PlanError(
        f"group rank {grank} holds stages {sorted(indices)} of {n_stages} on {size} ranks:"
        " neither interleaved placement (stage i on rank i % P) nor V-shape"
        " (ScheduleZBVZeroBubble / ScheduleDualPipeV); ScheduleReadinessFirst supports those two"
    )


def _check_mbs(mbs: Any, name: str, n: int) -> None:
    """torch's ``_check_inputs``: a list of one entry per microbatch."""
    if not isinstance(mbs, list):
        raise TypeError(f"{name} must be a list but got a {type(mbs)}")
    if len(mbs) != n:
        raise ValueError(f"Expecting {n} {name} but got {len(mbs)}")


def _supported(fn: Callable[..., Any], kwargs: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The keywords of ``kwargs`` (name -> (value, default)) that ``fn`` accepts in the
    installed torch: one a version lacks is left out when it has its default, else PlanError
    (chosen by the signature, not the version string)."""
    params = inspect.signature(fn).parameters
    out = {}
    for k, (v, default) in kwargs.items():
        if k in params:
            out[k] = v
        elif v != default:
            raise PlanError(
                f"{k}={v!r}: torch {torch.__version__}'s {fn.__qualname__} has no such argument"
            )
    return out


class _ReadinessFirst:
    """The implementation both schedule classes share (see the module's design note)."""

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
        step_timeout: float | None,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None,
        emulate: EmulatedCost | None,
        shared: SharedSpec | None,
        stage_kwargs: dict[str, Any],
    ) -> None:
        n = self._n_microbatches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanError(f"n_microbatches must be an int >= 1, got {n!r}")
        first = stages[0]
        group, size, grank, n_stages = (
            first.group,
            first.group_size,
            first.group_rank,
            first.num_stages,
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
                    " builder): not supported by ScheduleReadinessFirst; the runtime splits"
                    " the backward itself (split_backward=True)"
                )
        if n_stages % size:
            raise PlanError(f"{n_stages} stages do not divide over {size} ranks")
        chunks = n_stages // size
        if len(stages) != chunks:
            raise PlanError(
                f"this rank holds {len(stages)} of the {n_stages} stages, but {n_stages} stages"
                f" on {size} ranks are {chunks} per rank: give this rank's {chunks} stage(s)"
                + (
                    " (a single-stage schedule takes one stage per rank: use"
                    " ScheduleInterleavedReadinessFirst for several)"
                    if len(stages) == 1
                    else ""
                )
            )
        placement = _placement_of([s.stage_index for s in stages], size, grank, n_stages)
        self._topology = Topology(stages=size, chunks=chunks, placement=placement)
        self._stages = sorted(stages, key=lambda s: s.stage_index)
        hint = self._default_hint if hint is None else hint
        self._hint, torch_split = self._hint_source(hint, placement)
        if split_backward is None:
            split_backward = torch_split
        elif torch_split and not split_backward:
            raise PlanError(
                f"hint {hint!r} splits the backward into input and weight gradients (its I/W"
                " actions): split_backward=False does not fit it"
            )
        if split_backward:
            _refuse_fsdp_split(self._stages, getattr(self._hint, "__name__", self._hint))
        self._policy = policy
        self._memory_factor = memory_factor
        self._split = bool(split_backward)
        self._step_timeout = step_timeout
        self._stage_kwargs = stage_kwargs
        self._group = group
        self._group_rank = grank
        self._size = size
        self._has_last = any(s.is_last for s in self._stages)
        self._has_first = any(s.is_first for s in self._stages)
        self._executor = TorchStageExecutor(
            {s.stage_index: s.submod for s in self._stages},
            None if self._loss_fn is None else self._loss,
            input_fn=_first_input,
            side_inputs=_stage_kwargs,
            loss_scale="sum",
            return_outputs=True,
            rank=dist.get_rank(),
            emulate=emulate,
            shared=shared,
        )
        self._durations = durations
        self._rr: DistributedStage | None = None
        self._mode: str | None = None  # "sync" or "async", once opened
        self.last_stats: StepStats | None = None

    def _hint_source(self, hint: Any, placement: Placement) -> tuple[Any, bool]:
        """``(hint, split)``: a hint name, or a generator that asks torch for its order at
        each step's size; ``split`` is whether that order splits the backward (I/W)."""
        if hint is None:
            if placement == "vshape":  # our generated hints are interleaved-only
                hint = "ZBVZeroBubble"
            else:
                return "breadth_first_weighted", False
        if isinstance(hint, str):
            from ..policies._hints import canonical_hint_name

            try:
                canonical_hint_name(hint)
            except Exception:
                pass  # not one of ours: a torch schedule name
            else:
                if placement == "vshape":
                    raise PlanError(
                        f"hint {hint!r} orders interleaved placement; this rank's stages are"
                        " V-shape: give a V-shape torch schedule as the hint"
                        " (ScheduleZBVZeroBubble, ScheduleDualPipeV)"
                    )
                return hint, False
        topo = self._topology
        # Checked now, so that a bad schedule fails here and not at the first step.
        plan, _ = hint_from_torch(
            hint, stages=topo.stages, microbatches=self._n_microbatches, chunks=topo.chunks
        )
        if plan.topology.placement != placement:
            raise PlanError(
                f"hint {hint!r} places stages {plan.topology.placement}, but this rank's"
                f" stages are placed {placement}"
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
        return from_torch, plan.split_backward

    # ------------------------------------------------------------------ torch's API

    def _loss(self, output: Any, mb: _Chunk) -> torch.Tensor:
        assert self._loss_fn is not None
        try:
            loss = self._loss_fn(output, mb.target, **mb.loss_kwargs)
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

    def _chunks(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        loss_kwargs: Any,
        arg_mbs: Any,
        kwarg_mbs: Any,
        target_mbs: Any,
    ) -> list[_Chunk]:
        """The step's microbatches, as torch makes them (``_get_microbatch_inputs``):
        whole-batch inputs chunked, or the caller's pre-split lists (never both)."""
        n = self._n_microbatches
        if loss_kwargs is not None and not isinstance(loss_kwargs, dict):
            raise TypeError(f"loss_kwargs must be a dict, got {type(loss_kwargs)}")
        if any(m is not None for m in (arg_mbs, kwarg_mbs, target_mbs)):
            if args:
                raise ValueError(
                    "When using pre-split inputs, pass pre-split positional inputs through"
                    " arg_mbs=... instead of positional args."
                )
            if kwargs:
                raise ValueError(
                    "Unexpected keyword arguments with pre-split inputs:"
                    f" {', '.join(sorted(kwargs))}."
                    " Pass pre-split keyword inputs through kwarg_mbs=..."
                )
            if target is not None:
                raise ValueError(
                    "When using pre-split inputs, pass pre-split targets through target_mbs=..."
                    " instead of target=..."
                )
            for name, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs)):
                if mbs is not None:
                    _check_mbs(mbs, name, n)
            if target_mbs is not None:
                _check_mbs(target_mbs, "target_mbs", n)
            a = arg_mbs if arg_mbs is not None else [()] * n
            k = kwarg_mbs if kwarg_mbs is not None else [{}] * n
            for i in range(n):
                if not isinstance(a[i], tuple):
                    raise TypeError(
                        f"arg_mbs must be a list of tuples, but arg_mbs[{i}] is a {type(a[i])}"
                    )
                if not isinstance(k[i], dict):
                    raise TypeError(
                        f"kwarg_mbs must be a list of dicts, but kwarg_mbs[{i}] is a {type(k[i])}"
                    )
            t = target_mbs if target_mbs is not None else [None] * n
            return [_Chunk(a[i], dict(k[i]), t[i], loss_kwargs) for i in range(n)]
        from torch.distributed.pipelining.microbatch import (
            TensorChunkSpec,
            _split_tensor,
            split_args_kwargs_into_chunks,
        )

        if args or kwargs:
            try:
                a, k = split_args_kwargs_into_chunks(
                    args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec
                )
            except AssertionError as e:  # torch asserts when a tensor splits into fewer chunks
                raise PlanError(
                    f"the batch does not split into n_microbatches={n} chunks (is its batch"
                    f" dimension smaller than {n}?): {e}"
                ) from None
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
            PlanError, StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        self._check_finalize(finalize_gradients)
        chunks = self._chunks(args, kwargs, target, loss_kwargs, arg_mbs, kwarg_mbs, target_mbs)
        return self._sync(chunks, losses, return_outputs)

    def _check_finalize(self, finalize_gradients: bool) -> None:
        if not isinstance(finalize_gradients, bool):
            raise TypeError(f"finalize_gradients must be a bool, got {finalize_gradients!r}")
        if finalize_gradients:
            return
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - every supported torch has it
            return
        fsdp = [s.stage_index for s in self._stages if isinstance(s.submod, FSDPModule)]
        if fsdp:
            raise PlanError(
                f"finalize_gradients=False with FSDP stages {fsdp}: FSDP stages are not"
                " supported by ScheduleReadinessFirst"
            )

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
                loss_kwargs,
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
        arg_mbs: list[tuple[Any, ...]] | None = None,
        kwarg_mbs: list[dict[str, Any]] | None = None,
        target_mbs: list[Any] | None = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """``step`` for code that runs an event loop: the stage opens on the running loop
        (and must be stepped on it from then on); ``aclose()`` closes it."""
        self._check_finalize(finalize_gradients)
        chunks = self._chunks(args, kwargs, target, loss_kwargs, arg_mbs, kwarg_mbs, target_mbs)
        train = self._check_grad_mode(True)
        if self._rr is None:
            self._rr = self._build()
            await self._rr.__aenter__()
            self._mode = "async"
        self._refuse("async")
        stats = await self._rr.run_step(chunks, schedule=self._schedule_for(chunks), train=train)
        return self._finish(stats, chunks, losses, return_outputs, train, merge=True)

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
        return self._finish(stats, chunks, losses, return_outputs, train, merge=merge)

    def _finish(
        self,
        stats: StepStats,
        chunks: Sequence[_Chunk],
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


class ScheduleReadinessFirst(_ReadinessFirst, PipelineScheduleSingle):
    """torch pipelining's single-stage schedule API over rrfp_async's readiness-first runtime.

    Takes the same arguments as torch's ``Schedule1F1B``, plus rrfp_async's own keywords. A
    subclass of torch's ``PipelineScheduleSingle`` (one stage per rank). Given a list of
    several stages it builds a ``ScheduleInterleavedReadinessFirst`` (as earlier releases of
    this class did).

    Args:
        stage: The user's ``PipelineStage`` of this rank.
        n_microbatches: Microbatches per ``step`` (``step_microbatches`` takes any count).
        loss_fn: ``loss_fn(output, target, **loss_kwargs)`` per microbatch (None:
            forward-only steps).
        args_chunk_spec: How ``step``'s positional inputs are chunked (torch's
            ``TensorChunkSpec``s; default: dim 0).
        kwargs_chunk_spec: The same for keyword inputs.
        output_merge_spec: How the last stage's outputs are merged (default: dim 0).
        scale_grads: Divide the accumulated gradients by the number of microbatches (torch's
            default; False: the gradients of the summed losses).
        hint: The schedule used as the hint: a torch schedule class or name
            (``Schedule1F1B``, ``"Interleaved1F1B"``, ``ScheduleZBVZeroBubble``: its order,
            task for task, and its backward split), an rrfp_async hint name, or None for the
            project's default (``breadth_first_weighted``; ``ZBVZeroBubble`` for V-shape).
        policy: The dispatch policy (default ``readiness_first``; ``strict`` runs the hint's
            order like torch does).
        memory_factor: Scale of the admission bound (default: what 1F1B holds).
        split_backward: Split each backward into input and weight gradients (``I``/``W``);
            default: as the hint does (torch's zero-bubble orders split it).
        step_timeout: Seconds a step may take before every rank fails it (None: no limit).
        durations: ``(plan, microbatches) -> rr.Durations``: the declared durations of a
            step's tasks from its microbatches (``_Chunk`` objects with ``args``,
            ``kwargs``, ``target``), so that a cost-aware hint (the default
            ``breadth_first_weighted``) orders the heavy microbatches first; every rank
            must compute the same. Without it the default hint is cost-blind (1F1B's order).
        emulate: Emulated GPU time for CPU benchmarks (``rr.EmulatedCost``).
        shared: Tied parameters (``rr.TorchStageExecutor``'s ``shared``), by stage index:
            for stages of torch's tracer, ``rr.from_pipe(pipe).shared`` (its
            ``replicated_params``, whose gradients torch's own schedules leave to the
            caller). Summed over the ranks holding them at the end of every training step,
            before ``scale_grads``, each step's contribution once when steps accumulate.
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``observer``,
            ``check_ties``, ...).

    Raises:
        PlanError: Something torch's API offers that this adapter does not support (named in
            the message): stages of different process groups, a placement neither
            interleaved nor V-shape, a stage with a ``dw_builder``, pipeline groups that are
            not PP x DP; or bad values.
    """

    def __new__(cls, stage: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(stage, (list, tuple)) and len(stage) != 1:
            return ScheduleInterleavedReadinessFirst(list(stage), *args, **kwargs)
        return super().__new__(cls)

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
        split_backward: bool | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None = None,
        emulate: EmulatedCost | None = None,
        shared: SharedSpec | None = None,
        **stage_kwargs: Any,
    ) -> None:
        if isinstance(stage, (list, tuple)):
            stage = stage[0] if stage else None
        _check_stages([stage])
        PipelineScheduleSingle.__init__(
            self,
            stage,
            n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
        )
        self._setup(
            [stage],
            hint=hint,
            policy=policy,
            memory_factor=memory_factor,
            split_backward=split_backward,
            step_timeout=step_timeout,
            durations=durations,
            emulate=emulate,
            shared=shared,
            stage_kwargs=stage_kwargs,
        )

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """torch's per-step hook, on microbatches already split (one per microbatch)."""
        return _step_split(
            self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs
        )

    def _get_pipeline_order(self) -> None:
        return None  # the order is decided at run time


class ScheduleInterleavedReadinessFirst(_ReadinessFirst, PipelineScheduleMulti):
    """torch pipelining's multi-stage schedule API over rrfp_async's readiness-first runtime.

    Takes the same arguments as torch's multi-stage schedules (``ScheduleInterleaved1F1B``,
    ``ScheduleZBVZeroBubble``, ...), plus rrfp_async's own keywords (see
    ``ScheduleReadinessFirst``). A subclass of torch's ``PipelineScheduleMulti``: this rank's
    stages, placed interleaved (stage ``i`` on group rank ``i % P``) or V-shape (the default
    hint is then torch's ``ScheduleZBVZeroBubble`` order).

    Raises:
        PlanError: As ``ScheduleReadinessFirst``; also ``backward_requires_autograd=False``
            (a custom backward, e.g. torchtitan's graph PP: not supported).
    """

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        hint: Any = None,
        policy: Any = "readiness_first",
        memory_factor: float | None = None,
        split_backward: bool | None = None,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None = None,
        emulate: EmulatedCost | None = None,
        shared: SharedSpec | None = None,
        **stage_kwargs: Any,
    ) -> None:
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        _check_stages(stages)
        if backward_requires_autograd is not True:
            raise PlanError(
                "backward_requires_autograd=False (a backward that runs without autograd, e.g."
                " torchtitan's graph PP) is not supported by ScheduleInterleavedReadinessFirst:"
                " its backward runs autograd"
            )
        PipelineScheduleMulti.__init__(
            self,
            stages,
            n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            **_supported(
                PipelineScheduleMulti.__init__,
                {
                    "use_full_backward": (use_full_backward, None),
                    "scale_grads": (scale_grads, True),
                    "backward_requires_autograd": (backward_requires_autograd, True),
                },
            ),
        )
        self.scale_grads = scale_grads
        self._setup(
            stages,
            hint=hint,
            policy=policy,
            memory_factor=memory_factor,
            split_backward=split_backward,
            step_timeout=step_timeout,
            durations=durations,
            emulate=emulate,
            shared=shared,
            stage_kwargs=stage_kwargs,
        )
        # torch's base class mapped the stages loop-style; V-shape maps them as torch's
        # V-shape schedules do (stage objects keep the mapping for their own use).
        mapping = {s: self._topology.rank_of(s) for s in range(self._topology.num_virtual)}
        self.stage_index_to_group_rank = mapping
        for s in stages:
            s.stage_index_to_group_rank = mapping

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """torch's per-step hook, on microbatches already split (one per microbatch)."""
        return _step_split(
            self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs
        )


def _step_split(
    sched: _ReadinessFirst,
    arg_mbs: Any,
    kwarg_mbs: Any,
    target_mbs: Any,
    losses: Any,
    return_outputs: bool,
    loss_kwargs: Any,
) -> Any:
    if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
        arg_mbs = [()] * sched._n_microbatches
    return sched.step(
        arg_mbs=arg_mbs,
        kwarg_mbs=kwarg_mbs,
        target_mbs=target_mbs,
        losses=losses,
        return_outputs=return_outputs,
        loss_kwargs=loss_kwargs,
    )


def _fsdp_parts(module: Any) -> list[str]:
    """The submodules of ``module`` that FSDP manages (FSDP2's ``fully_shard`` or FSDP1).
    Looked up in ``sys.modules``: a module is wrapped only once FSDP is imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, torch.nn.Module):
        return []
    kinds = tuple(
        c
        for c in (
            getattr(fsdp, "FSDPModule", None),
            getattr(fsdp, "FullyShardedDataParallel", None),
        )
        if isinstance(c, type)
    )
    return [n or "(the stage)" for n, m in module.named_modules() if kinds and isinstance(m, kinds)]


def _refuse_fsdp_split(stages: Sequence[Any], hint: Any) -> None:
    """The split backward's W calls the autograd nodes of the weight gradients itself
    (``_split_backward``), outside the engine, so FSDP's hooks never run for it: its
    parameters are not unsharded for W (resharded storage: "data is not allocated yet") and
    the gradients would bypass its reduce-scatter (silently lost where the storage is kept).
    Refused, naming the wrapped parts."""
    for s in stages:
        parts = _fsdp_parts(s.submod)
        if parts:
            raise PlanError(
                f"stage {s.stage_index}: the split backward (input and weight gradients as"
                f" separate tasks, which hint {hint!r} or split_backward=True asks for) is not"
                f" supported on FSDP-wrapped modules ({', '.join(parts[:3])}): W would run past"
                " FSDP's unshard and reduce-scatter. Use an order without the split (1F1B,"
                " Interleaved1F1B, LoopedBFS, an rrfp_async hint other than zb_h1) or a stage"
                " without FSDP"
            )


def _check_stages(stages: Sequence[Any]) -> None:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if not stages or not all(isinstance(s, _PipelineStageBase) for s in stages):
        raise PlanError(
            "ScheduleReadinessFirst takes the torch.distributed.pipelining PipelineStage of"
            " this rank (or a list of them), got"
            f" {[type(s).__name__ for s in stages] or 'nothing'}"
        )
