"""The in-process channel: stages of one process exchange messages through the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._errors import ProtocolError, RRFPError
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

    Args:
        stages: Number of ranks.
        latency: Optional ``(step, consumer task) -> seconds``.
    """

    def __init__(self, stages: int, latency: LatencyFn | None = None) -> None:
        self._sinks: list[Sink | None] = [None] * stages
        self.latency = latency
        self.inflight = 0
        self._endpoints = [LocalEndpoint(self, r) for r in range(stages)]

    def endpoint(self, rank: int) -> LocalEndpoint:
        """Rank ``rank``'s end of the channel."""
        return self._endpoints[rank]

    def _bind(self, rank: int, sink: Sink) -> None:
        self._sinks[rank] = sink

    def _send(self, src: int, dst: int, step: int, task: Task, payload: Any) -> None:
        if not 0 <= dst < len(self._sinks):
            raise ProtocolError(f"rank {src} sent {task} to rank {dst}, which does not exist")
        loop = asyncio.get_running_loop()
        self.inflight += 1
        delay = self.latency(step, task) if self.latency is not None else 0.0
        if delay > 0:
            loop.call_later(delay, self._deliver, src, dst, step, task, payload)
        else:
            loop.call_soon(self._deliver, src, dst, step, task, payload)

    def _deliver(self, src: int, dst: int, step: int, task: Task, payload: Any) -> None:
        self.inflight -= 1
        sink = self._sinks[dst]
        if sink is None:
            raise ProtocolError(f"rank {dst} has no stage bound; message {task} from {src} lost")
        try:
            sink.deliver(step, task, payload, src)
        except RRFPError as e:  # raised inside a loop callback: route it to the stage
            sink.fail(e)


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
