"""A stage's control group: every rank runs the same plan and the same step, and a step that
failed on any rank fails on every rank.

``ControlGroup`` owns a ``DistributedStage``'s collectives on the control group (a gloo
group of every rank of the job, ``StageGroups.control``) and their rules: the plan check
(``check_plan``, the digest in ``_digest``), the step check (``begin_step``, its rules in
``_plan_check``) and the end-of-step agreement (``end_step`` / ``fail_step``). Its state is
its own: whether the group broke (a collective left posted after a timeout, raised by every
later check), the last plan it agreed on, the running step's watcher and whether its
agreement was posted, and the plan checks' count and cost. It reaches the group through a
``Collectives`` (``TorchCollectives`` over torch.distributed; a test gives a fake), and
tells the stage what it needs through the callables it is built with, so it can be built
and tested alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._bridges import work_future
from .._errors import PeerError, PeerStepError, PlanError, StepTimeoutError
from ..policies import StepSchedule
from ._digest import PlanDigest, adopt_default_seed, plan_disagreement
from ._plan_check import (
    plan_key,
    rows_all_changed_alike,
    step_check_error,
    step_check_verdict,
    step_row,
)

__all__ = ["Collectives", "ControlGroup", "TorchCollectives"]


class Collectives(Protocol):
    """The control group's collectives, as ``ControlGroup`` uses them: int64 rows, posted
    without waiting (each returns what ``work_future`` awaits)."""

    def size(self) -> int:
        """How many ranks the group has."""

    def row(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device the group's backend needs."""

    def all_gather(self, outs: list[torch.Tensor], row: torch.Tensor) -> Any:
        """Post an all-gather of ``row`` into ``outs`` (one per rank); its ``Work``."""

    def all_reduce_max(self, row: torch.Tensor) -> Any:
        """Post an element-wise MAX all-reduce of ``row``, in place; its ``Work``."""


class TorchCollectives:
    """``Collectives`` on a torch.distributed group (None: the default group).

    Args:
        group: The control group.
        device: Where rows go when the group is the default one and not gloo (NCCL).
    """

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self._device = device

    def size(self) -> int:
        """The group's world size."""
        return dist.get_world_size(self.group)

    def row(self, values: Sequence[int]) -> torch.Tensor:
        """An int64 row, on ``device`` when the group is the default non-gloo one."""
        buf = torch.tensor(list(values), dtype=torch.int64)
        if self.group is None and "gloo" not in str(dist.get_backend()):
            buf = buf.to(self._device)
        return buf

    def all_gather(self, outs: list[torch.Tensor], row: torch.Tensor) -> Any:
        """``dist.all_gather(..., async_op=True)`` on the group."""
        return dist.all_gather(outs, row, group=self.group, async_op=True)

    def all_reduce_max(self, row: torch.Tensor) -> Any:
        """``dist.all_reduce(..., MAX, async_op=True)`` on the group."""
        return dist.all_reduce(row, op=dist.ReduceOp.MAX, group=self.group, async_op=True)


class ControlGroup:
    """The plan check, the step check and the end-of-step agreement of one stage.

    Args:
        collectives: The control group's collectives.
        who: This rank, for messages (``"rank 0 (global 0)"``).
        rank: This process's global rank (what the agreement names as a failure's origin).
        world_size: The job's ranks; with one there is nothing to check or agree on.
        timeout: How long a collective may take (the step timeout; None: no limit).
        verify_plan: Run the plan check and the step check.
        agree_steps: End every step with the agreement.
        digest_of: This rank's ``PlanDigest`` of a schedule.
        adopt_seed: Called with the job's seed when this rank's seed is the default one
            (see ``adopt_default_seed``).
        abort_step: Called as ``abort_step(step, error)`` when the step check fails a step
            that runs (``StageLoop.step_aborted``).

    Attributes:
        plan_checks: How many plan checks ran (one per distinct plan).
        plan_check_seconds: How long the last one took.
    """

    def __init__(
        self,
        collectives: Collectives,
        *,
        who: str,
        rank: int,
        world_size: int,
        timeout: float | None,
        verify_plan: bool,
        agree_steps: bool,
        digest_of: Callable[[StepSchedule], PlanDigest],
        adopt_seed: Callable[[int], None],
        abort_step: Callable[[int, BaseException], None],
    ) -> None:
        self._comm = collectives
        self._who = who
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self.verify_plan = verify_plan
        self.agree_steps = agree_steps
        self._digest_of = digest_of
        self._adopt_seed = adopt_seed
        self._abort_step = abort_step
        self.plan_checks = 0
        self.plan_check_seconds = 0.0
        self._broken: BaseException | None = None  # a collective was left posted
        self._agreed: tuple[object, ...] | None = None  # the plan key of the last plan check
        self._watcher: asyncio.Future[None] | None = None  # the step check, beside the step
        self._agreement_posted = False  # this step's agreement (once, on every rank)

    @property
    def broken(self) -> BaseException | None:
        """The error that broke the group (a collective timed out and stays posted): every
        later check raises it. None while the group is usable."""
        return self._broken

    def plan_changed(self, schedule: StepSchedule) -> bool:
        """Whether ``schedule``'s plan must be checked (first step, or its key changed)."""
        return self.verify_plan and plan_key(schedule) != self._agreed

    async def check_plan(self, schedule: StepSchedule, *, step: int = 0) -> None:
        """Check that every rank runs the same plan: all-gather each rank's ``PlanDigest``
        and compare (see ``_digest``). Collective: every rank calls it at the same point.

        Raises:
            PlanError: The ranks disagree; the message names each differing field and the
                ranks on each side.
            StepTimeoutError: Not every rank joined within the timeout.
            PeerError: The all-gather failed (a rank died).
        """
        if self._broken is not None:
            raise self._broken
        mine = self._digest_of(schedule)
        comm = self._comm
        buf = comm.row(mine.encode())
        n = comm.size()
        outs = [torch.empty_like(buf) for _ in range(n)]
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout):
                await work_future(comm.all_gather(outs, buf))
        except TimeoutError:
            # The collective is still posted: this group can no longer be used.
            self._broken = StepTimeoutError(
                f"{self._who} step {step}: the plan check did not complete within"
                f" {self._timeout} s: not every rank joined the all-gather of plan digests"
                f" (over the {n} ranks of the control group). A rank is hung, stopped or"
                " lost, or it did not check at this step: a rank checks at its stage's first"
                " step and when its schedule's plan or hint name changes, so the ranks'"
                " schedules changed at different steps"
            )
            raise self._broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who} step {step}: the plan check (an all-gather over {n} ranks)"
                f" failed: a rank died or the group broke: {e}"
            ) from e
        self.plan_check_seconds = time.perf_counter() - t0
        self.plan_checks += 1
        rows = [PlanDigest.decode(o.tolist(), rank=i) for i, o in enumerate(outs)]
        rows, job_seed = adopt_default_seed(rows)
        if job_seed is not None and mine.seed_default:
            self._adopt_seed(job_seed)
        why = plan_disagreement(rows)
        if why is not None:
            raise PlanError(
                f"{self._who} step {step}: the ranks disagree on the plan; every rank must"
                f" build an equal StepSchedule and use the same policy: {why}"
            )
        self._agreed = plan_key(schedule)

    # Design note: the step check
    # ---------------------------
    # The plan check runs when a rank's plan changes, decided locally: a rank given 3
    # microbatches where its peers got 4 would enter the plan check's all-gather alone, and
    # its peers would wait for its messages, until the watchdog fired (``step_timeout``) with
    # no word of the cause. So every step first posts one small all-gather on the control
    # group, [step, microbatches, plan key hash, train, changed] (``step_row``), on every
    # rank (``verify_plan``; one process: none). A rank whose plan is unchanged does not wait
    # for it: it runs the step, and a watcher beside the step fails it (``abort_step``) the
    # moment the rows differ; a rank whose plan changed waits for the rows first, and runs
    # the plan check (which names the differing fields) only when every rank's plan changed
    # at this step, so that every rank posts it. Every rank reads the same rows, so every
    # rank fails alike, at once, with a ``PlanError`` that names each rank's step,
    # microbatch count and plan. Cost: one all-gather a step, beside the step when the plan
    # is unchanged: a share of a real step's time, not free (measured:
    # BENCHMARKS.md#step-check-cost). ``verify_plan=False`` switches it off with the plan
    # check.

    async def begin_step(self, step: int, schedule: StepSchedule) -> None:
        """Start ``step``'s checks (see the design note): post the step check; when the plan
        changed on this rank, wait for its rows and run the plan check, else watch the rows beside
        the step. The control group's collectives run in the same order on every rank, also
        for a step that failed elsewhere already.

        Raises:
            PlanError: The ranks do not run the same step, or disagree on the plan.
            StepTimeoutError, PeerError: A check could not complete.
        """
        self._watcher = None
        self._agreement_posted = False
        changed = self.plan_changed(schedule)
        posted = self._post_step_check(step, schedule, changed=changed)
        if changed:
            # A new plan on this rank. When every rank has a new plan (its first step, or all
            # changed alike) the plan check runs on every rank and names any field that
            # differs; when only some changed, every rank fails on the step check's rows alike
            # (the others through their watchers), and no rank posts a plan check the others
            # would not match.
            if posted is not None:
                rows = await self._step_check_rows(step, posted)
                if not rows_all_changed_alike(rows):
                    try:
                        step_check_verdict(self._who, step, rows, differ=True)
                    except PlanError as e:
                        # The others run this step until their watchers fail it: what they
                        # send for it meanwhile is dropped on this rank, not taken for a
                        # later step's.
                        self._abort_step(step, e)
                        raise
            await self.check_plan(schedule, step=step)
        elif posted is not None:
            self._watcher = asyncio.ensure_future(self._watch_step_check(step, posted))

    def _post_step_check(
        self, step: int, schedule: StepSchedule, *, changed: bool
    ) -> tuple[list[torch.Tensor], Any] | None:
        """Post this step's step check (see the design note); None when there is none."""
        if not self.verify_plan or self._broken is not None or self._world_size == 1:
            return None
        comm = self._comm
        buf = comm.row(step_row(step, schedule, changed=changed))
        outs = [torch.empty_like(buf) for _ in range(comm.size())]
        try:
            work = comm.all_gather(outs, buf)
        except RuntimeError:
            return None  # the group broke (a lost rank): the step fails anyway
        return outs, work

    async def _step_check_rows(
        self, step: int, posted: tuple[list[torch.Tensor], Any]
    ) -> list[list[int]]:
        """The step check's rows, one per rank of the control group."""
        outs, work = posted
        try:
            async with asyncio.timeout(self._timeout):
                await work_future(work)
        except TimeoutError:
            self._broken = StepTimeoutError(
                f"{self._who} step {step}: the step check did not complete within"
                f" {self._timeout} s: not every rank started this step (a rank is hung,"
                " stopped or lost)"
            )
            raise self._broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who} step {step}: the step check (an all-gather) failed: a rank"
                f" died or the group broke: {e}"
            ) from e
        return [o.tolist() for o in outs]

    async def _watch_step_check(self, step: int, posted: tuple[list[torch.Tensor], Any]) -> None:
        """Beside a running step: fail it when the step check's rows differ. A check that
        could not complete (a rank died, the group broke, it timed out) does not fail the
        step itself: the channel names the lost rank (or the watchdog the silent one), which
        this collective cannot; ``end_step`` raises it only if the step got that far."""
        rows = await self._step_check_rows(step, posted)  # (its errors: not the step's)
        try:
            step_check_verdict(self._who, step, rows)
        except PlanError as e:
            self._abort_step(step, e)
            raise

    # Design note: the end-of-step agreement
    # --------------------------------------
    # The ABORT messages tell a failed step to the ranks of this pipeline while they still
    # run it. They cannot reach a rank that already finished the step (the failure was in
    # the origin's last task), nor the ranks of other pipelines (DP replicas, the other TP
    # indices), which share the step through the user's gradient all-reduce or the TP
    # collectives. So every counted step ends, on every rank, with one small all-reduce
    # (MAX) on the control group: [failed on this rank, global rank]. A rank whose step succeeded
    # waits for it and fails the step with ``PeerStepError`` when another rank's failed
    # (before the tied gradients are reduced, so nothing half-reduced is left); a rank whose
    # step failed posts it and raises at once (no second wait after a timeout or a cancel).
    # A rank whose channel lost a peer or broke (a corrupt message) posts nothing: that job
    # cannot go on (every later step fails; the CLOSE carries the cause), and a collective
    # left posted towards a dead rank can abort the process when its connections close.
    # Posting exactly once per counted step, whatever happened, keeps the group's
    # collectives matched across ranks. Cost: one int64[2] all-reduce per step.

    async def end_step(self, step: int) -> None:
        """The step ran on this rank: raise the step check's verdict (done long before, in
        practice), then post the agreement and wait for it (see the design note).

        Raises:
            PlanError: The step check's rows differ.
            PeerStepError: The step failed on another rank of the job.
            StepTimeoutError, PeerError: The agreement could not complete.
        """
        if self._watcher is not None:
            await self._watcher
        self._agreement_posted = True
        posted = self._post_agreement(failed=False)
        if posted is None:
            return
        buf, work = posted
        try:
            async with asyncio.timeout(self._timeout):
                await work_future(work)
        except TimeoutError:
            self._broken = StepTimeoutError(
                f"{self._who} step {step}: the end-of-step agreement did not complete within"
                f" {self._timeout} s: a rank is hung, stopped or lost, or it did not run"
                " this step"
            )
            raise self._broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who} step {step}: the end-of-step agreement failed (a rank died or"
                f" the group broke): {e}"
            ) from e
        failed, origin = (int(x) for x in buf.tolist())
        if failed:
            cause = "its step failed (see that rank's output)"
            raise PeerStepError(
                f"{self._who}: step {step} failed on global rank {origin}: {cause}; it ended"
                " well here, so its gradients are discarded like every rank's (zero_grad) and"
                " every rank runs the next step",
                step=step,
                origin=origin,
                cause=cause,
            )

    def fail_step(self, *, can_agree: bool) -> None:
        """The step failed on this rank: post its agreement as failed, unless it was posted already
        or the job cannot agree (``can_agree`` False: a lost rank, a broken channel)."""
        if not self._agreement_posted and can_agree:
            self._agreement_posted = True
            self._post_agreement(failed=True)

    async def failed_step_error(self, step: int, e: BaseException) -> PlanError | None:
        """This rank's own step-check ``PlanError`` when ``e`` is a peer's failure of
        ``step`` for that cause (see ``step_check_error``); None otherwise. Call after
        ``fail_step``: a cancelled wait in this call must not skip it."""
        if self._watcher is None or not isinstance(e, PeerStepError):
            return None
        return await step_check_error(self._watcher, e, step)

    def finish_step(self) -> None:
        """The step ended, well or not: stop watching it (a lost rank's collective never
        completes) and retrieve the watcher's outcome (raised by ``end_step``, or moot)."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        if not watcher.done():
            watcher.cancel()
        elif not watcher.cancelled():
            watcher.exception()

    def _post_agreement(self, *, failed: bool) -> tuple[torch.Tensor, Any] | None:
        """Post this step's agreement all-reduce (see the design note); None when switched
        off or when the control group can no longer be used."""
        if not self.agree_steps or self._broken is not None or self._world_size == 1:
            return None
        comm = self._comm
        buf = comm.row([int(failed), self._rank if failed else -1])
        try:
            work = comm.all_reduce_max(buf)
        except RuntimeError:
            return None  # the group broke (a lost rank): the step fails anyway
        return buf, work
