"""The channel interfaces: how a stage sends outputs and receives inputs.

A stage loop *binds* itself (a ``Sink``) to its endpoint; inbound messages reach it through
``Sink.deliver`` on the event loop's thread, in any order. A message names the task it
feeds (the consumer), so out-of-order arrival needs no matching logic in the stage.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .._tasks import Task

__all__ = ["AbortSink", "ClosingSink", "Endpoint", "Sink", "ThreadsafeEndpoint"]


class Sink(Protocol):
    """The receiving side of a stage (implemented by the stage loop).

    ``deliver`` and ``fail`` are the contract; a sink may also implement the optional hooks
    :class:`ClosingSink` (``peer_closed``) and :class:`AbortSink` (``step_aborted``), which a
    channel calls only when the sink has them (``isinstance``).
    """

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` (in ``step``) arrived from rank ``src``."""

    def fail(self, exc: BaseException) -> None:
        """The channel broke; the stage must end its step with ``exc``."""


@runtime_checkable
class ClosingSink(Protocol):
    """Optional: a sink that wants to know when a peer closed its end."""

    def peer_closed(self, src: int, *, why: str | None = None) -> None:
        """Rank ``src`` closed its end: no more messages will come from it. Called on the
        loop thread, once per peer, unless this rank is closing itself (the stage loop
        then names the closed peer when it waits for one of its messages). ``why``: what
        its CLOSE said, origin first ("rank 3 (global 3) left after step 1 ...", "rank 2
        (global 2) was lost at step 2 ..."), given only when it said something: the stage's
        error opens with it."""


@runtime_checkable
class AbortSink(Protocol):
    """Optional: a sink that fails a step another rank reported failed (``P2PChannel``'s
    ABORT; invariant 6: a step fails everywhere or nowhere)."""

    def step_aborted(self, step: int, exc: BaseException) -> None:
        """Step ``step`` failed on another rank; ``exc`` (a ``PeerStepError``) names it. Called
        on the loop thread, once per step, as soon as the ABORT arrived (the step may not have
        started on this rank yet). Without the hook the sink learns nothing until the step's own
        messages stop (a step timeout or the end-of-step agreement)."""


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


@runtime_checkable
class ThreadsafeEndpoint(Protocol):
    """Optional: an endpoint whose ``send`` may be called from a thread other than the loop's.

    When ``threadsafe_send`` is true and the executor takes an output hook (``set_output_hook``)
    (``loop.OutputHookExecutor``), the stage sends each output from the executor's compute
    thread as soon as it exists (one thread at a time), instead of from the loop thread once
    the task's completion reached the loop. Read once, when the stage is built.
    """

    threadsafe_send: bool
