"""A stage's control group: every rank runs the same plan and the same step, and a step that
failed on any rank fails on every rank.

``ControlGroup`` owns a ``DistributedStage``'s collectives on the control group (a gloo
group of every rank of the job, ``StageGroups.control``) and their rules: the plan check
(``check_plan``, the digest in ``_digest``), the step check (its rules in ``_plan_check``)
and the end-of-step agreement that carries it (``end_step`` / ``fail_step``). Its state is
its own: whether the group broke (a collective left posted after a timeout, raised by every
later check), the last plan it agreed on, the running step's row and whether its agreement
was posted, and the plan checks' count and cost. It reaches the group through a
``Collectives`` (``TorchCollectives`` over torch.distributed; a test gives a fake), and
tells the stage what it needs through the callables it is built with, so it can be built
and tested alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._bridges import track, work_future
from .._errors import PeerError, PeerStepError, PlanError, StepTimeoutError
from ..policies import StepSchedule
from ._digest import PlanDigest, adopt_default_seed, plan_disagreement
from ._plan_check import (
    is_step_differs,
    plan_key,
    plan_tag,
    rows_all_changed_alike,
    step_check_error,
    step_check_verdict,
    step_row,
)
from ._pulse import OPEN, describe, no_answer

__all__ = ["Collectives", "ControlGroup", "TorchCollectives"]


class Collectives(Protocol):
    """The control group's collectives, as ``ControlGroup`` uses them: int64 rows, posted
    without waiting (``all_gather`` returns what ``work_future`` awaits)."""

    def size(self) -> int:
        """How many ranks the group has."""

    def row(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device the group's backend needs."""

    def all_gather(self, outs: list[torch.Tensor], row: torch.Tensor) -> Any:
        """Post an all-gather of ``row`` into ``outs`` (one per rank); its ``Work``."""


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


class ControlGroup:
    """The plan check, the step check and the end-of-step agreement of one stage.

    Args:
        collectives: The control group's collectives.
        who: This rank, for messages (``"rank 0 (global 0)"``).
        rank: This process's global rank (what the agreement names as a failure's origin).
        world_size: The job's ranks; with one there is nothing to check or agree on.
        timeout: How long a collective may take (the step timeout; None: no limit).
        verify_plan: Run the plan check and the step check (in the agreement).
        agree_steps: Fail a step that failed on any rank on every rank (the agreement runs
            when either is on).
        digest_of: This rank's ``PlanDigest`` of a schedule.
        adopt_seed: Called with the job's seed when this rank's seed is the default one
            (see ``adopt_default_seed``).
        origin: What the p2p channel knows of a failure, origin first (it may wait a
            moment: ``P2PChannel.origin``), for the error of a collective that broke; None:
            nothing to ask.
        silent: The ranks whose heartbeat stopped (``_pulse.silent_ranks``: it waits a
            moment), for the error of a collective that timed out or broke with no origin
            known; None: nothing to ask.
        notes: The failures other ranks left on the job's board for the given steps
            (``_pulse.notes``), for the error of a collective that timed out; None: nothing
            to ask.
        name: How a message names a global rank ("rank 2 (global 2)").
        blame: Records what a collective's timeout or break found (step, global ranks,
            "timed_out" / "lost" / "failed") for this rank's CLOSE (``P2PChannel.blame_global``),
            so that its peers name the same rank; None: nothing to record.

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
        origin: Callable[[], Awaitable[str | None]] | None = None,
        silent: Callable[[], Awaitable[list[int] | None]] | None = None,
        notes: Callable[[list[int | str]], Awaitable[dict[int, str] | None]] | None = None,
        name: Callable[[int], str] | None = None,
        blame: Callable[[int, list[int], str], None] | None = None,
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
        self._origin = origin
        self._silent = silent
        self._notes = notes
        self._blame = blame if blame is not None else (lambda step, ranks, how: None)
        self._name = name if name is not None else (lambda g: f"global rank {g}")
        self.plan_checks = 0
        self.plan_check_seconds = 0.0
        self._broken: BaseException | None = None  # a collective was left posted
        self._agreed: tuple[object, ...] | None = None  # the plan key of the last plan check
        self._agreement_posted = False  # this step's agreement (once, on every rank)
        self._row: list[int] = [0, 0, 0, 0, 0]  # this step's step-check row
        self._schedule: StepSchedule | None = None  # this step's (for a new plan's check)
        self._failed_post: tuple[list[torch.Tensor], Any] | None = None  # fail_step's post

    @property
    def _per_step(self) -> bool:
        """Whether every step ends with the agreement (the step check rides on it)."""
        return self.verify_plan or self.agree_steps

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
            head = await self._timed_out(step, "in the plan check")
            self._broken = StepTimeoutError(
                f"{head}\nNot every rank joined the all-gather of plan digests (over the {n}"
                " ranks of the control group): a rank is hung, stopped or lost, or it did not"
                " check at this step: a rank checks before its stage's first step, and after a"
                " step whose agreement shows that every rank's plan or hint name changed alike",
                collective="the plan check",
            )
            raise self._broken from None
        except RuntimeError as e:
            what = f"the plan check (an all-gather over {n} ranks)"
            raise PeerError(await self._broke(step, what, e)) from e
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

    # Design note: the step check, folded into the end-of-step agreement
    # -------------------------------------------------------------------
    # What it protects against: ranks that run different steps under one step number (a
    # rank given 3 microbatches where its peers got 4, another hint, ``train=`` or step
    # number). Such a step can hang (a rank waits for a message its neighbour's plan never
    # sends), or, when every pipeline is consistent within itself (DP replicas given other
    # counts), end "well" with gradients that do not belong together. The plan check (all
    # fields, named) runs when a rank's plan changes, but that is decided locally: a rank whose
    # plan changed alone must not post it (its peers would not match it).
    #
    # How, at one collective a step: every counted step ends, on every rank, with the
    # agreement (see its note below), an all-gather of ``step_row`` + [failed, global rank].
    # Every rank reads the same rows, so every rank decides alike: rows that differ in step,
    # microbatches, plan or train fail the step with the step check's ``StepDiffersError``
    # naming each rank's side, before the tied gradients are reduced (so before any optimizer);
    # rows that agree, where every rank's plan changed, run the plan check next, on every rank
    # (a new plan is checked once it is known to be every rank's). A stage's first step is
    # checked before it runs (every rank's plan is new there, so every rank posts it): that
    # check also gives the executors the job's seed.
    #
    # Seen at the end, a mismatch would leave a rank waiting for a message that never comes
    # until the watchdog: so each message carries the sender's plan tag (``plan_tag``, given to
    # ``P2PChannel.at_step``), and the first message of another plan fails the step at once
    # on the rank that receives it (``StepDiffersError``, see the channel's ``Inlet``); its
    # ABORT (``FailureKind.STEP_DIFFERS``) fails it on every rank of the pipeline, and each of
    # them then waits for the agreement's rows (``failed_step_error``) to raise the same
    # ``StepDiffersError``, naming every rank's row. Two neighbours whose plans differ exchange
    # a message in the step (the downstream one needs a forward), so a pipeline never hangs on
    # it. A step number that differs along a pipeline is found by the stage loop: a message
    # of a step that this rank passed without running it is a ``ProtocolError`` that breaks
    # its stage at once; between pipelines, the rows name it.
    # Cost: nothing beside the agreement (its rows are 7 int64 instead of 2) and one int64
    # more in each header; what the all-gather posted beside every step cost:
    # BENCHMARKS.md#step-check-cost. ``verify_plan=False`` switches the comparison off with
    # the plan check (the agreement still runs).

    async def begin_step(self, step: int, schedule: StepSchedule) -> None:
        """Start ``step``'s checks (see the design note): the plan check at a stage's first
        step (every rank's plan is new); this step's row for the agreement.

        Raises:
            PlanError: The ranks disagree on the plan.
            StepTimeoutError, PeerError: The plan check could not complete.
        """
        self._agreement_posted = False
        self._failed_post = None
        self._schedule = schedule
        changed = self.plan_changed(schedule)
        self._row = (
            step_row(step, schedule, changed=changed) if self.verify_plan else [0, 0, 0, 0, 0]
        )
        if changed and self._agreed is None:
            await self.check_plan(schedule, step=step)

    def plan_tag(self, schedule: StepSchedule) -> int:
        """The tag of ``schedule``'s plan that this step's messages carry (0: none, when the
        plans are not compared)."""
        return plan_tag(schedule) if self.verify_plan else 0

    async def _agreement_rows(
        self, step: int, posted: tuple[list[torch.Tensor], Any]
    ) -> list[list[int]]:
        """The agreement's rows, one per rank of the control group.

        Raises:
            StepTimeoutError: Not every rank posted within the timeout (the group is broken).
            PeerError: The all-gather failed (a rank died or the group broke).
        """
        outs, work = posted
        try:
            async with asyncio.timeout(self._timeout):
                await work_future(work)
        except TimeoutError:
            # The collective is still posted: this group can no longer be used.
            head = await self._timed_out(step, "in the end-of-step agreement")
            self._broken = StepTimeoutError(
                f"{head}\nNot every rank posted the agreement: a rank is hung, stopped or lost,"
                " or it did not run this step",
                collective="the end-of-step agreement",
            )
            raise self._broken from None
        except RuntimeError as e:
            raise PeerError(await self._broke(step, "the end-of-step agreement", e)) from e
        return [o.tolist() for o in outs]

    async def _timed_out(self, step: int, where: str) -> str:
        """The first line of a collective's timeout: the failure the p2p channel knows of
        (a peer's CLOSE: it failed, left or was lost), else a failure another rank left on
        the job's board for this step or its stage's opening, else the ranks whose heartbeat
        stopped (see ``_pulse``); asked at the same time."""
        head = f"{self._who} step {step}: timed out after {self._timeout} s {where}"
        origin, silent, notes = await self._ask(step)
        if origin is not None:
            return f"{head}: {origin}"
        if notes:
            said = "; ".join(
                f"{self._name(g)} failed by itself"
                f" {'opening its stage' if k == OPEN else f'at step {k}'}: {text}"
                for g, (k, text) in sorted(notes.items())
            )
            self._blame(step, sorted(notes), "failed")
            return f"{head}: {said}"
        if silent:
            self._blame(step, silent, "timed_out")
            return f"{head}: {describe(silent, self._name, broke=False)}"
        if silent is None:  # no pulse, or its store did not answer
            return (
                f"{head}: a rank is hung, stopped or lost (the job's heartbeats could not be read)"
            )
        return f"{head}: a rank is hung, stopped or lost (no rank's heartbeat stopped)"

    async def _ask(
        self, step: int
    ) -> tuple[str | None, list[int] | None, dict[int, tuple[int | str, str]]]:
        """What the p2p channel knows of a failure, the ranks whose heartbeat stopped, and
        the failures other ranks left for ``step`` or their opening (each waits a moment:
        asked at the same time)."""
        origin_ask = self._origin() if self._origin is not None else no_answer()
        silent_ask = self._silent() if self._silent is not None else no_answer()
        origin, silent = await asyncio.gather(origin_ask, silent_ask)
        # The board last: a rank that failed by itself at about this moment has posted by now.
        at_step = await self._notes([step]) if self._notes is not None else None
        at_open = await self._notes([OPEN]) if self._notes is not None else None
        notes: dict[int, tuple[int | str, str]] = {g: (OPEN, t) for g, t in (at_open or {}).items()}
        notes.update({g: (step, t) for g, t in (at_step or {}).items()})
        return origin, silent, notes

    async def _broke(self, step: int, what: str, e: RuntimeError) -> str:
        """The error of a collective that broke: the rank at fault first, as the p2p
        channel knows it (gloo's text names an address, never a rank), else the ranks whose
        heartbeat stopped (asked at the same time: a rank far from the lost one may hear of
        it from no neighbour), gloo's text last."""
        origin, silent, _ = await self._ask(step)
        if origin is None and silent:
            origin = describe(silent, self._name, broke=True)
            self._blame(step, silent, "lost")
        if origin is None:
            return f"{self._who} step {step}: {what} failed: a rank died or the group broke: {e}"
        return f"{self._who} step {step}: {origin}; {what} failed with it: {e}"

    # Design note: the end-of-step agreement
    # --------------------------------------
    # The ABORT messages tell a failed step to the ranks of this pipeline while they still
    # run it. They cannot reach a rank that already finished the step (the failure was in
    # the origin's last task), nor the ranks of other pipelines (DP replicas, the other TP
    # indices), which share the step through the user's gradient all-reduce or the TP
    # collectives. So every counted step ends, on every rank, with one small all-gather on
    # the control group: the step check's row (above), whether the step failed on this rank,
    # and this global rank. A rank whose step succeeded waits for it and fails the step with
    # ``PeerStepError`` when another rank's failed, naming the highest such rank (before the
    # tied gradients are reduced, so nothing half-reduced is left); a rank whose step failed
    # posts it and raises at once (no second wait after a timeout or a cancel), unless the
    # cause was the step check's (see ``failed_step_error``). A rank whose channel lost a
    # peer or broke (a corrupt message) posts nothing: that job cannot go on (every later
    # step fails; the CLOSE carries the cause), and a collective left posted towards a dead
    # rank can abort the process when its connections close. Posting exactly once per
    # counted step, whatever happened, keeps the group's collectives matched across ranks.
    # Cost: one all-gather of int64[7] per step.

    async def end_step(self, step: int) -> None:
        """The step ran on this rank: post the agreement and wait for it (see the design
        notes); when every rank's plan changed alike, the plan check follows.

        Raises:
            PlanError: The rows differ (``StepDiffersError``), or the new plan's check failed.
            PeerStepError: The step failed on another rank of the job.
            StepTimeoutError, PeerError: The agreement could not complete.
        """
        self._agreement_posted = True
        posted = self._post_agreement(failed=False)
        if posted is None:
            return
        rows = await self._agreement_rows(step, posted)
        if self.verify_plan:
            step_check_verdict(self._who, step, rows)
        failed = [r[6] for r in rows if r[5]]
        if failed and self.agree_steps:
            origin = max(failed)
            cause = "its step failed (see that rank's output)"
            raise PeerStepError(
                f"{self._who}: step {step} failed on global rank {origin}: {cause}; it ended"
                " well here, so its gradients are discarded like every rank's (zero_grad) and"
                " every rank runs the next step",
                step=step,
                origin=origin,
                cause=cause,
            )
        sched = self._schedule
        if sched is not None and rows_all_changed_alike(rows) and self.plan_changed(sched):
            await self.check_plan(sched, step=step)  # (a first step's ran before it)

    def fail_step(self, *, can_agree: bool) -> None:
        """The step failed on this rank: post its agreement as failed, unless it was posted already
        or the job cannot agree (``can_agree`` False: a lost rank, a broken channel)."""
        if not self._agreement_posted and can_agree:
            self._agreement_posted = True
            self._failed_post = self._post_agreement(failed=True)

    async def failed_step_error(self, step: int, e: BaseException) -> PlanError | None:
        """The step check's ``StepDiffersError`` naming every rank's row when ``e`` failed
        ``step`` for that cause (see ``step_check_error``): read from the agreement this rank
        posted in ``fail_step``; None otherwise. Call after ``fail_step``: a cancelled wait
        in this call must not skip it."""
        posted = self._failed_post
        if posted is None or not self.verify_plan or not is_step_differs(e, step):
            return None
        verdict = asyncio.ensure_future(self._rows_verdict(step, posted))
        verdict.add_done_callback(_retrieve)
        return await step_check_error(verdict, e, step)

    async def _rows_verdict(self, step: int, posted: tuple[list[torch.Tensor], Any]) -> None:
        """Raise the step check's verdict on the agreement's rows (nothing when they agree)."""
        step_check_verdict(self._who, step, await self._agreement_rows(step, posted))

    def finish_step(self) -> None:
        """The step ended, well or not: forget its agreement."""
        self._failed_post = None
        self._schedule = None

    def _post_agreement(self, *, failed: bool) -> tuple[list[torch.Tensor], Any] | None:
        """Post this step's agreement all-gather (see the design notes); None when switched
        off or when the control group can no longer be used."""
        if not self._per_step or self._broken is not None or self._world_size == 1:
            return None
        comm = self._comm
        buf = comm.row([*self._row, int(failed), self._rank])
        outs = [torch.empty_like(buf) for _ in range(comm.size())]
        try:
            work = comm.all_gather(outs, buf)
        except RuntimeError:
            return None  # the group broke (a lost rank): the step fails anyway
        track(work)  # (a failed step's may be awaited by no one: the exit waits for it)
        return outs, work


def _retrieve(fut: asyncio.Future[None]) -> None:
    """Retrieve a verdict's outcome (an abandoned wait must not warn)."""
    if not fut.cancelled():
        fut.exception()
