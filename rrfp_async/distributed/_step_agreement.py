"""``DistributedStage``'s end-of-step agreement: a step that failed on any rank of the job
fails on every rank (see the design note)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import work_future
from .._errors import PeerError, PeerStepError, StepTimeoutError
from ._stage_fields import StageFields

__all__ = ["StepAgreement"]


class StepAgreement(StageFields):
    """``DistributedStage``'s end-of-step agreement (a part: see ``_stage_fields``)."""

    # Design note: the end-of-step agreement
    # --------------------------------------
    # The ABORT messages tell a failed step to the ranks of this pipeline while they still
    # run it. They cannot reach a rank that already finished the step (the failure was in
    # the origin's last task), nor the ranks of other pipelines (DP replicas, the other TP
    # indices), which share the step through the user's gradient all-reduce or the TP
    # collectives. So every counted step ends, on every rank, with one small all-reduce
    # (MAX) on the control group: [failed here, global rank]. A rank whose step succeeded
    # waits for it and fails the step with ``PeerStepError`` when another rank's failed
    # (before the tied gradients are reduced, so nothing half-reduced is left); a rank whose
    # step failed posts it and raises at once (no second wait after a timeout or a cancel).
    # A rank whose channel lost a peer or broke (a corrupt message) posts nothing: that job
    # cannot go on (every later step fails; the CLOSE carries the cause), and a collective
    # left posted towards a dead rank can abort the process when its connections close.
    # Posting exactly once per counted step, whatever happened, keeps the group's
    # collectives matched across ranks. Cost: one int64[2] all-reduce per step.

    def _post_agreement(self, *, failed: bool) -> tuple[torch.Tensor, Any] | None:
        """Post this step's agreement all-reduce (see the design note); None when switched
        off or when the control group can no longer be used."""
        if not self.agree_steps or self._control_broken is not None or self.layout.world_size == 1:
            return None
        group = self.groups.control
        buf = torch.tensor([int(failed), self.layout.rank if failed else -1], dtype=torch.int64)
        if group is None and "gloo" not in str(dist.get_backend()):
            buf = buf.to(self._device)
        try:
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)
        except RuntimeError:
            return None  # the group broke (a lost rank): the step fails anyway
        return buf, work

    async def _agree(self, step: int) -> None:
        """Wait for this step's agreement; raise ``PeerStepError`` when a rank's step failed."""
        posted = self._post_agreement(failed=False)
        if posted is None:
            return
        buf, work = posted
        try:
            async with asyncio.timeout(self.step_timeout):
                await work_future(work)
        except TimeoutError:
            self._control_broken = StepTimeoutError(
                f"{self._who()} step {step}: the end-of-step agreement did not complete within"
                f" {self.step_timeout} s: a rank is hung, stopped or lost, or it did not run"
                " this step"
            )
            raise self._control_broken from None
        except RuntimeError as e:
            raise PeerError(
                f"{self._who()} step {step}: the end-of-step agreement failed (a rank died or"
                f" the group broke): {e}"
            ) from e
        failed, origin = (int(x) for x in buf.tolist())
        if failed:
            cause = "its step failed (see that rank's output)"
            raise PeerStepError(
                f"{self._who()}: step {step} failed on global rank {origin}: {cause}; it ended"
                " well here, so its gradients are discarded like every rank's (zero_grad) and"
                " every rank runs the next step",
                step=step,
                origin=origin,
                cause=cause,
            )
