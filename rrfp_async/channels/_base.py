"""The channel interfaces: how a stage sends outputs and receives inputs.

A stage loop *binds* itself (a ``Sink``) to its endpoint; inbound messages reach it through
``Sink.deliver`` on the event loop's thread, in any order. A message names the task it
feeds (the consumer), so out-of-order arrival needs no matching logic in the stage.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._tasks import Task

__all__ = ["Endpoint", "Sink"]


class Sink(Protocol):
    """The receiving side of a stage (implemented by the stage loop)."""

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` (in ``step``) arrived from rank ``src``."""

    def fail(self, exc: BaseException) -> None:
        """The channel broke; the stage must end its step with ``exc``."""

    def peer_closed(self, src: int) -> None:
        """Rank ``src`` closed its end: no more messages will come from it."""


@runtime_checkable
class Endpoint(Protocol):
    """One rank's end of a channel."""

    @property
    def rank(self) -> int:
        """The rank this endpoint belongs to."""

    def bind(self, sink: Sink) -> None:
        """Route inbound messages of this rank to ``sink``."""

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        """Send ``payload``, the input of ``task`` in ``step``, to rank ``dst``.

        Never blocks the event loop; failures surface through the receiving or the
        sending stage's ``Sink.fail``. Called on the loop thread, unless the endpoint has a
        true ``threadsafe_send`` attribute: then the stage may call it from its executor's
        compute thread (one thread at a time), as soon as the output exists.
        """

    @property
    def inflight(self) -> int:
        """Messages sent through this channel and not yet delivered (-1 if unknown)."""
