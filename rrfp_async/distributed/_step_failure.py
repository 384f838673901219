"""``DistributedStage``'s failed steps: telling the peers, and naming the rank at fault.

Design note: naming a lost rank
-------------------------------
A killed rank breaks its TCP connections: its neighbours' channel threads fail at once and
the step fails with ``PeerError`` "rank 0 lost rank 1 (global 1)". A stopped (hung) rank
breaks nothing: the neighbours wait until the step watchdog fires (``step_timeout``, 30 s
by default), and the ``StepTimeoutError`` then opens with the ranks whose messages of the
step did not arrive (the plan says how many each must send; the channel counts what came).
A failing rank's CLOSE carries its cause, so a rank further away names the lost rank too.

Telling a failed step to the others (the ABORT, once per step) is half of "a step fails
everywhere or nowhere" (see ``_dist_stage``); the end-of-step agreement
(``_step_agreement``) is the other half.
"""

from __future__ import annotations

import asyncio
import collections

from .._errors import ChannelError, PeerError, PeerStepError, StepTimeoutError, exception_notes
from ._stage_fields import StageFields

__all__ = ["FailureTelling"]


class FailureTelling(StageFields):
    """``DistributedStage``'s failed-step reports (a part: see ``_stage_fields``)."""

    def _tell_failure(self, step: int, e: BaseException) -> None:
        """Step ``step`` failed here with ``e``: complete its message, tell the peers. Runs
        once per step: as the stage's ``on_failure`` hook when the stage still waits for a
        running task (so that the peers learn it at once), else when ``run_step`` raises."""
        self._told = step
        if isinstance(e, StepTimeoutError):
            self._explain_timeout(e, step)
            self.dump_state(f"step {step} timed out")
        elif isinstance(e, ChannelError) and not isinstance(e, PeerStepError):
            self._add_peer_failures(e)
        self._announce(step, e)

    def _announce(self, step: int, e: BaseException) -> None:
        """Tell every rank of the pipeline that ``step`` failed here (the channel's ABORT:
        see ``P2PChannel``'s design note), so that theirs fails too, at once. A lost peer
        is told by the CLOSE instead (it carries the cause; the channel is broken for good):
        deciding here, not by the channel's state, keeps that choice free of races with the
        listener thread that reports the loss."""
        if isinstance(e, PeerError) and not isinstance(e, PeerStepError):
            return
        if self.decisions is not None:  # a TP leader tells its followers (one-way channel)
            origin = e.origin if isinstance(e, PeerStepError) else self.layout.rank
            self.decisions.abort(step, origin)
        if isinstance(e, PeerStepError):  # failed elsewhere: the channel passed it on
            self.channel.abort(step, e.cause, origin=e.origin)
            return
        if isinstance(e, asyncio.CancelledError):
            cause = "the step was cancelled there (asyncio.CancelledError: a timeout or a cancel"
            cause += " scope of its caller)"
        else:
            text = str(e).strip()
            first = text.splitlines()[0] if text else ""
            cause = f"{type(e).__name__}: {first}" if first else type(e).__name__
            # The notes (add_note: the task, and the fix where one is known) travel too.
            # Not the state dump (``Stage``'s "state of rank ..." note): it stays local.
            notes = [
                str(n)
                for n in exception_notes(e)
                if str(n).strip() and not str(n).startswith("state of rank ")
            ]
            if notes:
                cause += " [" + "; ".join(notes) + "]"
        self.channel.abort(step, cause)

    def _explain_timeout(self, e: StepTimeoutError, step: int) -> None:
        """Open the watchdog's message with what the step waited for: the ranks whose
        messages of this step did not all arrive (the plan says how many each sends), or
        the TP decision group; tell the channel, so the peers learn it from the CLOSE."""
        prog = self.stage.schedule.program(self.layout.pp_rank)
        expected = collections.Counter(r for r in prog.src_rank if r >= 0)
        got = self.channel.arrivals(step)
        missing = {r: n - got.get(r, 0) for r, n in sorted(expected.items()) if got.get(r, 0) < n}
        peers = self.layout.pipeline_peers()
        head = f"{self._who()} step {step}: timed out after {self.step_timeout} s"
        if missing:
            names = ", ".join(
                f"rank {r} (global {peers[r]}; {k} of its {expected[r]} messages of the step"
                " missing)"
                for r, k in missing.items()
            )
            head += (
                f" waiting for {names}: hung, stopped or lost (or waiting itself for another rank)"
            )
            self.channel.blame(step, missing)
        elif self.decisions is not None and self.decisions.waiting is not None:
            head += f" waiting for {self.decisions.waiting}"
        else:
            head += (
                ": every message of the step arrived; it is stuck in this rank's own work"
                " (a task that does not return, or the policy)"
            )
        failures = list(self.channel.peer_failures().values())
        if failures:
            head += "; " + "; ".join(failures)
        e.args = (f"{head}\n{e.args[0] if e.args else ''}", *e.args[1:])

    def _add_peer_failures(self, e: ChannelError) -> None:
        """Append why failed peers failed (the cause their CLOSE carried) to ``e``."""
        text = str(e)
        extra = [t for t in self.channel.peer_failures().values() if t not in text]
        if extra and e.args:
            e.args = (f"{e.args[0]}; " + "; ".join(extra), *e.args[1:])
