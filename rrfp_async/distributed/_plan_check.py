"""``DistributedStage``'s plan check and step check: every rank runs the same plan and the
same step.

The plan check (``check_plan``, the digest in ``_digest``) all-gathers each rank's
``PlanDigest`` over the control group at a stage's first step and whenever its plan
changes, and names every field on which the ranks differ; the step check (below) catches,
at every step, ranks given different steps (another microbatch count, train vs eval, step
number) before any of them waits for the others' messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import work_future
from .._errors import PeerError, PeerStepError, PlanError, StepTimeoutError
from ..policies import StepSchedule
from ._digest import PlanDigest, adopt_default_seed, plan_disagreement
from ._digest import _ranks as ranks_have
from ._executor_hooks import executor_seed
from ._stage_fields import StageFields
from ._ties import ties_digest

__all__ = ["STEP_DIFFERS", "PlanCheck", "step_check_error"]

#: What the step check's ``PlanError`` says after "step N:" (``step_check_error`` reads it
#: in a peer's ABORT).
STEP_DIFFERS = "the ranks do not run the same step"


class PlanCheck(StageFields):
    """``DistributedStage``'s plan and step checks (a part: see ``_stage_fields``)."""

    def _key(self, schedule: StepSchedule) -> tuple[object, ...]:
        """What decides whether a step's plan must be checked again (see the design note)."""
        p = schedule.plan
        return (
            p.topology,
            p.microbatches,
            p.split_backward,
            p.ordered_weights,
            p.forward_only,
            schedule.hint_name,
        )

    async def check_plan(self, schedule: StepSchedule | None = None, *, step: int = 0) -> None:
        """Check that every rank runs the same plan: all-gather each rank's ``PlanDigest``
        over the control group and compare (see the design note). Collective: every rank
        calls it at the same point; ``run_step`` does, at the first step and when the plan
        changes, so call it yourself only to take its cost out of a timed step.

        Args:
            schedule: The schedule to check (default: the stage's).
            step: The step number, for messages.

        Raises:
            PlanError: The ranks disagree; the message names each differing field and the
                ranks on each side.
            StepTimeoutError: Not every rank joined within ``step_timeout``.
            PeerError: The all-gather failed (a rank died).
        """
        if self._control_broken is not None:
            raise self._control_broken
        sched = schedule if schedule is not None else self.stage.schedule
        seed, seed_default = executor_seed(self.stage.executor)
        mine = PlanDigest.of(
            sched,
            policy=self.stage.policy_name,
            layout=self.layout,
            max_message_bytes=self.max_message_bytes,
            ties=ties_digest(self._tie_spec) + ("" if self.check_ties else "|unchecked"),
            rng_seed=seed,
            seed_default=seed_default,
        )
        group = self.groups.control
        on_cpu = group is not None or "gloo" in str(dist.get_backend())
        buf = torch.tensor(mine.encode(), dtype=torch.int64)
        if not on_cpu:
            buf = buf.to(self._device)
        n = dist.get_world_size(group)
        outs = [torch.empty_like(buf) for _ in range(n)]
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.step_timeout):
                await work_future(dist.all_gather(outs, buf, group=group, async_op=True))
        except TimeoutError:
            # The collective is still posted: this group can no longer be used.
            self._control_broken = StepTimeoutError(
                f"{self._who()} step {step}: the plan check did not complete within"
                f" {self.step_timeout} s: not every rank joined the all-gather of plan digests"
                f" (over the {n} ranks of the control group). A rank is hung, stopped or"
                " lost, or it did not check at this step: a rank checks at its stage's first"
                " step and when its schedule's plan or hint name changes, so the ranks'"
                " schedules changed at different steps"
            )
            raise self._control_broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who()} step {step}: the plan check (an all-gather over {n} ranks)"
                f" failed: a rank died or the group broke: {e}"
            ) from e
        self.plan_check_seconds = time.perf_counter() - t0
        self.plan_checks += 1
        rows = [PlanDigest.decode(o.tolist(), rank=i) for i, o in enumerate(outs)]
        rows, job_seed = adopt_default_seed(rows)
        if job_seed is not None and mine.seed_default:
            self.stage.executor.rng_seed = job_seed  # type: ignore[attr-defined]
        why = plan_disagreement(rows)
        if why is not None:
            raise PlanError(
                f"{self._who()} step {step}: the ranks disagree on the plan; every rank must"
                f" build an equal StepSchedule and use the same policy: {why}"
            )
        self._agreed = self._key(sched)

    # Design note: the step check
    # ---------------------------
    # The plan check runs when a rank's plan changes, decided locally: a rank given 3
    # microbatches where its peers got 4 would enter the plan check's all-gather alone, and
    # its peers would wait for its messages, until the watchdog fired (step_timeout, 300 s
    # by default) with no word of the cause. So every step first posts one small
    # all-gather on the control group, [step, microbatches, plan key hash, train, changed],
    # on every rank (``verify_plan``; one process: none). A rank whose plan is unchanged
    # does not wait for it: it runs the step, and a watcher beside the step fails it
    # (``step_aborted``) the moment the rows differ; a rank whose plan changed waits for the
    # rows first, and runs the plan check (which names the differing fields) only when
    # every rank's plan changed at this step, so that every rank posts it. Every rank reads the
    # same rows, so every rank fails alike, at once, with a ``PlanError`` that names each
    # rank's step, microbatch count and plan. Cost: one all-gather a step, beside the step
    # when the plan is unchanged; measured 1.4-1.7 ms a step (median of paired blocks) on
    # 2 gloo processes of this 2-core machine with steps of no compute (11.4 -> 12.9 ms,
    # ``python scripts/step_check_cost.py``, 2026-12-03): a share of a real step's time,
    # not free. ``verify_plan=False`` switches it off with the plan check.

    def _post_step_check(
        self, step: int, schedule: StepSchedule, *, changed: bool
    ) -> tuple[Any, Any] | None:
        """Post this step's step check (see the design note); None when there is none."""
        if not self.verify_plan or self._control_broken is not None or self.layout.world_size == 1:
            return None
        p = schedule.plan
        key = hashlib.blake2b(repr(self._key(schedule)).encode(), digest_size=8).digest()
        key63 = int.from_bytes(key, "little") >> 1
        row = [step, p.microbatches, key63, int(not p.forward_only), int(changed)]
        group = self.groups.control
        buf = torch.tensor(row, dtype=torch.int64)
        if group is None and "gloo" not in str(dist.get_backend()):
            buf = buf.to(self._device)
        outs = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
        try:
            work = dist.all_gather(outs, buf, group=group, async_op=True)
        except RuntimeError:
            return None  # the group broke (a lost rank): the step fails anyway
        return outs, work

    async def _step_check_rows(self, step: int, posted: tuple[Any, Any]) -> list[list[int]]:
        """The step check's rows, one per rank of the control group."""
        outs, work = posted
        try:
            async with asyncio.timeout(self.step_timeout):
                await work_future(work)
        except TimeoutError:
            self._control_broken = StepTimeoutError(
                f"{self._who()} step {step}: the step check did not complete within"
                f" {self.step_timeout} s: not every rank started this step (a rank is hung,"
                " stopped or lost)"
            )
            raise self._control_broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who()} step {step}: the step check (an all-gather) failed: a rank"
                f" died or the group broke: {e}"
            ) from e
        return [o.tolist() for o in outs]

    def _step_check_verdict(
        self, step: int, rows: list[list[int]], *, differ: bool = False
    ) -> None:
        """Raise a ``PlanError`` naming every rank's row when the rows differ (or when
        ``differ``: the caller knows they do) in step, microbatches, plan or train."""
        if not differ and all(r[:4] == rows[0][:4] for r in rows):
            return
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, r in enumerate(rows):
            groups.setdefault(tuple(r[:4]), []).append(rank)
        parts = [
            f"{ranks_have(ranks)} step {r[0]}, {r[1]} microbatches,"
            f" {'training' if r[3] else 'forward-only'}, plan #{r[2] & 0xFFFFFFFF:08x}"
            for r, ranks in sorted(groups.items(), key=lambda kv: kv[1][0])
        ]
        raise PlanError(
            f"{self._who()} step {step}: {STEP_DIFFERS}: "
            + "; ".join(parts)
            + ". Every rank must give each step the same number of microbatches (and the same"
            " schedule, train= and step number); a rank's data loader that ran out early or"
            " yields other batch counts is the usual cause"
        )

    async def _watch_step_check(self, step: int, posted: tuple[Any, Any]) -> None:
        """Beside a running step: fail it when the step check's rows differ. A check that
        could not complete (a rank died, the group broke, it timed out) does not fail the
        step itself: the channel names the lost rank (or the watchdog the silent one), which
        this collective cannot; ``run_step`` raises it only if the step got that far."""
        rows = await self._step_check_rows(step, posted)  # (its errors: not the step's)
        try:
            self._step_check_verdict(step, rows)
        except PlanError as e:
            self.stage.step_aborted(step, e)
            raise


async def step_check_error(
    watcher: asyncio.Future[None], e: PeerStepError, step: int
) -> PlanError | None:
    """This rank's own step-check ``PlanError`` when a peer failed ``step`` with one (``e``).

    The rank that reads the step check's differing rows first fails the step and tells the
    others (an ABORT); one whose watcher had not read them yet would otherwise fail it with
    that ``PeerStepError``, not the ``PlanError`` its peers raise. The origin read the rows,
    so every rank posted the all-gather and its rows are on their way here: wait for them
    (bounded like every step check, by ``step_timeout``) so that every rank fails alike.
    Only for that cause: after any other error of the origin (a ``PlanError`` of a task
    included) a rank that has not started the step yet may never post its row, so nothing is
    waited for. None when the cause is another or the rows agree here.
    """
    cause = e.cause
    if not (cause.startswith(f"{PlanError.__name__}:") and f"step {step}: {STEP_DIFFERS}" in cause):
        return None
    try:
        await asyncio.shield(watcher)
    except PlanError as verdict:
        return verdict
    except Exception:  # the check could not complete: keep the peer's word
        return None
    return None
