"""The p2p channel's small pieces: rank names, the hand-off to the loop, inbound-edge state,
shared I/O and its inbox.

``P2PChannel`` (``_p2p``) wires parts that own their state, one module each: the loop side
(``_p2p_inlet``: the sink, arrivals, the error the channel broke with), the control messages
(``_p2p_control``: ABORT and CLOSE bookkeeping), one ``Sender`` per outbound edge
(``_p2p_send``), the ``Receiver`` of the inbound edges (``_p2p_recv``) and the device path's
``PayloadPath`` (``_p2p_device``); the wire format is ``_wire``. What they all use is in
this module: ``Names`` (how messages name ranks and edges) and ``LoopPort`` (how a channel
thread hands a call to the loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._bridges import post
from .._tasks import Task

__all__ = [
    "IO_ENV",
    "IO_MODES",
    "IOMode",
    "Inbound",
    "Inbox",
    "Limits",
    "LoopPort",
    "Names",
    "SharedIO",
    "edge_text",
]

DEFAULT_INLINE_SEND_BYTES = 1 << 20
"""Largest payload ``send`` posts from the calling thread (gloo). A gloo send writes in the
calling thread, but where cores are few a sender thread buys no parallelism, only a
hand-off: posting the pipeline's activations from the caller kept the fixed order at par
with torch's ``Schedule1F1B`` where a 32 KiB limit lost to it (BENCHMARKS.md#channel-costs).
Larger messages, which would stall the caller for milliseconds, still go through the edge's
sender thread."""
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


@dataclass(frozen=True)
class Limits:
    """The sizes both ends of a channel's edges agree on, and the caller's own.

    Attributes:
        max_bytes: Largest payload a header may announce (sent or received).
        bound_name: How errors tell the user to raise ``max_bytes``.
        inline0: An edge's initial capacity: header and inline payload bytes.
        inline_send: Largest payload ``send`` posts from the calling thread (-1: none).
    """

    max_bytes: int
    bound_name: str
    inline0: int
    inline_send: int


class Names:
    """How a channel's messages name its ranks and edges (immutable).

    Args:
        rank: This process's pipeline rank.
        global_ranks: Pipeline rank -> global rank, ``rank`` included.
    """

    __slots__ = ("by_global", "global_ranks", "rank")

    def __init__(self, rank: int, global_ranks: dict[int, int]) -> None:
        self.rank = rank
        self.global_ranks = global_ranks
        self.by_global = {g: r for r, g in global_ranks.items()}

    def name(self, rank: int) -> str:
        """``rank 1 (global 3)``: a pipeline rank of this channel."""
        return f"rank {rank} (global {self.global_ranks[rank]})"

    def names(self, ranks: Iterable[int]) -> str:
        """Several pipeline ranks, comma-separated (``no rank`` for none)."""
        return ", ".join(self.name(r) for r in ranks) or "no rank"

    def name_global(self, grank: int) -> str:
        """A global rank, named by its pipeline rank when it is one of this channel's."""
        r = self.by_global.get(grank)
        return f"global rank {grank}" if r is None else self.name(r)

    def names_global(self, granks: Iterable[int]) -> str:
        """Several global ranks (``an unknown rank`` for none)."""
        names = [self.name_global(g) for g in granks]
        return ", ".join(names) if names else "an unknown rank"

    def me(self) -> str:
        """This rank's name."""
        return self.name(self.rank)

    def edge_out(self, dst: int) -> str:
        """The outbound edge to ``dst``, for errors."""
        g = self.global_ranks
        return edge_text(self.rank, dst, g[self.rank], g[dst])

    def edge_in(self, src: int) -> str:
        """The inbound edge from ``src``, for errors."""
        g = self.global_ranks
        return edge_text(src, self.rank, g[src], g[self.rank])


class LoopPort:
    """How the channel's threads hand a call to the event loop: one ``call_soon_threadsafe``
    per call, or, with ``batched`` (shared I/O), through an ``Inbox`` that joins a call to
    the batch not yet drained.

    Args:
        loop: The loop the calls run on.
        batched: Hand calls off in batches (``Inbox``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, batched: bool = False) -> None:
        self.loop = loop
        self.inbox = Inbox(loop) if batched else None

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (from any thread)."""
        if self.inbox is not None:
            self.inbox.post(fn, *args)
        else:
            post(self.loop, fn, *args)


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

    Two things a receive from any source does not do (gloo; BENCHMARKS.md#channel-costs):
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
