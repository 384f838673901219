"""megatron-core's ``get_forward_backward_func()`` over the readiness-first runtime
(``rr.megatron``).

A Megatron training script switches by one line::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from rrfp_async.megatron import get_forward_backward_func

and keeps the rest: its ``forward_step_func(data_iterator, model)`` returning ``(output,
loss_func)``, its model (wrapped in Megatron's DDP / ``Float16Module`` or not; a list of
model chunks for the interleaved, virtual-pipeline schedule), its ``TransformerConfig``
(``no_sync_func``, ``grad_sync_func``, ``param_sync_func``, ``finalize_model_grads_func``,
``grad_scale_func``, ``calculate_per_token_loss``, ``microbatch_group_size_per_vp_stage``),
its process groups (``parallel_state``, or Megatron-Bridge's ``p2p_communicator=`` and
``pg_collection=``), the keyword-only call and the returned list of loss dicts (last
pipeline stage; ``[]`` elsewhere). The factory and the function it returns take exactly the
arguments of the installed megatron-core's (read off its code: 0.16 and 0.19 differ), and
``inspect.signature`` shows them; the function also wears megatron's function's
``__name__``, ``__qualname__``, ``__module__``, ``__doc__`` and ``__wrapped__`` (see
``_megatron_forward_backward``), so logging and ``functools.wraps`` take it as megatron's.

Design note
-----------
Megatron's schedules interleave their own p2p calls with ``forward_step`` and
``backward_step`` in one fixed order. The adapter keeps the two compute halves and replaces
the order: each ``F`` task calls Megatron's own ``forward_step`` (so ``set_input_tensor``,
autocast, ``set_current_microbatch``, the loss function's two- or three-tuple, the division
by the number of microbatches or the per-token path, the MoE/MTP loss scales are Megatron's
code, not a copy) and each ``B`` task Megatron's own ``backward_step`` (``grad_scale_func`` on
the last stage, the input tensor's gradient), called as the installed version's schedules
call them. What travels between stages, and when, is the runtime's: every activation carries
its own shape (``seq_length``, ``micro_batch_size``, ``decoder_seq_length``,
``variable_seq_lengths`` and a non-interleaved ``adjust_tensor_shapes_fn`` are not needed)
on a p2p group of its own.

The hint is Megatron's own order of the schedule its ``get_forward_backward_func`` would
have picked (``megatron_order``: 1F1B, or interleaved over ``len(model)`` chunks with
megatron's stage placement, chunk ``c`` of pipeline rank ``r`` = virtual stage ``c * P +
r``); readiness-first departs from it only when a later task is ready first. With
``policy="strict"`` the tasks run in Megatron's order and parameters and losses are bitwise
Megatron's.

The mechanisms have their own modules, each with its design note: the call's checks
(``_megatron_call_checks``), the executor (``_megatron_executor``: Megatron's ``forward_step``
and ``backward_step`` as the F and B tasks), the data read in microbatch order
(``_megatron_data``), Megatron's gradient-sync moves (``_megatron_grad_sync``) and the call
itself (``_megatron_forward_backward``); the process groups (``_megatron_groups``) and what
is read off the installed megatron-core (``_megatron_peer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes, MemoryBudget
from .._tasks import StepPlan
from ._megatron_call_checks import WHO
from ._megatron_forward_backward import MegatronForwardBackward
from ._megatron_peer import peer
from ._timeouts import GROUP_TIMEOUT, StepTimeout

__all__ = ["MegatronForwardBackward", "get_forward_backward_func"]


_CACHE: dict[tuple[Any, ...], MegatronForwardBackward] = {}


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    schedule_pg_collection: Any = None,
    *,
    policy: Any = "readiness_first",
    hint: Any = None,
    memory_factor: float | None = None,
    step_timeout: StepTimeout = GROUP_TIMEOUT,
    durations: Callable[[StepPlan], Durations] | None = None,
    activation_bytes: Callable[[StepPlan], ActivationBytes] | None = None,
    memory_budget: MemoryBudget | None = None,
    sizes: bool | None = None,
    measure_activations: bool = False,
    **stage_kwargs: Any,
) -> Any:
    """The readiness-first forward-backward function, picked as megatron's own factory
    picks its schedule.

    Megatron's arguments keep their meaning: with neither ``pp_size`` nor ``vp_size`` both
    come from ``parallel_state``; otherwise they are taken as given. ``pp_size > 1`` gives
    the interleaved (virtual pipeline) schedule when ``vp_size`` is not None, else 1F1B;
    ``pp_size == 1`` gives megatron's own ``forward_backward_no_pipelining`` (one stage:
    nothing to schedule). Megatron-LM calls the factory at every training step: the same
    arguments give the same function object (and so the same open stage and p2p group).

    Args:
        pp_size: Megatron's pipeline size (checked against the call's pipeline group).
        vp_size: Megatron's virtual pipeline size (checked against ``len(model)``).
        schedule_pg_collection: Megatron's argument where the installed megatron-core has
            it (0.19): a ``ProcessGroupCollection`` is accepted (megatron ignores it too); a
            ``MultiModuleProcessGroupCollection`` (cross-grid) is refused.
        policy: The dispatch policy (default ``readiness_first``; ``strict`` runs the hint's
            order as Megatron does).
        hint: The hint (default: megatron's own order of the picked schedule; on steps of
            varying sizes, once learned, the cost-aware hint: see ``sizes``).
        memory_factor: Scale of the admission bound (a count of activations; no learning).
        step_timeout: Seconds a step may take before every rank fails it; None: no limit;
            ``"group"`` (default): the pipeline process group's own timeout, as long as
            megatron's schedules would wait (30 min on gloo unless the group was made with another).
        durations: ``plan -> rr.Durations``, called at every training call: this step's
            declared task durations (from its microbatches' sizes), so that a cost-aware
            ``hint`` (``"breadth_first_weighted"``) orders the step's heavy microbatches
            first. Every rank must return the same (megatron's middle stages read no data:
            share the sizes). Without it a cost-aware hint is cost-blind.
        activation_bytes: ``plan -> rr.ActivationBytes``, called at every training call:
            each forward's activation bytes for this step (every rank must return the
            same): memory is then bounded in bytes, by default what megatron's order holds
            on this step's microbatches (docs/memory.md).
        memory_budget: A float scales the default byte budget (what megatron's order holds
            on the step's microbatches), an int or ``"24GiB"`` is bytes per rank; given
            alone, it turns learning on (``sizes``).
        sizes: None (default): learn from the run where nothing else was chosen (no
            ``hint``, ``durations``, ``activation_bytes``, ``memory_factor``, and not
            ``policy="strict"``; not interleaved over data-parallel replicas): each
            training call's sizes
            are read off the items of the first stage's data iterator (on tensor rank 0),
            its forwards' activation bytes and its tasks' times measured and fitted, and
            each call of varying sizes is planned with the cost-aware hint within the bytes
            megatron's order holds on it (``_megatron_learning``'s design note; calls of one
            size run megatron's order). False: never.
        measure_activations: Measure every training call's activation bytes
            (``measured_bytes()``), not only those it learns from.
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``observer``, ...).

    Returns:
        A ``MegatronForwardBackward`` (call it with Megatron's keywords; ``close()`` it
        before ``dist.destroy_process_group()``; its ``__name__``, ``__doc__``,
        ``__wrapped__``, ... are megatron's function's), or megatron's
        ``forward_backward_no_pipelining`` when ``pp_size`` is 1.

    Raises:
        PlanError: ``schedule_pg_collection`` where megatron's factory has no such argument
            (naming the version) or a multi-module one; ``parallel_state`` not initialised
            when it is needed; ``vp_size`` without ``pp_size``.
    """
    mp = peer()
    if schedule_pg_collection is not None:
        if "schedule_pg_collection" not in mp.factory.parameters:
            raise PlanError(
                f"schedule_pg_collection: {mp.name}'s get_forward_backward_func takes no"
                " such argument (megatron-core 0.19 added it)"
            )
        mm = mp.multi_module_types()
        if mm and isinstance(schedule_pg_collection, mm):
            raise PlanError(
                f"schedule_pg_collection is a {type(schedule_pg_collection).__name__} (several"
                f" modules on separate grids, {mp.name}'s cross-grid schedule): not supported"
                f" by {WHO}"
            )
    if pp_size is None and vp_size is None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise PlanError(
                "get_forward_backward_func() reads the pipeline sizes from"
                " megatron.core.parallel_state, which is not initialized: call"
                " initialize_model_parallel(...) first, or pass pp_size= and vp_size= (as"
                " Megatron-Bridge does)"
            )
        pp_size = ps.get_pipeline_model_parallel_world_size()
        vp_size = ps.get_virtual_pipeline_model_parallel_world_size()
    if pp_size is None:
        raise PlanError(
            f"get_forward_backward_func(vp_size={vp_size}) without pp_size: megatron takes"
            " both as given once one is"
        )
    if pp_size <= 1:
        return mp.schedules.forward_backward_no_pipelining
    interleaved = vp_size is not None
    key = (
        interleaved,
        pp_size,
        vp_size,
        _key(policy),
        _key(hint),
        memory_factor,
        step_timeout,
        _key(durations),
        _key(activation_bytes),
        _key(memory_budget),
        sizes,
        measure_activations,
        tuple(sorted((k, _key(v)) for k, v in stage_kwargs.items())),
    )
    fb = _CACHE.get(key)
    if fb is None:  # a closed one is reused: it opens again at its next call
        fb = _CACHE[key] = MegatronForwardBackward(
            interleaved=interleaved,
            pp_size=pp_size,
            vp_size=vp_size,
            policy=policy,
            hint=hint,
            memory_factor=memory_factor,
            step_timeout=step_timeout,
            durations=durations,
            activation_bytes=activation_bytes,
            memory_budget=memory_budget,
            sizes=sizes,
            measure_activations=measure_activations,
            **stage_kwargs,
        )
    return fb


def _key(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return v
