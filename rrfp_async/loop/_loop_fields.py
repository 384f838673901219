"""What the parts of a stage loop share: its fields, declared once, and the TP coordinator.

Design note
-----------
:class:`~rrfp_async.loop.StageLoop` is one object, written as a stack of mixins, one concept
per module, each building on the ones below it (bottom first)::

    StageFields        _loop_fields      the fields every part reads (declarations only)
    StageIntrospection _loop_introspect  now, view, plan, step, waiting_for, dump
    StepFailures       _loop_failures    fail, ABORTs, failed step numbers, settling
    MessageDelivery    _loop_delivery    deliver, the ready set's waiter, closed peers
    Dispatch           _loop_dispatch    the dispatch loop (its design note), _execute
    TPFollower         _loop_tp_follower a TP follower's loop and its deduced decisions
    StageLoop          _stage_loop       construction, run_step, the step's start and end

A mixin calls only its own methods and those of the mixins below it; the fields are set by
``StageLoop.__init__`` alone. The split is for the reader: the instance, its attributes and
what every method does are those of the one class the stage used to be.

The stage's observer and monitor protocols name ``StageLoop`` in their signatures, so they
stay in ``_stage_loop``; the parts below see the observer as the guard that wraps it
(:class:`~rrfp_async.loop._observe.GuardedObserver`) and the monitor as :class:`BlockMonitor`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._tasks import Task
from ..channels import Endpoint
from ..policies import Policy, PolicyBase, StepSchedule
from ._executors import Executor
from ._observe import GuardedObserver
from ._state import StepState
from ._view import StageView

__all__ = [
    "BlockMonitor",
    "Coordinator",
    "DecisionPeek",
    "FailedSequencePoster",
    "LeaderNamed",
    "StageFields",
]


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
        """Step ``step`` failed here before its ``verify_sequence``: post this rank's part of
        the check without waiting, so that the check's collectives stay matched and TP
        peers learn the step failed (``origin``: the global rank where it failed first, when
        another rank told this one, else None). Called on the loop thread at most once per
        step; without it a failed step posts nothing."""


class BlockMonitor(Protocol):
    """A :class:`~rrfp_async.loop.StageMonitor` as the stage's waiter calls it (the stage is
    typed ``Any``: the monitor protocol proper names ``StageLoop``, which imports this)."""

    def blocked(self, stage: Any) -> None:
        """``stage`` is waiting for its ready set to change and runs nothing."""

    def unblocked(self, stage: Any) -> None:
        """``stage`` is no longer blocked."""


class StageFields:
    """The fields of a :class:`~rrfp_async.loop.StageLoop` that its parts share.

    Declarations only (no values, no methods): ``StageLoop.__init__`` sets every one, and
    says there what each holds.
    """

    rank: int
    schedule: StepSchedule
    executor: Executor
    endpoint: Endpoint
    policy: Policy
    policy_name: str
    monitor: BlockMonitor | None
    coordinator: Coordinator | None
    verify_sequences: bool
    deduce_tp: bool
    tp_deduced: int
    settle_timeout: float
    blocked: bool
    recent: collections.deque[tuple[float, str, Task]] | None
    late_failures: list[BaseException]
    _exec_async: bool
    _hooks: PolicyBase | None
    _obs: GuardedObserver | None
    _verified: int | None
    _now: Callable[[], float]
    _closed_peers: set[int]
    _st: StepState | None
    _waiter: asyncio.Future[bool] | None
    _failure: BaseException | None
    _early: dict[int, list[tuple[Task, Any, int]]]
    _dead: set[int]
    _aborted: dict[int, BaseException]
    _next_step: int
    _view: StageView
    _eager: bool
