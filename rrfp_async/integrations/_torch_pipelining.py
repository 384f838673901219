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
``step_async`` is the same step for code that already runs an event loop. One call at a
time, as torch's (not thread-safe either): a call while another runs on the rank is refused
with a ``PlanError``; a batch with fewer rows than ``n_microbatches`` fails the step on every
rank with a ``PlanError`` (``_readiness_first_base``, ``_torch_step_inputs``).

What torch's schedules carry and users read, ours carry with torch's meaning (the audit, who
reads what, is in docs/dropins.md): torch's base constructors set ``scale_grads``,
``_n_microbatches``, ``_loss_fn``, ``_has_backward``, ``_stage`` / ``_stages``, ``rank``,
``pp_group_size``; the multi-stage class adds the ``n_local_stages`` and ``num_stages`` of
torch's concrete multi-stage schedules and maps ``stage_index_to_group_rank`` as its placement
does. ``pipeline_order`` is the hint's order at ``n_microbatches`` in torch's IR
(``{rank: [_Action]}``, every rank, compute actions only, no ``None`` bubbles: there is no
time grid): the order ``policy="strict"`` runs, and the order readiness-first departs from
when a later task is ready first (``last_stats`` has what ran). A cost-aware hint gives its
cost-blind order there (durations come with each step). ``_load_csv`` is refused (a loaded
order would be silently ignored): give it as ``hint=``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _Action,
)

from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes, MemoryBudget
from .._tasks import StepPlan
from ..distributed import EmulatedCost, SharedSpec
from ..policies import StepSchedule
from ._readiness_first_base import ReadinessFirstBase
from ._timeouts import GROUP_TIMEOUT, StepTimeout
from ._torch_stages import check_stages
from ._torch_step_inputs import supported

__all__ = ["ScheduleInterleavedReadinessFirst", "ScheduleReadinessFirst"]


class ScheduleReadinessFirst(ReadinessFirstBase, PipelineScheduleSingle):
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
        step_timeout: Seconds a step may take before every rank fails it; None: no limit;
            ``"group"`` (default): the pipeline process group's own timeout, as long as
            torch's schedules would wait (30 min on gloo unless the group was made with another).
        durations: ``(plan, microbatches) -> rr.Durations``: the declared durations of a
            step's tasks from its microbatches (``Chunk`` objects with ``args``,
            ``kwargs``, ``target``), so that a cost-aware hint (the default
            ``breadth_first_weighted``) orders the heavy microbatches first; every rank
            must compute the same. Without it the default hint is cost-blind (1F1B's order).
        activation_bytes: ``(plan, microbatches) -> rr.ActivationBytes``: the activation
            bytes each forward of a step stashes, from its microbatches (every rank must
            compute the same): memory is then bounded in bytes, each rank's budget by
            default what the hint's fixed order (1F1B for the cost-aware default) holds on
            that step's microbatches, and the cost-aware hint is built within it.
        memory_budget: With ``activation_bytes`` or ``sizes``: a float scales that default
            budget, an int or ``"24GiB"`` is bytes per rank (see ``rrfp_async._memory``).
        sizes: Where the bytes and the task times come from when no ``activation_bytes=``
            (``durations=``) are given. None (default): learned from the run where the
            step's microbatches differ in size, their sizes read off the first stage's
            tensor inputs and sent to every rank (docs/memory.md, "The torch drop-in";
            off with a ``hint=``, ``policy="strict"`` or ``memory_factor=``, unless a
            ``memory_budget=`` asks for bytes; with data parallelism the fits are the
            job's, each replica planning its own step). A function ``(plan,
            microbatches) -> [{feature: value}, ...]``: each microbatch's size features
            (``{"tokens": ...}``, plus ``"patches"``, ``"images"`` or features of your own;
            every rank must return the same), learned from the same way (one pipeline
            replica only). False: nothing learned (torch's fixed order and its count
            bound).
        measure_activations: Measure every training forward's activation bytes
            (``activation_bytes()``; by default only the steps it learns from are).
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
        step_timeout: StepTimeout = GROUP_TIMEOUT,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None = None,
        activation_bytes: Callable[[StepPlan, Sequence[Any]], ActivationBytes] | None = None,
        memory_budget: MemoryBudget | None = None,
        sizes: Callable[[StepPlan, Sequence[Any]], Sequence[Mapping[str, float]]]
        | bool
        | None = None,
        measure_activations: bool = False,
        emulate: EmulatedCost | None = None,
        shared: SharedSpec | None = None,
        **stage_kwargs: Any,
    ) -> None:
        if isinstance(stage, (list, tuple)):
            stage = stage[0] if stage else None
        check_stages([stage])
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
            activation_bytes=activation_bytes,
            memory_budget=memory_budget,
            sizes=sizes,
            measure_activations=measure_activations,
            emulate=emulate,
            shared=shared,
            stage_kwargs=stage_kwargs,
        )
        self.pipeline_order = _hint_order(self)

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
        # torch's base constructor asks before the hint is known; __init__ sets the order.
        return None


class ScheduleInterleavedReadinessFirst(ReadinessFirstBase, PipelineScheduleMulti):
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
        step_timeout: StepTimeout = GROUP_TIMEOUT,
        durations: Callable[[StepPlan, Sequence[Any]], Durations] | None = None,
        activation_bytes: Callable[[StepPlan, Sequence[Any]], ActivationBytes] | None = None,
        memory_budget: MemoryBudget | None = None,
        sizes: Callable[[StepPlan, Sequence[Any]], Sequence[Mapping[str, float]]]
        | bool
        | None = None,
        measure_activations: bool = False,
        emulate: EmulatedCost | None = None,
        shared: SharedSpec | None = None,
        **stage_kwargs: Any,
    ) -> None:
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        check_stages(stages)
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
            **supported(
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
            activation_bytes=activation_bytes,
            memory_budget=memory_budget,
            sizes=sizes,
            measure_activations=measure_activations,
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
        # what torch's concrete multi-stage schedules carry besides the base's
        self.n_local_stages = len(stages)
        self.num_stages = self._topology.num_virtual
        self.pipeline_order = _hint_order(self)

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Refused: torch's schedules run a loaded order; this one would ignore it.

        Raises:
            PlanError: Always (give the order as ``hint=``).
        """
        raise PlanError(
            f"_load_csv({filename!r}): {type(self).__name__} runs its hint's order, not"
            " pipeline_order; give the order as hint= (a torch schedule class or name, or an"
            " rrfp_async hint)"
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


def _hint_order(sched: ReadinessFirstBase) -> dict[int, list[_Action | None]]:
    """torch's ``pipeline_order`` of ``sched``: its hint's order at ``n_microbatches`` (the
    plan its stage is first built with), every rank, as torch's ``_Action``s (our task text
    ``2F0`` is torch's action text)."""
    hint = StepSchedule.build(sched.plan, sched._hint).hint
    return {r: [_Action.from_str(str(t)) for t in tasks] for r, tasks in hint.items()}


def _step_split(
    sched: ReadinessFirstBase,
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
