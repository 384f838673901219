"""Streams and events on a stage's device: one face for CUDA and for the CPU.

Design note
-----------
Under NCCL, a communication completes on the device, not on the host: ``Work.wait()``
makes the calling thread's *current stream* wait for the operation and returns at once. A
transport that follows NCCL's rules therefore completes a receive on a stream of its own
(the edge's comm stream), records an event there, and hands the event to the consumer, whose
compute stream waits on it; nothing waits on the default stream, and no host thread blocks
in a device operation.

On a CPU there is no device to order things on, but the same code runs (gloo, tests, the
NCCL-rules checker of ``rrfp_async.testing``). ``HostStream`` and ``HostEvent`` are the CPU
stand-ins: a host stream collects *pending completions* (``Pending``) that were ordered on it
while it was the thread's current stream (``use_host_stream``), an event recorded on it
captures those, and ``synchronize()`` waits for them. With plain gloo nothing is ever pending
(its ``wait()`` blocks), so every host event is complete when recorded and costs nothing;
the NCCL-rules checker, which models NCCL's deferred completions on gloo, adds pending
completions, so a consumer that reads a tensor before the event of its receive reads what
the checker put there (poison), and a ``wait()`` with no stream current is caught.

``Device`` picks the right kind for a ``torch.device``: CUDA streams and events (created
with ``blocking=True``, so a host wait sleeps instead of spinning a core) on a CUDA device,
the host stand-ins elsewhere. Every thread that touches CUDA calls ``bind_thread()`` first:
a new thread starts on device 0, so without it rank 1's helper threads would allocate on,
and create streams of, cuda:0.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "READY_ATTR",
    "Device",
    "HostEvent",
    "HostStream",
    "Pending",
    "current_host_stream",
    "mark_ready",
    "pending_events",
    "use_host_stream",
    "wait_ready",
]

READY_ATTR = "_rrfp_ready"
"""Attribute of a received tensor: the event of its receive (see ``mark_ready``)."""


class Pending:
    """A completion that may still be outstanding (a deferred operation's end): set once,
    with or without an error."""

    __slots__ = ("_done", "error", "what")

    def __init__(self, what: str = "") -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.what = what

    def set(self, error: BaseException | None = None) -> None:
        """Mark it complete (``error``: it failed)."""
        self.error = error
        self._done.set()

    def is_set(self) -> bool:
        """Whether it completed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it completes (at most ``timeout`` s); whether it did."""
        return self._done.wait(timeout)


class HostStream:
    """A CPU stand-in for a CUDA stream: the pending completions ordered on it.

    Args:
        name: For messages.
    """

    __slots__ = ("_deps", "_lock", "name")

    def __init__(self, name: str = "host") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._deps: list[Pending] = []

    def add(self, deps: list[Pending]) -> None:
        """Order ``deps`` on this stream: what is recorded on it from now waits for them."""
        with self._lock:
            self._deps = [d for d in self._deps if not d.is_set()]
            self._deps.extend(d for d in deps if not d.is_set() or d.error is not None)

    def snapshot(self) -> list[Pending]:
        """The completions still outstanding on this stream (and failed ones)."""
        with self._lock:
            self._deps = [d for d in self._deps if not d.is_set() or d.error is not None]
            return list(self._deps)

    def __repr__(self) -> str:
        return f"HostStream({self.name!r})"


_local = threading.local()


def current_host_stream() -> HostStream | None:
    """This thread's current host stream (None: the "default stream")."""
    return getattr(_local, "stream", None)


@contextlib.contextmanager
def use_host_stream(stream: HostStream | None) -> Iterator[None]:
    """Make ``stream`` this thread's current host stream inside the block."""
    prev = getattr(_local, "stream", None)
    _local.stream = stream
    try:
        yield
    finally:
        _local.stream = prev


class HostEvent:
    """A CPU stand-in for a CUDA event: recorded on a host stream, it captures the
    completions pending there; ``synchronize()`` waits for them (and raises the first error
    one of them carries)."""

    __slots__ = ("_deps",)

    def __init__(self) -> None:
        self._deps: list[Pending] = []

    def record(self, stream: HostStream | None = None) -> None:
        """Capture what is pending on ``stream`` (default: the current host stream)."""
        s = stream if stream is not None else current_host_stream()
        self._deps = [] if s is None else s.snapshot()

    def query(self) -> bool:
        """Whether everything it captured has completed (never blocks)."""
        return all(d.is_set() for d in self._deps)

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until everything it captured completed.

        Raises:
            TimeoutError: Not within ``timeout`` seconds.
            Exception: The error a captured operation failed with.
        """
        for d in self._deps:
            if not d.wait(timeout):
                raise TimeoutError(f"{d.what or 'a deferred operation'} did not complete")
            if d.error is not None:
                raise d.error

    def wait(self, stream: HostStream | None = None) -> None:
        """Order ``stream`` (default: the current host stream) after this event."""
        s = stream if stream is not None else current_host_stream()
        if s is not None:
            s.add(self._deps)


class Device:
    """Streams, events and thread binding on one device (see the design note).

    Args:
        device: The device (a CUDA device gets its index filled in from the current
            device when it has none).
    """

    def __init__(self, device: torch.device | str) -> None:
        dev = torch.device(device)
        index: int | None = dev.index
        if dev.type == "cuda" and index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.is_cuda = dev.type == "cuda"

    def bind_thread(self) -> None:
        """Make this thread's current CUDA device the stage's (no-op off CUDA)."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def new_stream(self, name: str) -> Any:
        """A new stream: a CUDA stream on the device, else a ``HostStream``."""
        if self.is_cuda:
            return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return HostStream(name)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current inside a ``with`` block."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return use_host_stream(stream)

    def current(self) -> Any:
        """This thread's current stream (a host stream, or None, off CUDA)."""
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return current_host_stream()

    def record(self, stream: Any = None) -> Any:
        """A new event recorded on ``stream`` (default: the current stream)."""
        if self.is_cuda:
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            return ev
        hev = HostEvent()
        hev.record(stream)
        return hev

    def wait_event(self, event: Any, stream: Any = None) -> None:
        """Order ``stream`` (default: the current one) after ``event``; never blocks the host."""
        if self.is_cuda:
            s = stream if stream is not None else torch.cuda.current_stream(self.device)
            s.wait_event(event)
        else:
            event.wait(stream)

    def consume(self, event: Any) -> None:
        """Make this thread's compute wait for ``event`` before it reads what the event
        guards: on CUDA the current stream waits on the device (the host goes on); on the
        CPU the thread *is* the stream, so it blocks until the event completed (and raises
        the error of a failed operation)."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(event)
        else:
            event.synchronize()

    def __repr__(self) -> str:
        return f"Device({self.device})"


# Received tensors carry the event of their receive
# --------------------------------------------------
# A channel that completes a receive on a comm stream records an event there and attaches
# it to every tensor leaf of the value it delivers (``mark_ready``); the consumer, on the
# thread (and CUDA stream) that computes with the value, calls ``wait_ready`` first, which
# makes that stream wait for the event and then forgets it. The attribute travels with the
# tensor through the loop untouched (the loop never reads payloads), so no interface
# between the channel and the executor changes; a consumer that does not call
# ``wait_ready`` is served by the channel itself, which then delivers only once the event
# completed (``P2PChannel.consumer_waits``).


def mark_ready(value: Any, event: Any) -> None:
    """Attach ``event`` (the receive's) to every tensor leaf of ``value``."""
    from ._pytree import tensor_leaves

    for t in tensor_leaves(value):
        setattr(t, READY_ATTR, event)


def pending_events(value: Any) -> list[Any]:
    """The distinct receive events attached to ``value``'s tensor leaves."""
    from ._pytree import tensor_leaves

    out: list[Any] = []
    for t in tensor_leaves(value):
        ev = getattr(t, READY_ATTR, None)
        if ev is not None and all(ev is not e for e in out):
            out.append(ev)
    return out


def wait_ready(value: Any, device: Device) -> int:
    """Order this thread's compute after the receive events attached to ``value``'s tensor
    leaves (``Device.consume``) and detach them; on CUDA each leaf is also recorded on the
    current stream (``record_stream``: its memory came from the comm stream's pool and must
    not be reused while this stream may still read it).

    Returns:
        How many distinct events it waited for.
    """
    from ._pytree import tensor_leaves

    seen: list[Any] = []
    for t in tensor_leaves(value):
        ev = getattr(t, READY_ATTR, None)
        if ev is None:
            continue
        if all(ev is not e for e in seen):
            device.consume(ev)
            seen.append(ev)
        delattr(t, READY_ATTR)
        if device.is_cuda and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    return len(seen)
