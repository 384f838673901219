"""A stage's failed steps: telling the peers, and naming the rank at fault.

Design note: naming a lost rank
-------------------------------
A killed rank breaks its TCP connections: its neighbours' channel threads fail at once and
the step fails with ``PeerError`` "rank 0 lost rank 1 (global 1)". A stopped (hung) rank
breaks nothing: the neighbours wait until the step watchdog fires (``step_timeout``), and
the ``StepTimeoutError`` then opens with the ranks whose messages of the step did not arrive
(the plan says how many each must send; the channel counts what came). A failing rank's
CLOSE carries its cause, so a rank further away names the lost rank too.

A policy that never returns stops its rank as a hang would, and every rank's watchdog fires
at about the same moment. The stuck rank's alone knows the cause (it fired in the policy's
turn: ``StepTimeoutError.policy``): its message opens with the policy, its ABORT carries
``FailureKind.POLICY`` (sent even when a peer's ABORT failed its step first, passed on once
by every rank) and its CLOSE the cause ``POLICY``. A rank that timed out waiting for others
waits a moment for that ABORT (``name_root``) and opens its message with the stuck
policy's rank, then says whom it waited for. A stopped rank further away, one that stopped
after its last message, and a rank that failed by itself where no message tells it are
found on the job's board (``_pulse``), asked at the same time; a rank that fails the step
for a waiter's ABORT (``FailureKind.TIMEOUT``) asks the same questions.

Telling a failed step to the others (the ABORT, once per step) is half of "a step fails
everywhere or nowhere" (invariant 6; see ``_dist_stage``); the end-of-step agreement
(``_control_group``) is the other half.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol

from .._errors import (
    ChannelError,
    FailureKind,
    PeerError,
    PeerStepError,
    StateNote,
    StepTimeoutError,
    exception_notes,
)
from ..policies import StepSchedule
from ._layout import name_among
from ._plan_check import failure_kind
from ._pulse import WINDOW_S, describe, no_answer

__all__ = [
    "FailureChannel",
    "FailureDecisions",
    "FailureReporter",
    "failed_by_itself",
    "failure_cause",
]

POLICY_NEWS_WAIT = 1.0
"""Seconds a rank whose step timed out waiting for other ranks waits for a stuck policy's
ABORT before it raises (at most half the step's timeout): the stuck rank's watchdog fires
a moment after its own (measured: 20 ms on 4 CPU ranks)."""


class FailureChannel(Protocol):
    """What ``FailureReporter`` needs of the p2p channel (``P2PChannel``)."""

    def abort(self, step: int, cause: str, *, origin: int | None = None, kind: int = 0) -> object:
        """Send the step's ABORT down every edge (``kind``: a ``FailureKind`` code)."""

    def arrivals(self, step: int) -> Mapping[int, int]:
        """Pipeline rank -> messages of ``step`` that arrived from it."""

    def blame(self, step: int, ranks: Iterable[int]) -> None:
        """Tell the CLOSE which ranks' messages of ``step`` did not arrive."""

    def blame_global(self, step: int, ranks: Iterable[int], how: str) -> None:
        """Tell the CLOSE the root found (global ranks; ``how``: "timed_out", "failed")."""

    def peer_failures(self) -> Mapping[int, str]:
        """Why failed peers failed (what their CLOSE carried)."""

    def policy_stuck(self, step: int) -> None:
        """Tell the CLOSE that this rank's policy did not return a decision at ``step``."""

    async def stuck_policy(self, step: int, wait: float) -> tuple[int, str] | None:
        """The global rank whose policy did not return at ``step``, and its ABORT's cause."""


class FailureDecisions(Protocol):
    """What ``FailureReporter`` needs of the TP decision channel (``DecisionChannel``)."""

    @property
    def waiting(self) -> str | None:
        """What a follower waits for, or None."""

    def abort(self, step: int, origin: int) -> None:
        """A leader tells its followers that ``step`` failed."""


class FailureReporter:
    """Completes a failed step's message and tells the peers, once per step.

    Args:
        channel: The p2p channel (the ABORT, what arrived, the peers' failures).
        decisions: The TP decision channel (None without TP).
        who: This rank, for messages (``"rank 0 (global 0)"``).
        rank: This process's global rank (a failure's origin).
        pp_rank: This process's pipeline rank (its program in the schedule).
        peers: Pipeline rank -> global rank, of this pipeline.
        step_timeout: The watchdog's limit, for the timeout's message.
        schedule: The stage's current schedule (what the step expects to receive).
        dump: Writes the stage's state (``DistributedStage.dump_state``), on a timeout.
        silent: The global ranks whose heartbeat stopped (``_pulse.silent_ranks``: it waits
            a moment), asked after a timeout; None: nothing to ask.
        notes: The failures other ranks left on the job's board for the given steps
            (``_pulse.notes``), asked after a timeout; None: nothing to ask.
    """

    def __init__(
        self,
        channel: FailureChannel,
        decisions: FailureDecisions | None,
        *,
        who: str,
        rank: int,
        pp_rank: int,
        peers: Mapping[int, int],
        step_timeout: float | None,
        schedule: Callable[[], StepSchedule],
        dump: Callable[[str], object],
        silent: Callable[[], Awaitable[list[int] | None]] | None = None,
        notes: Callable[[list[int | str]], Awaitable[dict[int, str] | None]] | None = None,
    ) -> None:
        self._channel = channel
        self._decisions = decisions
        self._who = who
        self._rank = rank
        self._pp_rank = pp_rank
        self._peers = dict(peers)
        self._step_timeout = step_timeout
        self._schedule = schedule
        self._dump = dump
        self._silent = silent
        self._notes = notes
        self._told: int | None = None  # the last step whose failure was told
        # step -> the ranks a timed-out step waited for (their names, their global ranks;
        # "" and none when every message had come)
        self._waited: dict[int, tuple[str, frozenset[int]]] = {}

    def told(self, step: int) -> bool:
        """Whether ``step``'s failure was told already."""
        return self._told == step

    def tell_once(self, step: int, e: BaseException) -> None:
        """``tell``, unless ``step``'s failure was told already (by the stage loop's
        ``on_failure`` hook, while it waited for a running task)."""
        if self._told != step:
            self.tell(step, e)

    def tell(self, step: int, e: BaseException) -> None:
        """Step ``step`` failed on this rank with ``e``: complete its message, tell the peers. Runs
        once per step: as the stage's ``on_failure`` hook when the stage still waits for a
        running task (so that the peers learn it at once), else when ``run_step`` raises."""
        self._told = step
        if isinstance(e, StepTimeoutError):
            self._explain_timeout(e, step)
            self._dump(f"step {step} timed out")
        elif isinstance(e, ChannelError) and not isinstance(e, PeerStepError):
            self._add_peer_failures(e)
        self._announce(step, e)

    def _announce(self, step: int, e: BaseException) -> None:
        """Tell every rank of the pipeline that ``step`` failed on this rank (the channel's ABORT:
        see ``P2PChannel``'s design note), so that theirs fails too, at once. A lost peer
        is told by the CLOSE instead (it carries the cause; the channel is broken for good):
        deciding it from the error, not from the channel's state, keeps that choice free of
        races with the listener thread that reports the loss."""
        if isinstance(e, PeerError) and not isinstance(e, PeerStepError):
            return
        if self._decisions is not None:  # a TP leader tells its followers (one-way channel)
            origin = e.origin if isinstance(e, PeerStepError) else self._rank
            self._decisions.abort(step, origin)
        if isinstance(e, PeerStepError):  # failed elsewhere: the channel passed it on
            self._channel.abort(step, e.cause, origin=e.origin, kind=e.kind)
            return
        self._channel.abort(step, failure_cause(e), kind=failure_kind(e))

    async def name_root(self, step: int, e: BaseException) -> None:
        """When ``step`` timed out here waiting for other ranks (or with every message in),
        or failed for the ABORT of a rank that timed out so (``FailureKind.TIMEOUT``: a
        waiter, seldom the root), find the rank at the root and open the message with it,
        asking at the same time: a stuck policy's ABORT (``FailureKind.POLICY``; waiting at
        most ``POLICY_NEWS_WAIT``: every rank's watchdog fires at about the same moment, this
        one a little before the stuck rank's, which alone knows that its policy is the
        cause; a rank on the way may close before it passes it on), the failures ranks left
        on the job's board for this step, and the ranks whose heartbeat stopped (``_pulse``:
        a stopped rank two hops away, or one that stopped after its last message)."""
        if isinstance(e, PeerStepError) and e.kind == FailureKind.TIMEOUT and e.step == step:
            waited, waited_for = "", frozenset[int]()
        else:
            got_waited = self._waited.pop(step, None)
            if not isinstance(e, StepTimeoutError) or e.policy is not None or got_waited is None:
                return
            waited, waited_for = got_waited
        wait = (
            POLICY_NEWS_WAIT
            if self._step_timeout is None
            else min(POLICY_NEWS_WAIT, self._step_timeout / 2)
        )
        stuck, silent_got = await asyncio.gather(
            self._channel.stuck_policy(step, wait),
            self._silent() if self._silent is not None else no_answer(),
        )
        # The board last: a rank that failed by itself at about this moment has posted by now.
        notes = None if stuck is not None or self._notes is None else await self._notes([step])
        silent = [g for g in silent_got or [] if g != self._rank]
        notes = {g: t for g, t in (notes or {}).items() if g != self._rank}
        first, _, rest = str(e.args[0]).partition("\n") if e.args else ("", "", "")
        if isinstance(e, PeerStepError):
            head = f"{self._who} step {step}"
            told = f"; {self._name(e.origin)} timed out waiting and told this rank: {e.cause}"
        else:
            head = f"{self._who} step {step}: timed out after {self._step_timeout} s"
            told = ""
        if stuck is not None:
            origin, cause = stuck
            head += (
                f" waiting for {self._name(origin)}, whose policy did not return a decision"
                f" (this rank waited for {waited or 'the end of its step'}); that rank says:"
                f" {cause}"
            )
        elif notes:
            said = "; ".join(
                f"{self._name(g)} failed by itself at step {step}: {t}"
                for g, t in sorted(notes.items())
            )
            self._channel.blame_global(step, sorted(notes), "failed")
            head += f": {said}" + (f"; this rank waited for {waited}" if waited else "")
        elif silent and not told and set(silent) == waited_for:  # they stopped
            self._channel.blame_global(step, silent, "timed_out")
            head = first.replace(
                ": hung, stopped or lost (or waiting itself for another rank)",
                f": {'they' if len(silent) > 1 else 'it'} stopped responding (no heartbeat in"
                f" the job's store for {WINDOW_S:g} s: stopped, dead, or hung where no Python"
                " thread runs)",
                1,
            )
        elif silent:
            self._channel.blame_global(step, silent, "timed_out")
            head += f": {describe(silent, self._name, broke=False)}"
            head += f"; this rank waited for {waited}" if waited else ""
            if not waited and not told:
                head += "; every message of the step had arrived here"
            failures = list(self._channel.peer_failures().values())
            if failures:
                head += "; " + "; ".join(failures)
        else:
            return
        e.args = (f"{head}{told}\n{rest}" if rest else f"{head}{told}", *e.args[1:])

    def _name(self, g: int) -> str:
        """A message's name of global rank ``g``: "rank 2 (global 2)" in this pipeline."""
        return name_among(self._peers, g)

    def _explain_timeout(self, e: StepTimeoutError, step: int) -> None:
        """Open the watchdog's message with what the step waited for: the policy of this
        rank, when it had not returned (the loop's message names it already), the ranks
        whose messages of this step did not all arrive (the plan says how many each sends),
        or the TP decision group; tell the channel, so the peers learn it from the CLOSE."""
        if e.policy is not None:
            self._channel.policy_stuck(step)
            return
        if e.collective is not None:  # the control group's: its message says what it knows
            return
        prog = self._schedule().program(self._pp_rank)
        expected = collections.Counter(r for r in prog.src_rank if r >= 0)
        got = self._channel.arrivals(step)
        missing = {r: n - got.get(r, 0) for r, n in sorted(expected.items()) if got.get(r, 0) < n}
        peers = self._peers
        head = f"{self._who} step {step}: timed out after {self._step_timeout} s"
        if missing:
            names = ", ".join(
                f"rank {r} (global {peers[r]}; {k} of its {expected[r]} messages of the step"
                " missing)"
                for r, k in missing.items()
            )
            head += (
                f" waiting for {names}: hung, stopped or lost (or waiting itself for another rank)"
            )
            self._channel.blame(step, missing)
            self._waited[step] = (names, frozenset(peers[r] for r in missing))
        elif self._decisions is not None and self._decisions.waiting is not None:
            head += f" waiting for {self._decisions.waiting}"
        else:
            head += (
                ": every message of the step arrived; it is stuck in this rank's own work"
                " (a task that does not return, or the policy)"
            )
            self._waited[step] = ("", frozenset())
        failures = list(self._channel.peer_failures().values())
        if failures:
            head += "; " + "; ".join(failures)
        e.args = (f"{head}\n{e.args[0] if e.args else ''}", *e.args[1:])

    def _add_peer_failures(self, e: ChannelError) -> None:
        """Append why failed peers failed (the cause their CLOSE carried) to ``e``."""
        text = str(e)
        extra = [t for t in self._channel.peer_failures().values() if t not in text]
        if extra and e.args:
            e.args = (f"{e.args[0]}; " + "; ".join(extra), *e.args[1:])


def failed_by_itself(e: BaseException) -> bool:
    """Whether a step that failed with ``e`` failed on this rank by its own cause (an error
    of its own, its policy that did not return), not for another rank (a peer's failure or
    loss, a timeout waiting for others, a cancellation from outside)."""
    if isinstance(e, StepTimeoutError):
        return e.policy is not None
    return isinstance(e, Exception) and not isinstance(e, PeerError)


def failure_cause(e: BaseException) -> str:
    """What a failed step's ABORT says of ``e``: its type and first line, and its notes
    (``add_note``: the task, and the fix where one is known); not the state dump (the stage
    loop's ``StateNote``), which stays local. A cancel says where it came from."""
    if isinstance(e, asyncio.CancelledError):
        cause = "the step was cancelled there (asyncio.CancelledError: a timeout or a cancel"
        cause += " scope of its caller)"
        return cause
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    cause = f"{type(e).__name__}: {first}" if first else type(e).__name__
    notes = [str(n) for n in exception_notes(e) if str(n).strip() and not isinstance(n, StateNote)]
    if notes:
        cause += " [" + "; ".join(notes) + "]"
    return cause
