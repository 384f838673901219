"""``MegatronForwardBackward``: the function the megatron drop-in's factory returns.

One call is one ``rr.DistributedStage`` step: the call's keywords are checked as megatron's
schedule takes them (``_megatron_call_checks``), its process groups read
(``_megatron_groups``), the step's schedule built from megatron's own order of the picked
schedule (``megatron_order``, or the user's hint; forward-only steps in megatron's
forward-only order; one per size, kept), the tasks run by ``MegatronExecutor`` (megatron's
``forward_step`` and ``backward_step``) with the data read in microbatch order
(``_megatron_data``) and megatron's gradient-sync moves around the backwards
(``_megatron_grad_sync``), then megatron's ``finalize_model_grads_func``. The stage and its
p2p group stay open from the first call for the pipeline it was first called with.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes, MemoryBudget
from .._tasks import StepPlan, Task, Topology
from ..distributed import (
    DistributedStage,
    LearnedBytes,
    LearnedDurations,
    ProcessLayout,
    build_groups,
)
from ..loop import StepStats
from ..policies import StepSchedule
from ._megatron_call_checks import bind_call, check_config, model_chunks, vp_group_size
from ._megatron_data import InOrder, Microbatch
from ._megatron_executor import MegatronExecutor
from ._megatron_grad_sync import MegatronCall, per_chunk
from ._megatron_groups import CallGroups, call_groups, layout_of
from ._megatron_learning import MegatronLearning, learns
from ._megatron_peer import megatron_order, peer
from ._timeouts import GROUP_TIMEOUT, StepTimeout, resolve_step_timeout

__all__ = ["MegatronForwardBackward"]


# Why the object wears megatron's face: code around a forward-backward function reads it as
# a function -- a log line prints ``forward_backward_func.__name__``, a profiling wrapper is
# made with ``functools.wraps(forward_backward_func)``, a Megatron-Bridge helper inspects its
# signature. So the instance is, by the standard library's own definition, a wrapper of the
# megatron-core function it stands in for: ``functools.update_wrapper`` gives it that
# function's ``__module__``, ``__name__``, ``__qualname__``, ``__doc__`` and
# ``__annotations__`` and ``__wrapped__`` (``inspect.unwrap`` reaches megatron's function;
# calling that runs megatron's own schedule, not ours). These live in the instance's
# ``__dict__``; the class keeps its own name and docstring (our API docs, ``help(type(f))``),
# and ``repr`` says which of the two it is. The runtime's state lives in ``__slots__``, not in
# ``__dict__``: ``functools.wraps(f)`` copies an object's ``__dict__`` into the wrapper, which
# would otherwise get a stale copy of ``last_stats``, the open stage and the rest.


class MegatronForwardBackward:
    """The function ``get_forward_backward_func()`` returns: call it as Megatron's.

    Its keywords are those of the installed megatron-core's
    ``forward_backward_pipelining_without_interleaving`` (or ``_with_interleaving``, when
    the factory picked the interleaved schedule); ``inspect.signature`` shows them. The
    instance also carries that function's ``__name__``, ``__qualname__``, ``__module__``,
    ``__doc__`` and ``__annotations__``, and ``__wrapped__`` is the function itself, so
    ``functools.wraps`` and logging treat it as megatron's.

    It keeps one ``rr.DistributedStage`` (and its p2p group) open from its first call on,
    for the pipeline it was first called with. Like megatron's function it needs no
    ``close()``: the stage closes before ``dist.destroy_process_group()`` destroys its
    groups, or at interpreter exit; ``close()`` closes it at once (the object can be called
    again afterwards and opens a new one).

    Attributes:
        interleaved: The interleaved (virtual pipeline) schedule: ``model`` is a list of
            chunks.
        last_stats: The runtime's ``StepStats`` of the last call on this rank.
    """

    __slots__ = (
        "__dict__",  # megatron's function's face only (see the note above)
        "__weakref__",
        "_executor",
        "_fn_name",
        "_key",
        "_layout",
        "_learning",
        "_pp_rank",
        "_rr",
        "_schedules",
        "_signature",
        "activation_bytes",
        "durations",
        "hint",
        "interleaved",
        "last_stats",
        "measure_activations",
        "memory_budget",
        "memory_factor",
        "peer",
        "policy",
        "pp_size",
        "stage_kwargs",
        "step_timeout",
        "vp_size",
    )

    # set per instance from megatron's function (functools.update_wrapper)
    __name__: str
    __qualname__: str
    __wrapped__: Callable[..., Any]
    __signature__: inspect.Signature

    def __init__(
        self,
        *,
        interleaved: bool,
        pp_size: int | None,
        vp_size: int | None,
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
    ) -> None:
        auto = learns(
            sizes=sizes,
            hint=hint,
            policy=policy,
            memory_factor=memory_factor,
            activation_bytes=activation_bytes,
            memory_budget=memory_budget,
        )
        if memory_budget is not None and activation_bytes is None and not auto:
            raise PlanError(
                "memory_budget is a byte budget: it needs the step's bytes, learned from the"
                " run (unless sizes=False), or activation_bytes=plan -> rr.ActivationBytes,"
                " each forward's bytes for the step (or bound the count with memory_factor=)"
            )
        if not isinstance(measure_activations, bool):
            raise PlanError(f"measure_activations must be a bool, got {measure_activations!r}")
        if activation_bytes is not None and memory_factor is not None:
            raise PlanError(
                "give activation_bytes (memory in bytes, with memory_budget=) or"
                " memory_factor (a count of activations), not both"
            )
        self.activation_bytes = activation_bytes
        self.memory_budget = memory_budget
        self.peer = peer()
        self.interleaved = interleaved
        self.pp_size = pp_size
        self.vp_size = vp_size
        self.policy = policy
        self.hint = hint
        self.memory_factor = memory_factor
        self.step_timeout = step_timeout
        self.durations = durations
        self.stage_kwargs = stage_kwargs
        self.measure_activations = measure_activations
        self.last_stats: StepStats | None = None
        self._learning = (
            MegatronLearning(
                hint=hint,
                memory_budget=memory_budget,
                learn_costs=durations is None,
                measure_all=measure_activations,
            )
            if auto
            else None
        )
        self._layout: ProcessLayout | None = None
        self._signature = self.peer.interleaved if interleaved else self.peer.one_f_one_b
        self._fn_name = (
            "forward_backward_pipelining_with_interleaving"
            if interleaved
            else "forward_backward_pipelining_without_interleaving"
        )
        functools.update_wrapper(self, getattr(self.peer.schedules, self._fn_name), updated=())
        self.__signature__ = self._signature
        self._rr: DistributedStage | None = None
        self._executor: MegatronExecutor | None = None
        self._key: Any = None
        self._pp_rank = 0
        self._schedules: dict[tuple[Topology, int, int, bool], StepSchedule] = {}

    def __repr__(self) -> str:
        fn = self.__wrapped__
        state = "open" if self._rr is not None else "closed"
        return (
            f"<MegatronForwardBackward: readiness-first {fn.__module__}.{fn.__qualname__}"
            f" (policy={self.policy!r}, pp_size={self.pp_size}, vp_size={self.vp_size},"
            f" {state})>"
        )

    # ------------------------------------------------------------------ the call

    def __call__(self, **kwargs: Any) -> list[Any]:
        """One step of ``num_microbatches`` microbatches, as megatron's schedule.

        Keywords: exactly those of the installed megatron-core's schedule function
        (``forward_step_func, data_iterator, model, num_microbatches, seq_length,
        micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data,
        first_val_step, adjust_tensor_shapes_fn, p2p_communicator, pg_collection,
        force_all_reduce`` in 0.16 - 0.19). ``seq_length``, ``micro_batch_size`` and
        ``decoder_seq_length`` are accepted and not needed (activations carry their
        shapes); so is ``adjust_tensor_shapes_fn`` without interleaving.

        Returns:
            The loss dicts (what each ``loss_func`` returned last) in microbatch order on
            the last pipeline stage, ``[]`` elsewhere (with ``collect_non_loss_data``, what
            ``loss_func(output, non_loss_data=True)`` returned).

        Raises:
            PlanError: A keyword megatron's function does not take, or a required one
                missing (naming it and the megatron-core version); a feature this adapter
                does not support, named: context parallelism, a multi-module (cross-grid)
                collection, ``collect_non_loss_data`` in a training step, partial activation
                checkpointing, deferred embedding wgrad, activation offloading, the combined
                MoE 1F1B, local CUDA graphs, an interleaved ``adjust_tensor_shapes_fn``;
                model chunks that do not match the schedule; megatron's interleaved
                microbatch constraints; or bad values.
            StepTimeoutError, PeerError: see ``rr.DistributedStage.run_step``.
        """
        a = bind_call(self._signature, kwargs, self.peer, self._fn_name)
        m = a["num_microbatches"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise PlanError(f"num_microbatches must be an int >= 1, got {m!r}")
        models, iterators = model_chunks(
            a["model"], a["data_iterator"], interleaved=self.interleaved, vp_size=self.vp_size
        )
        from megatron.core.utils import get_model_config

        config = get_model_config(models[0])
        forward_only = bool(a["forward_only"])
        check_config(config, models, a, forward_only, interleaved=self.interleaved, peer=self.peer)
        groups = call_groups(self.peer, a["p2p_communicator"], a["pg_collection"])
        pp = int(groups.pp.size())
        if self.pp_size is not None and self.pp_size != pp:
            raise PlanError(
                f"get_forward_backward_func(pp_size={self.pp_size}), but the call's pipeline"
                f" group ({groups.source}) has {pp} ranks"
            )
        group = vp_group_size(config, pp, m, interleaved=self.interleaved)
        topology = Topology(stages=pp, chunks=len(models))
        schedule = self._schedule(topology, m, group, forward_only)
        stage = self._open(groups, models, self._schedule(topology, m, group, False))
        executor, layout = self._executor, self._layout
        assert executor is not None and layout is not None
        srcs = [InOrder(it) for it in iterators]
        learned = None
        if not forward_only:
            plan = schedule.plan
            durations = None if self.durations is None else self.durations(plan)
            if self._learning is not None:
                was_off = self._learning.off
                learned = self._learning.schedule(
                    layout=layout,
                    models=models,
                    executor=executor,
                    plan=plan,
                    fixed=self._hint_source(topology, group),
                    key=(groups.key, group),
                    data=srcs[0],
                    durations=durations,
                    draws=executor.draws,
                )
                if was_off is None and self.learning_off is not None:
                    warnings.warn(
                        f"rrfp_async.megatron: {self.learning_off}", RuntimeWarning, stacklevel=2
                    )
            if learned is not None:
                schedule = learned
            elif self.activation_bytes is not None:
                schedule = schedule.with_durations(
                    durations, activation_bytes=self.activation_bytes(plan)
                )
            elif durations is not None:
                schedule = schedule.with_durations(durations)
        call = MegatronCall(
            forward_step_func=a["forward_step_func"],
            config=config,
            models=models,
            microbatches=m,
            forward_only=forward_only,
            collect_non_loss_data=bool(a["collect_non_loss_data"]),
            first_val_step=a["first_val_step"],
            cp_size=groups.cp_size,
            pp_rank=self._pp_rank,
            pp=pp,
            interleaved=self.interleaved,
        )
        executor.modules = {c * pp + self._pp_rank: mod for c, mod in enumerate(models)}
        executor.call = call
        mbs = [Microbatch(srcs, i) for i in range(m)]
        # megatron's ModelParallelConfig has timers (None unless set); a duck-typed config may not.
        timers = getattr(config, "timers", None)
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if self.interleaved and not forward_only and config.param_sync_func is not None:
            sync = per_chunk(config.param_sync_func, len(models))
            for c, mod in enumerate(models):
                sync[c](mod.parameters())
        call.disable_grad_sync()
        try:
            stats = stage.run_step_sync(mbs, schedule=schedule, train=not forward_only)
        except BaseException:
            call.enable_grad_sync()
            raise
        finally:
            executor.call = None
        self.last_stats = stats
        if learned is not None and self._learning is not None:
            self._learning.observe(stats)  # (a collective on the learning group)
        # Megatron leaves no_sync entered after a forward-only step; it is closed here.
        if forward_only:
            call.enable_grad_sync()
        else:
            call.finish_grad_sync()
        if not forward_only and config.finalize_model_grads_func is not None:
            total = torch.zeros([], dtype=torch.int, device=_device())
            for key in sorted(call.num_tokens, key=lambda k: (k[1], k[0])):
                total += call.num_tokens[key].to(total.device)  # megatron's sum
            config.finalize_model_grads_func(
                models if self.interleaved else [models[0]],
                total if config.calculate_per_token_loss else None,
                pg_collection=groups.pg_collection,
                force_all_reduce=a["force_all_reduce"],
            )
        if timers is not None:
            timers("forward-backward").stop()
        return [x for i in range(m) for x in call.store.get(i, [])]

    # ------------------------------------------------------------------ the runtime

    def _open(self, groups: CallGroups, models: list[Any], base: StepSchedule) -> DistributedStage:
        key = (groups.key, len(models))
        if self._rr is not None:
            if key != self._key:
                raise PlanError(
                    f"this forward-backward function runs the pipeline {self._key} it was"
                    f" first called with, not {key}: close() it first, or use another"
                    " get_forward_backward_func(...) keyword set"
                )
            return self._rr
        layout = layout_of(groups)
        self._layout = layout
        self._pp_rank = layout.pp_rank
        pp = layout.pp
        self._executor = MegatronExecutor(
            {c * pp + layout.pp_rank: mod for c, mod in enumerate(models)},
            self.peer,
            dist.get_rank(),
            measure_activations=self.measure_activations,
        )
        kwargs: dict[str, Any] = {"check_ties": False}  # finalize_model_grads reduces ties
        kwargs.update(self.stage_kwargs)
        stage = DistributedStage(
            layout,
            base,
            self._executor,
            groups=build_groups(layout, tp_group=groups.tp if layout.tp > 1 else None),
            policy=self.policy,
            step_timeout=resolve_step_timeout(self.step_timeout, groups.pp),
            **kwargs,
        )
        stage.__enter__()
        self._rr, self._key = stage, key
        return stage

    def _hint_source(self, topo: Topology, group: int) -> Any:
        if self.hint is not None:
            return self.hint
        interleaved = self.interleaved

        def megatron(plan: StepPlan, durations: Any) -> dict[int, list[Task]]:
            return megatron_order(
                topo.stages, topo.chunks, plan.microbatches, group, interleaved=interleaved
            )

        megatron.__name__ = "megatron_interleaved" if interleaved else "megatron_1f1b"
        return megatron

    def _build(self, plan: StepPlan, group: int) -> StepSchedule:
        source = self._hint_source(plan.topology, group)
        if self.activation_bytes is not None:
            # Bytes come with each call; the base's budget is on uniform bytes (every rank
            # builds it alike: the plan check compares it).
            return StepSchedule.build(
                plan,
                source,
                activation_bytes=ActivationBytes.uniform(plan),
                memory_budget=self.memory_budget,
            )
        return StepSchedule.build(plan, source, memory_factor=self.memory_factor)

    def _schedule(self, topo: Topology, m: int, group: int, forward_only: bool) -> StepSchedule:
        """This step's schedule: megatron's order for ``m`` microbatches (or the user's
        hint); forward-only steps in megatron's forward-only order. Built once per size."""
        key = (topo, m, group, forward_only)
        got = self._schedules.get(key)
        if got is None:
            plan = StepPlan(topology=topo, microbatches=m)
            if not forward_only:
                got = self._build(plan, group)
            elif self.hint is not None:
                got = self._build(plan, group).forward_only()
            else:
                fplan = StepPlan(topology=topo, microbatches=m, forward_only=True)
                order = megatron_order(
                    topo.stages,
                    topo.chunks,
                    m,
                    group,
                    interleaved=self.interleaved,
                    forward_only=True,
                )
                got = StepSchedule.build(fplan, order)
            self._schedules[key] = got
        return got

    @property
    def learned_bytes(self) -> LearnedBytes | None:
        """The activation bytes learned from the run (its ``model`` and ``error``), where the
        function learns (by default: see ``_megatron_learning``), after its first training
        call."""
        return None if self._learning is None else self._learning.learned_bytes

    @property
    def learned_durations(self) -> LearnedDurations | None:
        """The task times learned from the run where the function learns and no
        ``durations=`` were given, after its first training call."""
        return None if self._learning is None else self._learning.learned_durations

    @property
    def learning_off(self) -> str | None:
        """Why the function stopped learning after it started (its training forwards draw
        random numbers, dropout: each stage's forwards then keep Megatron's order, so each
        microbatch draws what it draws under Megatron), or None: it learns, or never
        did."""
        off = None if self._learning is None else self._learning.off
        if off is None:
            return None
        return (
            f"{off}: its forwards keep Megatron's order, so each microbatch draws what it"
            " draws under Megatron; the learned, cost-aware plan is off"
        )

    def measured_bytes(self) -> dict[tuple[int, int], int]:
        """The activation bytes of the last training call's forwards on this rank,
        ``{(virtual stage, microbatch): bytes}``, as measured: every call with
        ``measure_activations=True``, else the calls it learned from (empty otherwise)."""
        return {} if self._executor is None else self._executor.activation_bytes()

    def close(self) -> None:
        """Close the runtime's stage (its channel and loop thread) and compute thread; what
        was learned is forgotten (the next call starts afresh)."""
        if self._learning is not None:
            self._learning.reset()
        stage, self._rr, self._key = self._rr, None, None
        if stage is not None:
            stage.__exit__(None, None, None)
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()

    def __enter__(self) -> MegatronForwardBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
