"""One process's stage of a multi-process pipeline: layout + channels + stage loop, wired.

Usage, in every process of a PP x TP (x DP) job (torchrun, or ``rrfp_async.spawn``)::

    layout = rr.ProcessLayout.from_world(pp=4, tp=2)
    groups = rr.build_groups(layout)                  # collective: every rank, same order
    executor = rr.TorchStageExecutor(modules, loss_fn, rank=layout.rank)
    async with rr.DistributedStage(layout, schedule, executor, groups=groups) as stage:
        for microbatches in loader:
            stats = await stage.run_step(microbatches)
            stage.allreduce_gradients(params)          # DP, if any
            optimizer.step(); optimizer.zero_grad()

or, from a synchronous training loop (the stage runs on an event loop thread of its own)::

    with rr.DistributedStage(layout, schedule, executor, groups=groups) as stage:
        for microbatches in loader:
            stats = stage.run_step_sync(microbatches)
            optimizer.step(); optimizer.zero_grad()

The plan check before a stage's first step: see ``_digest``.

How it is built: ``DistributedStage`` is this module's wiring (the channels, the stage loop,
opening and closing, ``run_step``) over parts, one concept per module (see
``_stage_fields``): the synchronous face (``_sync_face``), the plan and step checks
(``_plan_check``), the end-of-step agreement (``_step_agreement``), telling a failed step to
the peers and naming a lost rank (``_step_failure``), the tied and data-parallel gradient
reductions (``_stage_grads``), the traces and state dumps (``_stage_trace``), and the p2p
groups in use (``_p2p_registry``).

Design note: one stage, one p2p group, one event loop
-----------------------------------------------------
Two users of point-to-point on one process group take each other's messages, so a stage
refuses to open on a p2p group that another open stage of this process uses (``PlanError``;
see ``_p2p_registry``). The channel's threads hand every message to the event loop the stage
was opened on, so a step run on another loop would wait for messages that never reach it:
``run_step`` refuses at once (``ClosedError`` naming both loops) instead of waiting for the
watchdog.

Design note: a step fails everywhere or nowhere
-----------------------------------------------
When this rank's step fails (the executor raises, the watchdog fires, the caller cancels
the step with ``asyncio.timeout`` or an anyio scope), ``run_step`` tells every rank of the
pipeline before it re-raises: the channel's ABORT (step, origin, cause; see ``P2PChannel``'s
design note) travels hop by hop, and each rank fails that step at once with
``PeerStepError`` "step 3 failed on rank 1 (global 1): RuntimeError: boom", drops its late
messages by number, and runs the next step with the others: the step numbers stay in
lockstep, so a training loop that catches the error, zeroes the gradients and goes on
trains on every rank as if the step had been skipped. A *refused* call (bad arguments, a
second call while a step runs, a step number that failed here) is refused before anything
changes: it consumes no step number, tells nobody, and leaves a running step alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._check import check_bool, describe
from .._errors import ClosedError, PeerError, PeerStepError, PlanError
from .._tasks import StepPlan
from ..channels import DecisionChannel, P2PChannel
from ..loop import (
    Executor,
    GradStash,
    StageLoop,
    StageObserver,
    StepStats,
    SyncPortal,
    check_step_args,
    restore_grads,
    stash_grads,
)
from ..observability import TraceData
from ..policies import Policy, StepSchedule
from . import _lifetime as lifetime
from . import _state_dump as state_dump
from ._executor_hooks import EventWaitingExecutor, TieSpecExecutor, executor_seed
from ._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
from ._p2p_registry import claim_p2p_group, release_p2p_group
from ._plan_check import PlanCheck, step_check_error
from ._stage_grads import GradientSync
from ._stage_trace import StageViews
from ._step_agreement import StepAgreement
from ._step_failure import FailureTelling
from ._sync_face import SyncFace

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_STEP_TIMEOUT",
    "DistributedStage",
]

DEFAULT_STEP_TIMEOUT = 30.0
"""Seconds a step of a ``DistributedStage`` may take by default before its watchdog fires."""
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
"""Largest message a ``DistributedStage`` sends or accepts by default (256 MiB)."""


def _loop_name(loop: asyncio.AbstractEventLoop | None) -> str:
    """An event loop, told apart from others: its class, its id and whether it still runs."""
    if loop is None:
        return "no loop"
    state = "closed" if loop.is_closed() else "running" if loop.is_running() else "not running"
    cls = type(loop)
    return f"{cls.__module__}.{cls.__qualname__} at {id(loop):#x} ({state})"


def _check_layout_rank(layout: ProcessLayout) -> None:
    """Refuse a layout that places this process at another rank than torch.distributed's
    (every process building ``ProcessLayout(pp=2, rank=0)``): otherwise two processes would
    claim one pipeline rank and the other would see only "lost rank 1"."""
    real, world = dist.get_rank(), dist.get_world_size()
    if layout.rank != real:
        raise PlanError(
            f"the layout places this process at global rank {layout.rank}, but"
            f" torch.distributed says it is global rank {real} (of {world}): every process"
            " must build its layout with its own rank (rr.ProcessLayout.from_world(pp=...),"
            " or rank=dist.get_rank()); two processes at one rank cannot form a pipeline"
        )
    if layout.world_size > world:
        raise PlanError(
            f"rank {real}: the layout has {layout.world_size} ranks (PP x TP x DP), but the"
            f" torch.distributed world has {world}"
        )


def _check_positional(layout: object, schedule: object, executor: object) -> None:
    """Refuse a positional argument of the wrong kind with the call that makes the right
    one: a ``StepPlan`` for the schedule, modules for the executor (otherwise the first use
    fails with an attribute error that names neither the argument nor the fix)."""
    if not isinstance(layout, ProcessLayout):
        raise PlanError(
            f"DistributedStage: layout must be a ProcessLayout, got {describe(layout)}: pass"
            " rr.ProcessLayout.from_world(pp=...) (after dist.init_process_group, under"
            " torchrun or rr.spawn), rr.ProcessLayout.from_mesh(mesh) or"
            " rr.ProcessLayout(pp=..., rank=dist.get_rank())"
        )
    who = f"rank {layout.rank}: DistributedStage"
    if not isinstance(schedule, StepSchedule):
        got = "a StepPlan" if isinstance(schedule, StepPlan) else describe(schedule)
        raise PlanError(
            f"{who}: schedule must be a StepSchedule, got {got}: pass"
            " StepSchedule.build(plan, hint) (hint: a name such as '1f1b' or"
            " 'interleaved_1f1b', see rr.HINTS, or one task order per rank)"
        )
    if not callable(getattr(executor, "execute", None)):
        got = (
            "modules"
            if isinstance(executor, (torch.nn.Module, Mapping, list, tuple))
            else "an object with no execute method"
        )
        raise PlanError(
            f"{who}: executor must have an async execute(task, data, ctx) method, got {got}"
            f" ({describe(executor)}): wrap the modules of this rank's stages as"
            " rr.TorchStageExecutor({stage_index: module}, loss_fn)"
        )


class DistributedStage(
    SyncFace, PlanCheck, StepAgreement, FailureTelling, GradientSync, StageViews
):
    """This process's stage: a ``StageLoop`` on a ``P2PChannel``, with TP coordination.

    Args:
        layout: Where this process sits (PP x TP x DP).
        schedule: The step schedule; every process must build an equal one (checked at the
            first step: see ``check_plan``).
        executor: Runs this rank's tasks (e.g. ``TorchStageExecutor``).
        groups: The process groups from ``build_groups`` (built here when None; that is a
            collective call). Their p2p group carries this stage's messages; a stage that
            is open at the same time as another one in this process needs groups of its own
            (a second ``build_groups``).
        policy: Policy name or coroutine (used by the TP leader; followers follow).
        coordinate_tp: Followers run the TP leader's decisions (switch off only to measure
            or to demonstrate divergence).
        verify_tp: After each step, check that the TP ranks executed the same sequence.
        fold_tp_check: With ``coordinate_tp``, ``verify_tp`` and ``agree_steps`` (the
            defaults), the check rides on the decisions (the leader sends a digest of its
            sequence with the step's last decision; each follower compares its own) instead
            of an all-gather after the step: a divergence is still caught in its step, and
            the agreement fails the step on every rank (see ``DecisionChannel``'s "folded
            sequence check"). False: the all-gather, on every TP rank.
        deduce_tp: A TP follower starts, without waiting for the leader, a decision it can
            deduce: under a policy that ``chooses_ready_head`` (every built-in one), the
            next hinted task when it is ready with local inputs only (the first stage's
            forwards, the last stage's backwards, ``W`` tasks). The leader's decision is
            still checked when it arrives (``DivergenceError``). False: wait for every
            decision (to measure that path).
        step_timeout: Watchdog per step, seconds (default 30; None disables it). A
            multi-process step must never hang: when a peer is stopped or hung, this is
            how long the others wait before they fail with a ``StepTimeoutError`` naming
            it. Raise it for steps that legitimately take longer (a first step that
            compiles, a very large model).
        observer: Observer of the stage's transitions.
        device: Where received tensors are allocated.
        max_message_bytes: Largest activation or gradient this rank sends or accepts
            (default 256 MiB). A header that announces more is refused before anything is
            allocated, so a corrupt or hostile header cannot make a rank allocate
            gigabytes; every rank must use the same value (checked with the plan).
        verify_plan: Check at the first step (and when the plan changes) that every rank
            runs the same plan (see ``check_plan``); the check also gives executors whose
            seed is the default the job's seed. False with TP needs a given seed.
        check_ties: At the first training step, look for parameters on different ranks
            that have the same shape and values (tied weights) without a declared tie, and
            fail with a ``PlanError`` naming them (see ``_ties``). Switch it off when stages
            are only initialised alike.
        max_microbatches: The most microbatches a step may have (None: no limit).
        agree_steps: End every step with a small all-reduce over the control group so that a
            step that failed on any rank of the job (another pipeline, a rank that failed in
            its last task after this one finished) fails on every rank (see the design note
            at ``_post_agreement``); one int64[2] all-reduce per step.
        trace_dir: Record every step and write it, when the step ends (also when it fails),
            as a Chrome / Perfetto JSON file ``{trace_dir}/rank{global rank}.json``: each file
            holds the last step its rank ran to the end, and replaces the previous one
            atomically (a failed write keeps it). A step that failed goes to
            ``failed-rank{global rank}.json`` instead (what ran before the failure), so a
            failure never erases the last good step. Merge the ranks' files into one
            timeline with ``rrfp-async trace {trace_dir}`` (or
            ``'{trace_dir}/failed-rank*.json'`` for the failed step) or ``rr.merge_traces``.
            The write is part of ``run_step`` (on a loaded 2-core machine: 4 ms for a rank's
            32 tasks, 12 ms for 128); a write that fails is logged (logger
            ``rrfp_async.distributed._stage_trace``), never fails the step.
        emulated_gpu_time: What the trace files say of their times: True when the tasks'
            GPU time is emulated (sleeps from a cost model or in stand-in modules, on a CPU).
            None (default): True exactly when the executor emulates it
            (``TorchStageExecutor(emulate=...)``); a module that sleeps for its GPU time must
            say so here.

    Tied parameters declared by the executor (``TorchStageExecutor(shared=...)``) have their
    gradients summed over every rank that holds them at the end of each training step,
    before ``run_step`` returns (so before the optimizer). Steps that accumulate (no
    ``zero_grad`` between them) add each step's contribution once: the accumulated gradient
    is set aside while the step runs and added back after the reduction, also when the step
    fails (see ``rrfp_async.loop._accumulate``).

    Use as ``async with stage:`` and ``await stage.run_step(...)`` on one event loop, or
    from synchronous code as ``with stage:`` and ``stage.run_step_sync(...)``.

    Raises:
        PlanError: A positional argument of the wrong kind (no ``ProcessLayout``; a
            ``StepPlan`` for the schedule: the message says ``StepSchedule.build(plan,
            hint)``; modules for the executor: ``rr.TorchStageExecutor(...)``), the
            schedule does not fit the layout, ``max_message_bytes`` < 1,
            ``step_timeout`` is not a positive number or None, or the layout's rank is not
            this process's rank in torch.distributed (the message names both), or
            ``trace_dir`` cannot be created.

    Attributes:
        plan_checks: How many plan checks ran (one per distinct plan).
        plan_check_seconds: How long the last one took.
    """

    def __init__(
        self,
        layout: ProcessLayout,
        schedule: StepSchedule,
        executor: Executor,
        *,
        groups: StageGroups | None = None,
        policy: str | Policy = "readiness_first",
        coordinate_tp: bool = True,
        verify_tp: bool = True,
        fold_tp_check: bool = True,
        deduce_tp: bool = True,
        step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
        observer: StageObserver | None = None,
        device: torch.device | str = "cpu",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        verify_plan: bool = True,
        check_ties: bool = True,
        max_microbatches: int | None = None,
        agree_steps: bool = True,
        trace_dir: str | Path | None = None,
        emulated_gpu_time: bool | None = None,
    ) -> None:
        _check_positional(layout, schedule, executor)
        if schedule.plan.stages != layout.pp:
            raise PlanError(
                f"rank {layout.rank}: the schedule has {schedule.plan.stages} pipeline ranks,"
                f" the layout {layout.pp}"
            )
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or max_message_bytes < 1
        ):
            raise PlanError(f"max_message_bytes must be an int >= 1, got {max_message_bytes!r}")
        if dist.is_initialized() and layout.world_size > 1:
            _check_layout_rank(layout)
        self.layout = layout
        self.groups = groups if groups is not None else build_groups(layout)
        self.max_message_bytes = max_message_bytes
        self.verify_plan = verify_plan
        seed, seed_default = executor_seed(executor)
        if not verify_plan and layout.tp > 1 and seed is not None and seed_default:
            # The job's seed is agreed on with the plan check; without it the TP ranks would
            # draw their dropout masks from each process's own default seed, silently apart.
            raise PlanError(
                "DistributedStage(verify_plan=False) with TP: the executor's seed is the"
                " default, which the ranks agree on in the plan check; give every rank's"
                " executor the same seed (TorchStageExecutor(seed=...)) or keep verify_plan"
            )
        self._device = torch.device(device)
        inbound, outbound = pipeline_neighbors(schedule.plan, layout.pp_rank)
        # Edges both ways, even where the plan sends one way only: a failed step's ABORT
        # must reach every rank (see P2PChannel's design note).
        neighbours = sorted({*inbound, *outbound})
        self._has_peers = bool(neighbours)
        try:
            self.channel = P2PChannel(
                layout.pp_rank,
                global_ranks=layout.pipeline_peers(),
                inbound=neighbours,
                outbound=neighbours,
                group=self.groups.p2p,
                device=device,
                max_bytes=max_message_bytes,
                bound_name="DistributedStage(max_message_bytes=...)",
                payload_groups=self.groups.payload,
            )
        except ValueError as e:  # an edge the groups have no payload communicator for
            raise PlanError(f"rank {layout.rank}: {e}") from None
        # The torch executor makes its compute stream wait on each received tensor's event
        # (_streams.wait_ready); any other executor gets payloads once they arrived.
        self.channel.consumer_waits = isinstance(executor, EventWaitingExecutor) and bool(
            executor.waits_for_events
        )
        observer = self._open_trace(trace_dir, emulated_gpu_time, executor, observer)
        self.decisions: DecisionChannel | None = None
        if layout.tp > 1:
            self.decisions = DecisionChannel(
                self.groups.decisions,
                leader=layout.tp_ranks()[0],
                rank=layout.rank,
                tp_rank=layout.tp_rank,
                stage=layout.pp_rank,
                fold_check=(
                    check_bool("fold_tp_check", fold_tp_check)
                    and check_bool("coordinate_tp", coordinate_tp)
                    and check_bool("agree_steps", agree_steps)
                ),
            )
        self.stage = StageLoop(
            layout.pp_rank,
            schedule=schedule,
            executor=executor,
            endpoint=self.channel,
            policy=policy,
            observer=observer,
            step_timeout=step_timeout,
            coordinator=self.decisions,
            coordinate=coordinate_tp,
            verify_sequences=verify_tp,
            max_microbatches=max_microbatches,
            deduce_tp=deduce_tp,
        )
        self.check_ties = check_ties
        self.agree_steps = check_bool("agree_steps", agree_steps)
        self._tie_spec: dict[str, tuple[tuple[int, str], ...]] = dict(
            (executor.shared_spec if isinstance(executor, TieSpecExecutor) else None) or {}
        )
        self._tie_groups: dict[str, tuple[Any, list[int]]] | None = None
        self._ties_checked = False
        self.step_timeout = self.stage.step_timeout  # as checked there (inf: None)
        self._next_step = 0
        self._running: int | None = None  # the step run_step runs now
        self._told: int | None = None  # the last step whose failure was told (_tell_failure)
        self.stage.on_failure = self._tell_failure
        self._agreed: tuple[object, ...] | None = None
        self._control_broken: BaseException | None = None
        self.plan_checks = 0
        self.plan_check_seconds = 0.0
        self._state = "new"  # -> "open" (async with / with) -> "closed"
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was opened on
        self._portal: SyncPortal | None = None  # the sync face's loop thread (with)
        self._p2p_key: int | None = None

    async def __aenter__(self) -> DistributedStage:
        if self._state != "new":
            raise ClosedError(f"{self._who()}: a DistributedStage is opened once ({self._state})")
        self._claim_p2p_group()
        try:
            self.channel.start()
        except BaseException:
            self._release_p2p_group()
            raise
        self._loop = asyncio.get_running_loop()
        self._state = "open"
        state_dump.install()  # (from the main thread; the sync face installs it in __enter__)
        state_dump.register(self)
        lifetime.opened(self)
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        self._state = "closed"
        state_dump.unregister(self)
        lifetime.closed(self)
        try:
            if self.decisions is not None:
                timeout = 5.0 if exc_type is None else 0.5
                await asyncio.get_running_loop().run_in_executor(
                    None, self.decisions.close, timeout
                )
        finally:
            try:
                await self.channel.__aexit__(exc_type, *exc)
            finally:
                self._release_p2p_group()

    def _close_blocking(self, *, failed: bool) -> None:
        """``__aexit__``'s work without an event loop, for a stage whose loop is gone (see
        ``close``): the decision and p2p channels close on this thread."""
        self._state = "closed"
        state_dump.unregister(self)
        lifetime.closed(self)
        try:
            if self.decisions is not None:
                self.decisions.close(0.5 if failed else 5.0)
        finally:
            try:
                self.channel.close(0.5 if failed else 30.0, failed=failed)
            finally:
                self._release_p2p_group()

    def _claim_p2p_group(self) -> None:
        """Refuse to open on a p2p group that another open stage of this process uses (see
        the design note); a stage without pipeline peers uses none."""
        if not self._has_peers:
            return
        me = (
            f"{self._who()} of the pipeline of global ranks"
            f" {list(self.layout.pipeline_peers().values())}"
        )
        self._p2p_key = claim_p2p_group(self.groups.p2p, me)

    def _release_p2p_group(self) -> None:
        key, self._p2p_key = self._p2p_key, None
        if key is not None:
            release_p2p_group(key)

    async def run_step(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> StepStats:
        """Run this rank's tasks of one step (see ``StageLoop.run_step``: any number of
        microbatches, ``train=False`` for a forward-only step).

        The stage's first step, and a step whose schedule changes the plan or the hint's
        name (another number of microbatches, training vs evaluation), first check that
        every rank runs the same plan (``check_plan``). The first training step also looks
        for undeclared tied parameters (``check_ties``); every training step ends with the
        reduction of the declared ties' gradients.

        Raises:
            PlanError: The ranks disagree on the plan (on every rank).
            StepTimeoutError: The step (or the plan check) did not finish within
                ``step_timeout``; the message opens with the ranks it waited for.
            PeerStepError: The step failed, was cancelled or was refused on another rank
                (the message names it and its cause); the stage stays usable: run the next
                step.
            PeerError: A peer died (the message names it) or failed.
            PlanError: (refused, nothing changed) Bad arguments, a step already running on
                this stage, a step number that failed here before.
            ClosedError: The stage is not open (outside its ``async with`` block), or this
                is not the event loop it was opened on (the message names both loops).
        """
        if self._state != "open":
            why = (
                "was closed (its async with block ended)"
                if self._state == "closed"
                else ("is not open yet")
            )
            raise ClosedError(
                f"{self._who()}: run_step on a DistributedStage that {why}; run steps inside"
                " `async with DistributedStage(...) as stage:`"
            )
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise ClosedError(
                f"{self._who()}: run_step on event loop {_loop_name(loop)}, but the stage was"
                f" opened on event loop {_loop_name(self._loop)}; its channel hands every"
                " message to that loop, so this step would wait for messages that never come."
                " Run every step on the loop of the `async with` block (one `rr.run` around"
                " the whole training loop, not one per step), or from synchronous code use"
                " `with DistributedStage(...) as stage:` and `stage.run_step_sync(...)`"
            )
        if self._running is not None:
            # Refused before anything changes: the running step goes on undisturbed.
            raise PlanError(
                f"{self._who()}: run_step is already running step {self._running}; a stage runs"
                " one step at a time (await the running step first). This call changed nothing"
            )
        who = f"rank {self.stage.rank}"
        check_step_args(
            who, self.stage._base.plan, microbatches, step, schedule, self.stage.max_microbatches
        )
        check_bool(f"{who}: train", train)
        base = self.stage._base if schedule is None or schedule.plan.forward_only else schedule
        try:
            sched = schedule if schedule is not None else base.for_microbatches(len(microbatches))
            if not train:
                sched = sched.forward_only()
        except PlanError as e:
            raise PlanError(f"{who}: {e}") from None
        s = self._next_step if step is None else step
        self.stage.check_step_number(s)
        # Every check passed: from here on the step counts (it runs, or fails on every rank).
        self._running = s
        self._next_step = s + 1
        self.channel.at_step(s)
        if self._recorder is not None:
            self._recorder.data = TraceData()  # each file holds one step
        agreed = False  # this step's end-of-step agreement is posted (once, on every rank)
        failed = True  # until run_step returns
        stash: GradStash = []  # the tied parameters' accumulated gradients, set aside
        watcher: asyncio.Future[None] | None = None  # the step check, beside the step
        try:
            # The control group's collectives run in the same order on every rank, also for a
            # step that failed elsewhere already (its run_step raises that right after).
            changed = self.verify_plan and self._key(sched) != self._agreed
            posted = self._post_step_check(s, sched, changed=changed)
            if changed:
                # A new plan here. When every rank has a new plan (its first step, or all
                # changed alike) the plan check runs on every rank and names any field that
                # differs; when only some changed, every rank fails on the step check's rows
                # alike (the others through their watchers), and no rank posts a plan check
                # the others would not match.
                if posted is not None:
                    rows = await self._step_check_rows(s, posted)
                    if not (all(r[4] for r in rows) and len({r[0] for r in rows}) == 1):
                        try:
                            self._step_check_verdict(s, rows, differ=True)
                        except PlanError as e:
                            # The others run this step until their watchers fail it: what
                            # they send for it meanwhile is dropped here, not taken for a
                            # later step's.
                            self.stage.step_aborted(s, e)
                            raise
                await self.check_plan(sched, step=s)
            elif posted is not None:
                watcher = asyncio.ensure_future(self._watch_step_check(s, posted))
            training = not sched.plan.forward_only
            if training and not self._ties_checked:
                await self._prepare_ties(sched, s)
            if training and self._tie_groups is not None:
                stash = stash_grads(p for ps in self._shared_parameters().values() for p in ps)
            stats = await self.stage.run_step(microbatches, step=s, schedule=sched, train=train)
            if watcher is not None:
                await watcher  # (done long before, in practice) raises a disagreement
            self._order_after_step()
            agreed = True
            await self._agree(s)
            if training and self._tie_groups is not None:
                await self._reduce_ties(s)
            failed = False
            return stats
        except BaseException as e:
            if self._told != s:  # (not yet by the stage, before it waited for its task)
                self._tell_failure(s, e)
            lost = isinstance(e, PeerError) and not isinstance(e, PeerStepError)
            if not agreed and not lost and not self.channel.broken:
                # (a lost rank or a broken channel: the job cannot go on, nor agree)
                self._post_agreement(failed=True)
            if watcher is not None and isinstance(e, PeerStepError):
                # A peer that read the step check's differing rows first told this rank:
                # fail with the step check's own PlanError, as every rank does. Waited for
                # after the bookkeeping above, which a cancelled wait must not skip.
                plan_error = await step_check_error(watcher, e, s)
                if plan_error is not None:
                    raise plan_error from e
            raise
        finally:
            if watcher is not None:
                if not watcher.done():
                    watcher.cancel()  # (a lost rank: the collective never completes)
                elif not watcher.cancelled():
                    watcher.exception()  # retrieved: the step raised it, or another error
            self._order_after_step()  # (before the stashed tied gradients are added back)
            restore_grads(stash)
            self._running = None
            if self._recorder is not None:
                self._write_trace(s, sched, failed=failed)
