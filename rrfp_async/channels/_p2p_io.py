"""The p2p channel's shared pieces: its state, inbound-edge state, shared I/O, the inbox.

``P2PChannel`` (``_p2p``) is assembled from parts, one module each, over the state declared
here (``ChannelState``): the send path (``_p2p_send``), the receive threads (``_p2p_recv``),
the control messages, CLOSE and ABORT (``_p2p_control``), and the device path's payload
communicators and issue thread (``_p2p_device``); the wire format is ``_wire``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from .._bridges import post
from .._errors import RRFPError
from .._streams import Device
from .._tasks import Task
from ._base import Sink

__all__ = [
    "IO_ENV",
    "IO_MODES",
    "ChannelState",
    "IOMode",
    "Inbound",
    "Inbox",
    "SharedIO",
    "edge_text",
]

DEFAULT_INLINE_SEND_BYTES = 1 << 20
"""Largest payload ``send`` posts from the calling thread (gloo). A gloo send writes in the
calling thread (about 0.5 ms for 200 KiB here), but on this 2-core machine a sender thread
buys no parallelism, only a hand-off: posting the pipeline's activations (up to ~0.6 MB in
``bench peer``) from the caller made the fixed order 1.00x torch ``Schedule1F1B`` against
0.94x with a 32 KiB limit (mean of 3 paired runs). Larger messages, which would stall the
caller for milliseconds, still go through the edge's sender thread."""
REAP_BATCH = 16
"""Works of messages posted by ``send`` that wake the sender thread to reap them."""
WATCH_TAG = 1
"""Tag of the BYE that ends a watcher (shared I/O); every other message uses tag 0."""
IO_ENV = "RRFP_P2P_IO"
"""Environment variable: the ``io`` of a channel built without one (``per_edge`` or
``shared``; spawned benchmark ranks inherit it)."""

IOMode = Literal["per_edge", "shared"]
"""How a ``P2PChannel`` receives: a listener thread per inbound edge, or one shared I/O
thread for all of them (see ``SharedIO``)."""
IO_MODES: tuple[IOMode, ...] = ("per_edge", "shared")


def storage_ptr(payload: Any) -> int:
    """The address of a tensor payload's storage (-1 for anything else)."""
    if isinstance(payload, torch.Tensor):
        return int(payload.untyped_storage().data_ptr())
    return -1


def edge_text(src: int, dst: int, gsrc: int, gdst: int) -> str:
    """Names an edge in errors: ``edge rank 1 -> rank 2 (global 3 -> 5)``."""
    return f"edge rank {src} -> rank {dst} (global {gsrc} -> {gdst})"


class Inbound:
    """The receive state of one inbound edge, kept by the thread that receives it."""

    __slots__ = ("cap", "closed", "edge", "expect", "open", "prev", "src")

    def __init__(self, src: int, edge: str, cap: int) -> None:
        self.src = src
        self.edge = edge
        self.cap = cap  # the edge's capacity (the sender's rule: see the design note)
        self.expect = 0  # sequence number of the next data message
        self.prev: tuple[Task, int] | None = None  # the last message: (task, step)
        self.closed = False  # its CLOSE came
        self.open = True  # the shared I/O thread still receives it

    def last(self) -> str:
        if self.prev is None:
            return "before any message arrived"
        return f"the last one was seq {self.expect - 1}, {self.prev[0]} of step {self.prev[1]}"


class SharedIO:
    """Shared I/O (``io="shared"``, gloo only): one thread receives every inbound edge.

    The thread posts one receive *from any source* (``recv_anysource``, tag 0) into a buffer
    as large as the largest open edge's capacity, reads the source rank of what completed it
    and runs that edge's checks (sequence number, header, payload) on that edge's state; a
    payload sent as a message of its own is then received from that source alone (it follows
    its header on the same pair). Per pair, gloo keeps the order, so each edge is still a FIFO.
    Completions reach the loop through ``Inbox``: one ``call_soon_threadsafe`` per batch.

    Two things a receive from any source does not do, measured here (torch 2.13, gloo):
    it does not fail when one of its pairs breaks (a killed peer leaves it blocked), and it
    costs the sender a round trip (gloo's handshake: a receive posted for one pair tells that
    pair it may send; one from any source can tell no pair ahead). So each inbound edge keeps
    a *watcher* thread blocked in a receive on its own pair (tag 1) that only the peer's BYE
    completes (sent after its CLOSE, at close): it wakes once, at close or when the
    connection breaks, never per message, and then the lost peer is named as with per-edge
    I/O. Every rank of a pipeline must use the same ``io`` (a per-edge receiver never takes
    the BYE, and the sender waits for it).
    """

    def __init__(self, inbound: Iterable[int]) -> None:
        self._lock = threading.Lock()
        self._waiting = set(inbound)  # edges that may still send
        self.done = threading.Event()  # every edge closed or broke, or the thread ended
        self.broke = False  # an edge's connection broke (see ``lost``)
        if not self._waiting:
            self.done.set()

    @property
    def open(self) -> bool:
        return not self.done.is_set()

    def waiting(self) -> list[int]:
        with self._lock:
            return sorted(self._waiting)

    def end(self, src: int) -> None:
        """Nothing more comes from ``src`` (its CLOSE came, or its connection broke)."""
        with self._lock:
            self._waiting.discard(src)
            if not self._waiting:
                self.done.set()

    def lost(self, src: int) -> None:
        """``src``'s connection broke: the receive from any source may stay blocked."""
        self.broke = True
        self.end(src)

    def end_all(self) -> None:
        self.done.set()


class Inbox:
    """Completions of the I/O threads, handed to the loop in batches: a completion that
    finds the previous batch not yet drained joins it instead of waking the loop again."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._scheduled = False
        self.batches = 0  # hand-offs to the loop
        self.items = 0  # completions handed off

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        post(self._loop, self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        self.batches += 1
        self.items += len(items)
        for fn, args in items:
            try:
                fn(*args)
            except Exception as e:  # as a callback of its own would: reported, no stop
                self._loop.call_exception_handler(
                    {"message": f"exception in {fn!r}", "exception": e}
                )


class ChannelState:
    """What the parts of ``P2PChannel`` share (set by its ``__init__`` and ``start``), and
    the few methods each part calls on another (defined in ``P2PChannel`` or a part)."""

    _rank: int
    _global: dict[int, int]
    _by_global: dict[int, int]
    _inbound: list[int]
    _outbound: list[int]
    _device: torch.device
    _dev: Device
    _growing: bool
    _inline0: int
    _max_bytes: int
    _bound_name: str
    _inline_send: int
    _io_mode: IOMode
    _io: SharedIO | None
    _io_thread_: threading.Thread | None
    _watchers: dict[int, threading.Thread]
    _inbox: Inbox | None
    _sink: Sink | None
    _loop: asyncio.AbstractEventLoop | None
    _pg: Any
    _peer_rank: dict[int, int]
    _rx: dict[int, Inbound]
    _closed_in: set[int]
    _cause: tuple[int, int, tuple[int, ...]] | None
    _last_step: int
    _arrivals: dict[int, dict[int, int]]
    _peer_failures: dict[int, str]
    _aborted: set[int]
    _send_seq: dict[int, int]
    _send_cap: dict[int, int]
    _queues: dict[int, queue.SimpleQueue[Any]]
    _locks: dict[int, threading.Lock]
    _queued: dict[int, int]
    _unreaped: dict[int, list[tuple[list[Any], tuple[int, object]]]]
    _threads: list[threading.Thread]
    _copy_streams: dict[int, Any]  # gloo with CUDA payloads: an edge's staging stream
    _started: bool
    _closing: bool
    _failed: BaseException | None
    _dmode: bool  # the device path: payloads on communicators of their own (``_p2p_device``)
    consumer_waits: bool
    sent: int
    received: int
    inline_sent: int
    direct_sent: int

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop (from a channel thread)."""
        if self._inbox is not None:
            self._inbox.post(fn, *args)
        else:
            post(self._loop, fn, *args)

    def _post_rx(self, fn: Callable[..., object], *args: Any) -> None:
        """Hand what an inbound edge's listener learned to the loop *in that edge's order*:
        on the device path a payload reaches the loop from the issue thread, so everything
        after it (the next messages, the CLOSE) is handed on through that thread's queue."""
        if self._dmode:
            self.post_in_order(fn, *args)
        else:
            self._post(fn, *args)

    def _fail(self, exc: RRFPError) -> None:
        raise NotImplementedError

    def _lose(self, peer: int, exc: RRFPError) -> None:
        raise NotImplementedError

    def _deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        raise NotImplementedError

    def _name(self, rank: int) -> str:
        raise NotImplementedError

    def _names(self, ranks: Iterable[int]) -> str:
        raise NotImplementedError

    def _edge_out(self, dst: int) -> str:
        raise NotImplementedError

    def _send_failed(self, dst: int, what: tuple[int, object] | None, e: BaseException) -> str:
        raise NotImplementedError

    def _recv_or_lose(self, buf: torch.Tensor, src: int, doing: Callable[[], str]) -> bool:
        raise NotImplementedError

    def _peer_aborted(self, src: int, step: int, origin: int, cause: str) -> None:
        raise NotImplementedError

    def _peer_closed(self, src: int) -> None:
        raise NotImplementedError

    def _peer_failed(self, src: int, cause: int, step: int, ranks: tuple[int, ...]) -> None:
        raise NotImplementedError

    def post_in_order(self, fn: Callable[..., object], *args: Any) -> None:
        raise NotImplementedError

    def reap_later(self, dst: int, works: list[Any], what: tuple[int, object]) -> None:
        raise NotImplementedError

    def end_edge(self, dst: int, hdr: list[int]) -> None:
        raise NotImplementedError

    def check_size(
        self, dst: int, step: int, task: Task, t: torch.Tensor | None, nbytes: int
    ) -> None:
        raise NotImplementedError

    def host_messages(
        self, dst: int, seq: int, step: int, task: Task, t: torch.Tensor | None, tree: int | None
    ) -> list[torch.Tensor]:
        raise NotImplementedError

    def device_send(self, dst: int, seq: int, step: int, task: Task, payload: Any) -> None:
        raise NotImplementedError

    def device_receive(
        self,
        src: int,
        step: int,
        task: Task,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        doc: bytes | None,
        rg: bool,
    ) -> None:
        raise NotImplementedError

    def warm_announced(self, src: int) -> None:
        raise NotImplementedError

    def device_control(self, dst: int, msgs: list[torch.Tensor], what: tuple[int, object]) -> None:
        raise NotImplementedError

    def device_close_edges(self, hdr: list[int]) -> None:
        raise NotImplementedError

    def device_close(self, deadline: float) -> None:
        raise NotImplementedError
