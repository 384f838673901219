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

How it is built: ``DistributedStage`` wires the channels, the stage loop and parts that own
their state, each built with its collaborators passed in (and testable alone): the control
group's checks and agreement (``ControlGroup``, ``_control_group``), the tied gradients
(``TiedGradients``, ``_stage_grads``), telling a failed step to the peers and naming a lost
rank (``FailureReporter``, ``_step_failure``), the trace files (``StageTrace``,
``_stage_trace``), the synchronous face (``BlockingFace``, ``_sync_face``) and the p2p groups
in use (``_p2p_registry``). Its ``run_step`` is the step's algorithm; opening and closing are
its own.

Design note: one stage, one p2p group, one event loop
-----------------------------------------------------
Two users of point-to-point on one process group take each other's messages, so a stage
refuses to open on a p2p group that another open stage of this process uses (``PlanError``;
see ``_p2p_registry``). The channel's threads hand every message to the event loop the stage
was opened on, so a step run on another loop would wait for messages that never reach it:
``run_step`` refuses at once (``ClosedError`` naming both loops) instead of waiting for the
watchdog.

Design note: a step fails everywhere or nowhere (invariant 6)
-------------------------------------------------------------
When this rank's step fails (the executor raises, the watchdog fires, the caller cancels
the step with ``asyncio.timeout`` or an anyio scope), ``run_step`` tells every rank of the
pipeline before it re-raises: the channel's ABORT (step, origin, cause; see ``P2PChannel``'s
design note) travels hop by hop, and each rank fails that step at once with
``PeerStepError`` "step 3 failed on rank 1 (global 1): RuntimeError: boom", drops its late
messages by number, and runs the next step with the others: the step numbers stay in
lockstep, so a training loop that catches the error, zeroes the gradients and goes on
trains on every rank as if the step had been skipped. A *refused* call (bad arguments, a
second call while a step runs, a step number that failed on this rank) is refused before anything
changes: it consumes no step number, tells nobody, and leaves a running step alone.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist

from .._check import check_bool
from .._errors import ClosedError, PeerError, PeerStepError, PlanError
from ..channels import DecisionChannel, P2PChannel
from ..loop import (
    Executor,
    GradStash,
    StageLoop,
    StageObserver,
    StepStats,
    resolve_step,
    restore_grads,
    run_blocking,
)
from ..policies import Policy, StepSchedule
from . import _lifetime as lifetime
from . import _pulse as pulse
from . import _state_dump as state_dump
from ._control_group import ControlGroup, TorchCollectives
from ._digest import PlanDigest
from ._executor_hooks import EventWaitingExecutor, SeedAdoptingExecutor, executor_seed
from ._layout import ProcessLayout, StageGroups, build_groups, name_global, pipeline_neighbors
from ._p2p_registry import claim_p2p_group, release_p2p_group
from ._pulse import default_store
from ._stage_args import (
    check_layout_rank,
    check_positional,
    not_open_with_with,
    refuse_unless_open_here,
)
from ._stage_grads import TiedGradients, allreduce_dp, order_after_step
from ._stage_trace import StageTrace
from ._step_failure import FailureReporter, failed_by_itself
from ._sync_face import BlockingFace
from ._tp_keywords import UNSET, TPOptions, tp_options

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_STEP_TIMEOUT",
    "DistributedStage",
]

DEFAULT_STEP_TIMEOUT = 30.0
"""Seconds a step of a ``DistributedStage`` may take by default before its watchdog fires."""
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
"""Largest message a ``DistributedStage`` sends or accepts by default (256 MiB)."""
_CLOSE_WAIT = 60.0
"""How long ``close`` waits for a stage's close on another thread's loop (its channels
wait up to 30 s for the peers' CLOSE)."""


class DistributedStage:
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
        tp: How the TP ranks of a stage work together (``TPOptions``: coordinate, verify,
            fold_check, deduce; all on by default).
        coordinate_tp: ``TPOptions.coordinate``, as a flat keyword (give ``tp`` or these).
        verify_tp: ``TPOptions.verify``, as a flat keyword.
        fold_tp_check: ``TPOptions.fold_check``, as a flat keyword.
        deduce_tp: ``TPOptions.deduce``, as a flat keyword.
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
            at ``ControlGroup.end_step``; it carries the step check); one int64[7] all-gather
            per step.
        trace_dir: Record every step and write it, when the step ends (also when it fails),
            as a Chrome / Perfetto JSON file ``{trace_dir}/rank{global rank}.json``: each file
            holds the last step its rank ran to the end, and replaces the previous one
            atomically (a failed write keeps it). A failed step goes to
            ``failed-rank{global rank}.json`` (what this rank saw of it, marked failed: the
            error, the tasks still running), written before ``run_step`` raises. Merge the
            ranks' files with ``rrfp-async trace {trace_dir}`` (its newest step; it names the
            ranks whose files are missing or torn) or ``rr.merge_traces``.
            The write is part of ``run_step`` (its cost: BENCHMARKS.md#trace-write-cost); a
            write that fails is logged (logger ``rrfp_async.distributed._stage_trace``),
            never fails the step.
        emulated_gpu_time: What the trace files say of their times: True when the tasks'
            GPU time is emulated (sleeps from a cost model or in stand-in modules, on a CPU).
            None (default): True exactly when the executor emulates it
            (``TorchStageExecutor(emulate=...)``); a module that sleeps for its GPU time must
            say so here.

    Tied parameters declared by the executor (``TorchStageExecutor(shared=...)``) have their
    gradients summed over every rank that holds them at the end of each training step,
    before ``run_step`` returns (so before the optimizer; invariant 7). Steps that accumulate (no
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
            ``trace_dir`` cannot be created, or ``tp`` and a flat TP keyword are both given
            (the message names them).

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
        tp: TPOptions | None = None,
        coordinate_tp: bool = UNSET,
        verify_tp: bool = UNSET,
        fold_tp_check: bool = UNSET,
        deduce_tp: bool = UNSET,
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
        check_positional(layout, schedule, executor)
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
        self.tp = tp_options(
            tp,
            f"rank {layout.rank}: DistributedStage",
            coordinate_tp=coordinate_tp,
            verify_tp=verify_tp,
            fold_tp_check=fold_tp_check,
            deduce_tp=deduce_tp,
        )
        if dist.is_initialized() and layout.world_size > 1:
            check_layout_rank(layout)
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
                # The torch executor makes its compute stream wait on each received tensor's
                # event (_streams.wait_ready); any other executor gets payloads once arrived.
                consumer_waits=isinstance(executor, EventWaitingExecutor)
                and bool(executor.waits_for_events),
            )
        except ValueError as e:  # an edge the groups have no payload communicator for
            raise PlanError(f"rank {layout.rank}: {e}") from None
        self.trace = StageTrace(
            trace_dir,
            emulated_gpu_time=emulated_gpu_time,
            executor=executor,
            rank=layout.rank,
            peers=layout.pipeline_peers(),
            who=self._who(),
        )
        self.agree_steps = check_bool("agree_steps", agree_steps)
        self.decisions: DecisionChannel | None = None
        if layout.tp > 1:
            self.decisions = DecisionChannel(
                self.groups.decisions,
                leader=layout.tp_ranks()[0],
                rank=layout.rank,
                tp_rank=layout.tp_rank,
                stage=layout.pp_rank,
                fold_check=self.tp.fold_check and self.tp.coordinate and self.agree_steps,
            )
        self.stage = StageLoop(
            layout.pp_rank,
            schedule=schedule,
            executor=executor,
            endpoint=self.channel,
            policy=policy,
            observer=self.trace.observer(observer),
            step_timeout=step_timeout,
            coordinator=self.decisions,
            coordinate=self.tp.coordinate,
            verify_sequences=self.tp.verify,
            max_microbatches=max_microbatches,
            deduce_tp=self.tp.deduce,
            on_failure=lambda step, e: self.failures.tell(step, e),  # (built below)
        )
        self.step_timeout = self.stage.step_timeout  # as checked there (inf: None)
        self.ties = TiedGradients(
            executor,
            layout=layout,
            control_group=self.groups.control,
            check_undeclared=check_ties,
            timeout=self.step_timeout,
            who=self._who(),
        )
        self.control = ControlGroup(
            TorchCollectives(self.groups.control, torch.device(device)),
            who=self._who(),
            rank=layout.rank,
            world_size=layout.world_size,
            timeout=self.step_timeout,
            verify_plan=verify_plan,
            agree_steps=self.agree_steps,
            digest_of=self._plan_digest,
            adopt_seed=self._adopt_seed,
            origin=self.channel.origin,
            silent=pulse.silent_ranks,
            notes=pulse.notes,
            name=functools.partial(name_global, layout),
            blame=self.channel.blame_global,
        )
        self.failures = FailureReporter(
            self.channel,
            self.decisions,
            who=self._who(),
            rank=layout.rank,
            pp_rank=layout.pp_rank,
            peers=layout.pipeline_peers(),
            step_timeout=self.step_timeout,
            schedule=lambda: self.stage.schedule,
            dump=self.dump_state,
            silent=pulse.silent_ranks,
            notes=pulse.notes,
        )
        self._next_step = 0
        self._running: int | None = None  # the step run_step runs now
        self._state = "new"  # -> "open" (async with / with) -> "closed"
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was opened on
        self._face: BlockingFace | None = None  # the sync face (with)
        self._p2p_key: int | None = None

    @property
    def check_ties(self) -> bool:
        """Whether the first training step looks for undeclared tied parameters."""
        return self.ties.check_undeclared

    @property
    def trace_dir(self) -> Path | None:
        """Where each step's trace file goes (None: no traces)."""
        return self.trace.trace_dir

    @property
    def plan_checks(self) -> int:
        """How many plan checks ran (one per distinct plan)."""
        return self.control.plan_checks

    @property
    def plan_check_seconds(self) -> float:
        """How long the last plan check took."""
        return self.control.plan_check_seconds

    def _who(self) -> str:
        return f"rank {self.layout.pp_rank} (global {self.layout.rank})"

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ClosedError(f"{self._who()}: a DistributedStage is opened once ({self._state})")
        pulse.opened()  # (counted on every rank alike: its notes on the board are this opening's)
        self._claim_p2p_group()
        # Its heartbeat (once per process; build_groups starts it too): see ``_pulse``.
        pulse.start(default_store(), self.layout.rank, self.layout.world_size)
        try:
            self.channel.start()
        except BaseException as e:
            self._release_p2p_group()
            if isinstance(e, Exception):  # (its peers' plan check then names it)
                await pulse.note(pulse.OPEN, e)
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
                # A thread of its own, not the loop's default executor: that one refuses
                # work once the interpreter has begun to exit (the ``atexit`` close).
                await run_blocking(self.decisions.close, timeout, name="rrfp-close")
        finally:
            try:
                await self.channel.__aexit__(exc_type, *exc)
            finally:
                self._release_p2p_group()

    def __enter__(self) -> Self:
        """Open the stage for a synchronous training loop: start an event loop on a thread
        of its own (anyio's blocking portal; uvloop when installed) and open the stage on
        it; ``run_step_sync`` then runs steps there, and the end of the ``with`` block
        closes the stage and stops the thread.

        Raises:
            ClosedError: The stage was opened before.
            PlanError: Another open stage of this process uses the same p2p group.
        """
        if self._state != "new":
            raise ClosedError(f"{self._who()}: a DistributedStage is opened once ({self._state})")
        self._face = BlockingFace.open(self.__aenter__, self._who())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        face, self._face = self._face, None
        if face is not None:  # (else: not opened with ``with``)
            face.close(self.__aexit__, exc_type, exc, tb)

    def close(self) -> None:
        """Close the stage from synchronous code, however it was opened; idempotent (a stage
        that is not open is left as it is).

        ``with`` / ``async with`` close the stage at the end of their block; this is for an
        owner whose stage has no block: the drop-ins' schedules (when they are closed or
        garbage-collected), the hooks that close what is still open before
        ``torch.distributed.destroy_process_group`` and at interpreter exit (see
        ``_lifetime``). A stage opened with ``with`` closes as at the end of the block; one
        opened with ``async with`` on a loop that still runs closes there (this call waits);
        one whose loop has ended closes its channels on this thread.

        Raises:
            ClosedError: Called on the event loop thread of a stage opened there with
                ``async with`` (it would wait for itself): there, leave the block.
        """
        if self._state != "open":
            return
        if self._face is not None:
            self.__exit__(None, None, None)
            return
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                raise ClosedError(
                    f"{self._who()}: close() was called on the event loop the stage runs on;"
                    " there, leave its `async with` block (or `await stage.__aexit__(...)`)"
                )
            fut = asyncio.run_coroutine_threadsafe(self.__aexit__(None, None, None), loop)
            fut.result(timeout=_CLOSE_WAIT)
            return
        self._close_blocking(failed=False)

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
        if self._has_peers:
            peers = list(self.layout.pipeline_peers().values())
            me = f"{self._who()} of the pipeline of global ranks {peers}"
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
                this stage, a step number that failed on this rank before.
            ClosedError: The stage is not open (outside its ``async with`` block), or this
                is not the event loop it was opened on (the message names both loops).
        """
        refuse_unless_open_here(self._who(), self._state, self._loop, self._running)
        # This step's schedule and number, checked as ``StageLoop.run_step`` resolves them
        # (bad arguments, a step number that failed here before: refused, nothing changes).
        loop = self.stage
        resolved = resolve_step(
            f"rank {loop.rank}", loop.base_schedule, microbatches, step=step, schedule=schedule,
            train=train, next_step=self._next_step, max_microbatches=loop.max_microbatches,
        )  # fmt: skip
        loop.check_step_number(resolved.step)
        sched, s = resolved.schedule, resolved.step
        # Every check passed: from here on the step counts (it runs, or fails on every rank).
        self._running = s
        self._next_step = s + 1
        self.channel.at_step(s, self.control.plan_tag(sched))
        self.trace.begin_step()
        training = not sched.plan.forward_only
        written = False  # this step's trace file
        stash: GradStash = []  # the tied parameters' accumulated gradients, set aside
        try:
            await self.control.begin_step(s, sched)  # a stage's first plan check
            if training:
                await self.ties.prepare(sched, s)  # (the first training step only)
                stash = self.ties.set_aside()
            stats = await self.stage.run_step(microbatches, step=s, schedule=sched, train=train)
            order_after_step(self.stage.executor)
            await self.control.end_step(s)  # the agreement, with the step check
            if training:
                await self.ties.reduce(s)
            return stats
        except BaseException as e:
            self.failures.tell_once(s, e)  # (unless the stage told it, before its wait)
            # The evidence next, before anything here can wait (or the process be stopped).
            self.trace.write(
                s, sched, policy=self.stage.policy_name, failure=e, at=self.stage.now()
            )
            written = True
            if failed_by_itself(e):  # on the job's board, for ranks it cannot tell
                await pulse.note(s, e)
            await self.failures.name_root(s, e)  # (waits a moment: a stuck policy, the pulse)
            # A lost rank or a broken channel: the job cannot go on, nor agree.
            lost = isinstance(e, PeerError) and not isinstance(e, PeerStepError)
            self.control.fail_step(can_agree=not lost and not self.channel.broken)
            plan_error = await self.control.failed_step_error(s, e)
            if plan_error is not None:
                raise plan_error from e
            raise
        finally:
            self.control.finish_step()
            order_after_step(self.stage.executor)  # (before the tied gradients come back)
            restore_grads(stash)
            self._running = None
            if not written:
                self.trace.write(s, sched, policy=self.stage.policy_name)

    def run_step_sync(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> StepStats:
        """``run_step`` for synchronous code, inside ``with DistributedStage(...) as stage:``:
        the step runs on the stage's event loop thread and this call blocks until it ends.

        Args:
            microbatches: The step's microbatches (any number).
            step: The step number (default: one more than the last).
            schedule: A schedule for this step.
            train: False for a forward-only step.

        Returns:
            This rank's stats.

        Raises:
            ClosedError: The stage is not open with ``with`` (not yet, no more, or with
                ``async with``: there, ``await stage.run_step(...)``).
            PlanError, StepTimeoutError, PeerError: As ``run_step`` raises them (the same
                objects, not wrapped).
            BaseException: What a module raised on the compute thread when it was no
                ``Exception`` (``KeyboardInterrupt``): ``run_step`` fails the step with
                ``InterruptedStepError``, this re-raises the original.
        """
        face = self._face
        if face is None:
            raise not_open_with_with(self._who(), self._state)
        return face.call(self.run_step, microbatches, step=step, schedule=schedule, train=train)

    async def check_plan(self, schedule: StepSchedule | None = None, *, step: int = 0) -> None:
        """Check that every rank runs the same plan: all-gather each rank's ``PlanDigest``
        over the control group and compare (see ``_digest``). Collective: every rank calls
        it at the same point; ``run_step`` does, at the first step and when the plan
        changes, so call it yourself only to take its cost out of a timed step. The check
        also gives an executor whose seed is the default the job's seed.

        Args:
            schedule: The schedule to check (default: the stage's).
            step: The step number, for messages.

        Raises:
            PlanError: The ranks disagree; the message names each differing field and the
                ranks on each side.
            StepTimeoutError: Not every rank joined within ``step_timeout``.
            PeerError: The all-gather failed (a rank died).
        """
        sched = schedule if schedule is not None else self.stage.schedule
        await self.control.check_plan(sched, step=step)

    def _plan_digest(self, schedule: StepSchedule) -> PlanDigest:
        """This rank's ``PlanDigest`` of ``schedule`` (what the plan check compares)."""
        seed, seed_default = executor_seed(self.stage.executor)
        return PlanDigest.of(
            schedule,
            policy=self.stage.policy_name,
            layout=self.layout,
            max_message_bytes=self.max_message_bytes,
            ties=self.ties.digest(),
            rng_seed=seed,
            seed_default=seed_default,
        )

    def _adopt_seed(self, seed: int) -> None:
        """The plan check found the job's seed: an executor whose seed is the default takes
        it (``SeedAdoptingExecutor``)."""
        ex = self.stage.executor
        if isinstance(ex, SeedAdoptingExecutor):
            ex.adopt_seed(seed)

    def allreduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average gradients over the data-parallel group (no-op without DP). Blocking."""
        allreduce_dp(params, self.groups.dp, self.layout.dp)

    def dump_state(self, reason: str = "requested") -> Path | None:
        """Write this rank's state now (see ``rrfp_async.distributed._state_dump``): the
        step, the running task, the ready and admitted sets, what each waiting task waits
        for and the last events, to the log and to ``trace_dir/state-rank{r}.txt``. A
        ``SIGUSR1`` to the process does it for every open stage; a step timeout does it too.

        Returns:
            The file written (None without a ``trace_dir``).
        """
        return state_dump.write_state(self, reason)

    def _state_text(self) -> str:
        return self.stage.dump(recent=True)

    @property
    def _dump_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop if self._state == "open" else None

    @property
    def _dump_rank(self) -> int:
        return self.layout.rank
