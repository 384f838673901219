"""The TP coordinator a stage loop talks to, and the sequence check it posts once per step.

A stage with TP degree > 1 has a coordinator (``channels.DecisionChannel``): the leader
publishes each decision, followers receive them (``_decide``, ``_follow``). After the step,
every TP rank checks that all of them executed the same sequence (invariant 3);
:class:`SequenceCheck` makes sure each rank takes part in that check exactly once per step,
also when its step failed before the check (``post_failed``), so that the decision group's
collectives stay matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .._errors import PeerStepError
from .._tasks import Task

__all__ = ["Coordinator", "DecisionPeek", "FailedSequencePoster", "LeaderNamed", "SequenceCheck"]


class Coordinator(Protocol):
    """Makes the TP ranks of a stage run one task sequence (``channels.DecisionChannel``).

    The leader's policy decides and ``publish``es each decision; followers ``receive`` it
    and run that task once it is ready locally. Optional hooks, each a protocol of its own
    (checked with ``isinstance``): :class:`DecisionPeek` (``has_decision``) and
    :class:`LeaderNamed` (``leader``) make a follower's ``stall`` events say when, and for
    whom, it waits; :class:`FailedSequencePoster` (``post_failed_sequence``) lets a step
    that failed before its TP sequence check take part in it.
    """

    @property
    def is_leader(self) -> bool:
        """Whether this rank's policy decides."""

    def begin_step(self, step: int, decisions: int) -> None:
        """A step with ``decisions`` dispatches starts."""

    def publish(self, step: int, seq: int, task: Task) -> None:
        """Leader: announce decision ``seq`` without waiting."""

    async def receive(self, step: int, seq: int) -> Task:
        """Follower: the leader's decision ``seq``."""

    async def end_step(self) -> None:
        """Leader: every decision of the step has gone out."""

    async def verify_sequence(self, step: int, executed: Sequence[Task]) -> None:
        """Every rank: check that all TP ranks executed the same sequence."""


@runtime_checkable
class DecisionPeek(Protocol):
    """Optional: a coordinator that can tell whether a decision has arrived."""

    def has_decision(self, step: int, /) -> bool:
        """Whether ``receive`` for the next decision of ``step`` would not wait. A follower
        asks before it waits (to confirm deduced decisions, and to emit a ``stall`` only when
        it really waits); without it every such wait is reported."""


@runtime_checkable
class LeaderNamed(Protocol):
    """Optional: a coordinator that knows its leader's global rank."""

    leader: int
    """The TP leader's global rank, read once per step by a follower: its ``stall`` events
    and state dumps name it (without it they name no rank)."""


@runtime_checkable
class FailedSequencePoster(Protocol):
    """Optional: a coordinator whose sequence check a failed step still takes part in."""

    def post_failed_sequence(self, step: int, origin: int | None, /) -> None:
        """Step ``step`` failed on this rank before its ``verify_sequence``: post this rank's
        part of the check without waiting, so that the check's collectives stay matched and TP
        peers learn the step failed (``origin``: the global rank where it failed first, when
        another rank told this one, else None). Called on the loop thread at most once per
        step; without it a failed step posts nothing."""


class SequenceCheck:
    """The TP sequence check of one stage: posted once per step, whether the step ended well
    (``verify``) or failed before it (``post_failed``).

    Owns the number of the last step whose check was posted. The coordinator is passed per
    call: a stage's ``coordinator`` may change between steps.
    """

    __slots__ = ("posted",)

    def __init__(self) -> None:
        #: The last step whose sequence check this rank posted (None: none yet).
        self.posted: int | None = None

    async def verify(self, coord: Coordinator, step: int, executed: Sequence[Task]) -> None:
        """The step ended on this rank: check that every TP rank executed ``executed``."""
        self.posted = step  # posted once per step, whatever it raises
        await coord.verify_sequence(step, executed)

    def post_failed(self, coord: object, step: int, exc: BaseException) -> None:
        """Step ``step`` failed on this rank before its sequence check: take part in the check
        anyway, without waiting (the coordinator's ``post_failed_sequence``), so that every
        TP rank posts it exactly once per step (the decision group's collectives stay
        matched) and a TP peer whose step went on learns there that it failed on this rank."""
        if self.posted == step:
            return
        self.posted = step
        if isinstance(coord, FailedSequencePoster):
            # Where it failed first, when another rank told this one (only a PeerStepError
            # carries an origin).
            origin = exc.origin if isinstance(exc, PeerStepError) else None
            coord.post_failed_sequence(step, origin)
