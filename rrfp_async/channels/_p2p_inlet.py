"""The p2p channel's loop side: where what its threads learned reaches the stage.

Everything in this module runs on the loop thread (the channel's threads hand their calls
over through a ``LoopPort``): a message for the sink, the error the channel broke with, the
count of the messages of each recent step. A message that arrives before the stage ``bind``s
its sink waits in the ``Inlet`` and is replayed, in order, when it does.
"""

from __future__ import annotations

from typing import Any

from .._tasks import Task
from ._base import Sink

__all__ = ["Inlet"]

_KEPT_STEPS = 3
"""Arrivals are kept for the steps within this many of the latest one."""


class Inlet:
    """The loop side of a ``P2PChannel``: owns the sink, the messages that came before it
    was bound, the arrivals per step and the error the channel broke with (the first)."""

    def __init__(self) -> None:
        self.sink: Sink | None = None
        self.failed: BaseException | None = None
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._arrivals: dict[int, dict[int, int]] = {}  # step -> {src: messages}

    def bind(self, sink: Sink) -> None:
        """Route messages to ``sink``; those that came earlier are replayed now."""
        self.sink = sink
        pending, self._pending = self._pending, []
        for step, task, payload, src in pending:
            self._hand(sink, step, task, payload, src)

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """A message from ``src``, the input of ``task`` of ``step``: count it, hand it to
        the sink (or keep it until one is bound)."""
        got = self._arrivals.get(step)
        if got is None:
            got = self._arrivals[step] = {}
            for old in [s for s in self._arrivals if s < step - _KEPT_STEPS]:
                del self._arrivals[old]
        got[src] = got.get(src, 0) + 1
        sink = self.sink
        if sink is None:
            self._pending.append((step, task, payload, src))
            return
        self._hand(sink, step, task, payload, src)

    @staticmethod
    def _hand(sink: Sink, step: int, task: Task, payload: Any, src: int) -> None:
        try:
            sink.deliver(step, task, payload, src)
        except Exception as e:  # raised inside a loop callback: route it to the stage
            sink.fail(e)

    def fail(self, exc: BaseException) -> None:
        """The channel broke with ``exc`` (the first error is kept): the stage fails."""
        if self.failed is None:
            self.failed = exc
        if self.sink is not None:
            self.sink.fail(exc)

    def arrivals(self, step: int) -> dict[int, int]:
        """Messages received for ``step``, per source pipeline rank (recent steps only)."""
        return dict(self._arrivals.get(step, {}))
