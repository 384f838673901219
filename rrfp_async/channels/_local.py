"""The in-process channel: stages of one process exchange messages through the event loop."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from .._check import check_int, describe
from .._errors import PlanError, ProtocolError
from .._tasks import Task
from ._base import Sink

__all__ = ["LocalChannel", "LocalEndpoint"]

LatencyFn = Callable[[int, Task], float]
"""``(step, consumer task) -> seconds`` a message takes."""


class LocalChannel:
    """Connects the stages of one process; a message is a callback on the running loop.

    With a latency model, each message arrives ``latency(step, task)`` seconds after it was
    sent (on the loop clock, so virtual time in a simulation); messages may overtake each
    other, which the stages must (and do) handle.

    :meth:`discard` drops every message still in flight (a local pipeline calls it when a
    step failed): each message carries the channel's *generation* at sending, and one of an
    older generation is dropped on arrival, so a dead step's messages never reach a later one.

    Args:
        stages: Number of ranks.
        latency: Optional ``(step, consumer task) -> seconds``.

    Attributes:
        inflight: Messages sent and neither delivered nor discarded.
        dropped: Messages discarded so far.

    Raises:
        PlanError: ``stages`` is not an integer >= 1 or ``latency`` is not callable; at
            sending, ``latency`` returned no number >= 0.
    """

    def __init__(self, stages: int, latency: LatencyFn | None = None) -> None:
        stages = check_int("stages", stages, minimum=1)
        if latency is not None and not callable(latency):
            raise PlanError(
                f"latency must be a function (step, task) -> seconds, or None; got"
                f" {describe(latency)}"
            )
        self._sinks: list[Sink | None] = [None] * stages
        self.latency = latency
        self.inflight = 0
        self.dropped = 0
        self._gen = 0
        self._endpoints = [LocalEndpoint(self, r) for r in range(stages)]

    def endpoint(self, rank: int) -> LocalEndpoint:
        """Rank ``rank``'s end of the channel."""
        rank = check_int("rank", rank, minimum=0, maximum=len(self._endpoints) - 1)
        return self._endpoints[rank]

    def discard(self) -> int:
        """Drop every message in flight: none of them will be delivered. Returns how many."""
        n = self.inflight
        self._gen += 1
        self.dropped += n
        self.inflight = 0
        return n

    def _bind(self, rank: int, sink: Sink) -> None:
        self._sinks[rank] = sink

    def _send(self, src: int, dst: int, step: int, task: Task, payload: Any) -> None:
        if not 0 <= dst < len(self._sinks):
            raise ProtocolError(f"rank {src} sent {task} to rank {dst}, which does not exist")
        loop = asyncio.get_running_loop()
        if self.latency is None:
            loop.call_soon(self._deliver, self._gen, src, dst, step, task, payload)
        else:
            delay = self.latency(step, task)
            try:
                ok = 0 <= delay < math.inf  # False for NaN; inf would never arrive
            except TypeError:
                ok = False
            if not ok:
                raise PlanError(
                    f"latency({step}, {task}) must return seconds >= 0, got {describe(delay)}"
                    f" (rank {src} sending to rank {dst}); a finite number (a message"
                    " delayed forever would hang the step)"
                )
            if delay > 0:
                loop.call_later(delay, self._deliver, self._gen, src, dst, step, task, payload)
            else:
                loop.call_soon(self._deliver, self._gen, src, dst, step, task, payload)
        self.inflight += 1

    def _deliver(self, gen: int, src: int, dst: int, step: int, task: Task, payload: Any) -> None:
        if gen != self._gen:
            return  # discarded (its step failed); no longer counted in flight
        self.inflight -= 1
        sink = self._sinks[dst]
        if sink is None:
            raise ProtocolError(f"rank {dst} has no stage bound; message {task} from {src} lost")
        try:
            sink.deliver(step, task, payload, src)
        except Exception as e:  # raised inside a loop callback: route it to the stage (in
            sink.fail(e)  # the loop's exception handler it would be lost, the step hang)


class LocalEndpoint:
    """One rank's end of a ``LocalChannel``."""

    def __init__(self, channel: LocalChannel, rank: int) -> None:
        self._channel = channel
        self._rank = rank

    @property
    def rank(self) -> int:
        """The rank of this endpoint."""
        return self._rank

    @property
    def inflight(self) -> int:
        """Messages of the whole channel not yet delivered."""
        return self._channel.inflight

    def bind(self, sink: Sink) -> None:
        """Route this rank's inbound messages to ``sink``."""
        self._channel._bind(self._rank, sink)

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        """Deliver ``payload`` for ``task`` to rank ``dst`` via the event loop."""
        self._channel._send(self._rank, dst, step, task, payload)
