"""Message-driven point-to-point channel over torch.distributed (gloo on CPU, NCCL on GPU).

Design note
-----------
Every directed edge (this rank -> a neighbour, a neighbour -> this rank) is one FIFO,
matched by order, so nothing relies on tags (NCCL has none). A message is a fixed-size int64
*header*, then its payload:

    [magic, kind, seq, step, stage, task kind, microbatch, dtype, ndim, d0 .. d6]

The header names the task the payload feeds, so arrival order is free, and it announces
the payload's shape, so shapes may change per microbatch without padding. Nothing is
pickled; every header is validated (magic, sequence number, dtype, rank of the shape,
size cap) and a bad one is a ``ProtocolError`` naming the edge and sequence number.

The lean path (what a message costs is what a step loses):

* **One gloo message per activation.** A gloo receive must be posted with a buffer at least
  as large as the message (smaller aborts the process); a larger one is partly filled. So
  each inbound edge receives into a buffer of the edge's *capacity*, and a payload that fits
  behind the header travels *inline*, in the same message (kind ``DATA_INLINE``). A larger
  payload goes as a header (kind ``DATA``) followed by the payload, and then both sides
  raise the edge's capacity to hold it: the rule reads only the announced size, so sender
  and receiver agree without talking, and after the first large message of a shape every
  later one is inline again. A payload that is not packed (the first of its size, and
  every one on NCCL) is copied at ``send`` when it is the caller's own buffer: a send reads
  its buffer until its work is waited for, and a stage may overwrite its output buffer in
  its next forward (invariant 10; 27 µs per MiB here, paid once per size on gloo). The
  inline payload is a view of the receive buffer (no copy)
  unless it uses less than half of it (then it is copied out, so a stashed activation
  does not pin a large buffer). NCCL needs exact sizes: there the capacity stays at the
  header and every payload is a second message.
* **Small messages leave from the caller; large ones from the edge's sender thread.**
  ``send`` packs the message where it is called (the loop, or the stage's compute thread
  the moment the output exists; the header and an inline payload are ``memmove``d into one
  buffer, a few µs). A message of at most ``inline_send_bytes`` (1 MiB by default) is
  posted right there with the process group's own ``send`` (no ``torch.distributed``
  wrapper, no thread hand-off) when nothing is queued ahead of it on the edge; its work is
  reaped later, in order, by the edge's sender thread (woken once per 16 such messages, and
  at close). A larger message is queued to the sender thread, which posts and waits for it:
  a gloo send writes to the socket in the calling thread (about 0.5 ms for 200 KiB on this
  machine), which for a large message would stall the computation or the loop that called
  it for milliseconds. Per edge, a lock
  and a count of queued messages keep posts in ``send`` order (the receiver checks sequence
  numbers), and a slow peer never holds up the other edges. A failed send reaches the
  stage as ``PeerError`` naming the edge and sequence number.
* **One listener thread per inbound edge** blocks in the receive (into a buffer it reuses
  whenever the payload was copied out, header read with ``struct``) (``is_completed()`` never
  turns true without ``wait()``, and a timed wait that expires closes the pair) and hands
  each message to the loop with ``call_soon_threadsafe``: one thread per outstanding
  receive, so a late message never blocks an early one, and the loop never blocks.
  ``io="shared"`` (opt-in, gloo only) receives every inbound edge in one I/O thread
  instead, with a receive from any source, and hands completions to the loop in batches
  (``_SharedIO``); per message it measured no better (BENCHMARKS.md, "Per message").

``close()`` sends a CLOSE header down every outbound edge after the messages already
posted, so peers' listeners end cleanly; a peer that closes while a task still waits for
its message fails that task's stage with ``PeerError``.

Trust and loss
--------------
* **A header is not trusted with memory.** A receiver allocates what a header announces,
  so an announced payload above ``max_bytes`` (256 MiB by default; ``DistributedStage``'s
  ``max_message_bytes``) is refused before anything is allocated, and a sender refuses to
  send one. Both errors name the bound, the argument that raises it, the edge and the task.
* **A lost peer is named.** A killed peer breaks its TCP connections: the blocked receive
  (or send) raises and the stage fails with ``PeerError`` "rank 0 lost rank 1 (global 1)".
  A stopped (hung) peer breaks nothing; the step watchdog of the waiting rank fires, and
  ``DistributedStage`` names the ranks whose messages did not arrive (``arrivals``).
* **A failing rank says why when it closes.** The CLOSE of a rank that failed carries a
  cause: *lost* (these ranks' connections broke), *timed out* (it waited for these ranks)
  or *failed* (an error of its own), with the step and the global ranks to blame. The
  receiver treats it as any closed peer (its stage fails if a task waits for that peer),
  keeps the cause as text (``peer_failures``; ``DistributedStage`` appends it to the
  step's error) and passes the same cause on when it closes in turn, so a rank that is no
  neighbour of the lost one still names it. The cause is only ever text for a message.

A step fails everywhere or nowhere
----------------------------------
Within one process a failed step is simple: every stage sees it. Across processes a rank
whose step fails (its executor raises, its caller cancels the step, its watchdog fires)
just stops sending that step's messages, and its peers would wait for them until their own
watchdog fires; worse, they then stay a step apart for good. So the failing rank tells
them: ``abort(step, cause)`` sends an ABORT (the step, the global rank where it failed and
the cause as text; see ``_wire``) down every outbound edge. A rank that receives one for a
step it has not heard of yet passes it on down its own outbound edges (except back to the
sender) and hands the stage a ``PeerStepError`` (``step_aborted``): the stage fails that
step at once if it runs, or the moment it starts if it has not started yet, and drops the
step's messages by its number. Hop by hop, every rank of the pipeline learns it within a
few message latencies, whatever its distance from the origin; each rank passes a step's
ABORT on once, so the flood ends. This needs a path from every rank to every other, so a
stage's channel has edges both ways between pipeline neighbours even when its plan sends
only one way (a forward-only plan): an edge that carries no data costs a thread that waits
for the CLOSE.

An ABORT takes no sequence number of the edge (it is posted from the loop thread, while the
compute thread may be sending outputs) and goes through the edge's sender thread. A broken
channel (a lost peer) sends none: the CLOSE carries the cause then, as before. A step that
already ended well on a rank when the ABORT arrives (the origin failed in its last task,
after its last message) cannot fail there any more: the stage records it
(``StageLoop.late_failures``), and ``DistributedStage``'s end-of-step agreement fails it on
every rank.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._bridges import post
from .._errors import PeerError, PeerStepError, ProtocolError, RRFPError
from .._tasks import Task
from ._base import Sink
from ._wire import (
    ABORT,
    CLEAN,
    CLOSE,
    DATA,
    DATA_INLINE,
    DEFAULT_INLINE_BYTES,
    DEFAULT_MAX_BYTES,
    DTYPES,
    FAILED,
    HEADER_BYTES,
    HEADER_LEN,
    ITEMSIZE,
    KINDS,
    LOST,
    MAGIC,
    MAX_ABORT_TEXT,
    MAX_BLAMED,
    MAX_NDIM,
    NO_PAYLOAD,
    REQUIRES_GRAD,
    TIMED_OUT,
    TREE,
    blame_text,
    encode_abort,
    encode_header,
    grow,
    pack_inline,
    pack_tree,
    read_header,
    size_text,
    unpack_inline,
    unpack_tree,
)

__all__ = ["IO_ENV", "IOMode", "P2PChannel"]

DEFAULT_INLINE_SEND_BYTES = 1 << 20
"""Largest payload ``send`` posts from the calling thread (gloo). A gloo send writes in the
calling thread (about 0.5 ms for 200 KiB here), but on this 2-core machine a sender thread
buys no parallelism, only a hand-off: posting the pipeline's activations (up to ~0.6 MB in
``bench peer``) from the caller made the fixed order 1.00x torch ``Schedule1F1B`` against
0.94x with a 32 KiB limit (mean of 3 paired runs). Larger messages, which would stall the
caller for milliseconds, still go through the edge's sender thread."""
_REAP_BATCH = 16
"""Works of messages posted by ``send`` that wake the sender thread to reap them."""
_WATCH_TAG = 1
"""Tag of the BYE that ends a watcher (shared I/O); every other message uses tag 0."""
IO_ENV = "RRFP_P2P_IO"
"""Environment variable: the ``io`` of a channel built without one (``per_edge`` or
``shared``; spawned benchmark ranks inherit it)."""

IOMode = Literal["per_edge", "shared"]
"""How a ``P2PChannel`` receives: a listener thread per inbound edge, or one shared I/O
thread for all of them (see ``_SharedIO``)."""
IO_MODES: tuple[IOMode, ...] = ("per_edge", "shared")


def _storage_ptr(payload: Any) -> int:
    """The address of a tensor payload's storage (-1 for anything else)."""
    if isinstance(payload, torch.Tensor):
        return int(payload.untyped_storage().data_ptr())
    return -1


class _Edge:
    """Names an edge in errors: ``rank 1 -> rank 2 (global 3 -> 5)``."""

    def __init__(self, src: int, dst: int, gsrc: int, gdst: int) -> None:
        self.text = f"edge rank {src} -> rank {dst} (global {gsrc} -> {gdst})"


class _Inbound:
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


class _SharedIO:
    """Shared I/O (``io="shared"``, gloo only): one thread receives every inbound edge.

    The thread posts one receive *from any source* (``recv_anysource``, tag 0) into a buffer
    as large as the largest open edge's capacity, reads the source rank of what completed it
    and runs that edge's checks (sequence number, header, payload) on that edge's state; a
    payload sent as a message of its own is then received from that source alone (it follows
    its header on the same pair). Per pair, gloo keeps the order, so each edge is still a FIFO.
    Completions reach the loop through ``_Inbox``: one ``call_soon_threadsafe`` per batch.

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


class _Inbox:
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


class P2PChannel:
    """This rank's end of a message-driven point-to-point channel over torch.distributed.

    Args:
        rank: This process's *pipeline* rank.
        global_ranks: Pipeline rank -> global rank of the peer this process talks to (the
            ranks of the same TP and DP index); must include ``rank``.
        inbound: Pipeline ranks that send to this rank (one listener thread each).
        outbound: Pipeline ranks this rank sends to.
        group: Process group for the transfers (default: the default group).
        device: Where received tensors are allocated (``cuda`` for NCCL).
        max_bytes: Largest payload a header may announce (default 256 MiB): a larger one is
            refused before anything is allocated (``ProtocolError``), and never sent.
        inline_bytes: Initial payload bytes carried inline with the header (gloo only; it
            grows to the largest payload seen, up to ``max_bytes``). Every rank must use the
            same value: it sizes the peer's receive buffers.
        bound_name: How errors tell the user to raise ``max_bytes`` (``DistributedStage``
            passes its own argument's name).
        inline_send_bytes: Largest payload ``send`` posts itself, from the calling thread
            (gloo only; larger ones go through the edge's sender thread). 0: every payload
            through the sender thread.
        io: How inbound messages are received: ``"per_edge"`` (a listener thread per inbound
            edge) or ``"shared"`` (one I/O thread for every inbound edge, completions handed
            to the loop in batches; gloo only: see ``_SharedIO``). None: the ``RRFP_P2P_IO``
            environment variable, else ``"per_edge"`` (BENCHMARKS.md, "Per message", has
            the two side by side). Every rank of a pipeline must use the same one.

    Raises:
        ValueError: A rank without a global rank, a negative size, an unknown ``io``, or
            ``io="shared"`` on NCCL (it has no receive from any source).

    Use as ``async with channel:`` (starts the threads on the running loop, then closes),
    or call ``start()`` / ``close()`` yourself. ``send`` may be called from any thread, one
    thread at a time (``threadsafe_send``): a stage sends an output from its compute thread
    the moment it exists.
    """

    threadsafe_send = True

    def __init__(
        self,
        rank: int,
        *,
        global_ranks: Mapping[int, int],
        inbound: Iterable[int],
        outbound: Iterable[int],
        group: Any = None,
        device: torch.device | str = "cpu",
        max_bytes: int = DEFAULT_MAX_BYTES,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        bound_name: str = "P2PChannel(max_bytes=...)",
        inline_send_bytes: int = DEFAULT_INLINE_SEND_BYTES,
        io: IOMode | None = None,
    ) -> None:
        self._rank = rank
        self._global = dict(global_ranks)
        self._inbound = sorted(set(inbound))
        self._outbound = sorted(set(outbound))
        for r in [rank, *self._inbound, *self._outbound]:
            if r not in self._global:
                raise ValueError(f"pipeline rank {r} has no global rank in global_ranks")
        if inline_bytes < 0 or max_bytes < 0 or inline_send_bytes < 0:
            raise ValueError("inline_bytes, max_bytes and inline_send_bytes must be >= 0")
        self._group = group
        self._device = torch.device(device)
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self._hdr_device = self._device if backend == "nccl" else torch.device("cpu")
        # NCCL matches sizes exactly: no inline payloads there.
        self._growing = backend != "nccl"
        self._inline0 = HEADER_BYTES + min(inline_bytes, max_bytes) if self._growing else 0
        mode = io if io is not None else os.environ.get(IO_ENV, "per_edge")
        if mode not in IO_MODES:
            raise ValueError(f"io must be one of {IO_MODES}, got {mode!r}")
        if mode == "shared" and not self._growing:
            raise ValueError("io='shared' needs gloo (NCCL has no receive from any source)")
        self._io_mode: IOMode = mode
        self._io: _SharedIO | None = None
        self._io_thread_: threading.Thread | None = None
        self._watchers: dict[int, threading.Thread] = {}
        self._inbox: _Inbox | None = None
        self._rx: dict[int, _Inbound] = {}
        self._closed_in: set[int] = set()  # inbound edges whose CLOSE reached the loop
        self._max_bytes = max_bytes
        self._bound_name = bound_name
        self._sink: Sink | None = None
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_seq: dict[int, int] = {}
        self._send_cap: dict[int, int] = {}
        self._queues: dict[int, queue.SimpleQueue[Any]] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._queued: dict[int, int] = {}
        self._unreaped: dict[int, list[tuple[list[Any], tuple[int, Task]]]] = {}
        self._pg: Any = None
        self._peer_rank: dict[int, int] = {}  # pipeline rank -> rank in the group
        self._inline_send = inline_send_bytes if self._growing else -1
        self._by_global = {g: r for r, g in self._global.items()}
        # (cause, step, global ranks to blame): what this rank's CLOSE says when it failed.
        self._cause: tuple[int, int, tuple[int, ...]] | None = None
        self._last_step = -1  # the latest step of a message sent or received
        self._arrivals: dict[int, dict[int, int]] = {}  # step -> {src: messages}
        self._peer_failures: dict[int, str] = {}
        self._aborted: set[int] = set()  # steps whose ABORT this rank sent or passed on
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closing = False
        self._failed: BaseException | None = None
        self.sent = 0
        self.received = 0
        self.inline_sent = 0
        self.direct_sent = 0  # posted by ``send`` itself, not the sender thread

    # ------------------------------------------------------------------ Endpoint

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self._rank

    @property
    def inflight(self) -> int:
        """Unknown across processes: -1."""
        return -1

    @property
    def io(self) -> IOMode:
        """How inbound messages are received (``"per_edge"`` or ``"shared"``)."""
        return self._io_mode

    @property
    def handoffs(self) -> tuple[int, int]:
        """Shared I/O: (hand-offs to the loop, completions they carried); per-edge I/O
        hands each completion off alone: (-1, -1)."""
        if self._inbox is None:
            return -1, -1
        return self._inbox.batches, self._inbox.items

    def bind(self, sink: Sink) -> None:
        """Route inbound messages to ``sink`` (messages that came earlier are replayed)."""
        self._sink = sink
        pending, self._pending = self._pending, []
        for step, task, payload, src in pending:
            self._replay(step, task, payload, src)

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        """Send ``payload`` (a tensor or None), the input of ``task``, to rank ``dst``.

        The message is packed now; a small one is posted from here, a large one by the
        edge's sender thread (see the design note). A failure reaches the stage.
        """
        if self._failed is not None:
            raise self._failed
        seq = self._send_seq.get(dst)
        if seq is None or not self._started or self._closing:
            raise ProtocolError(
                f"rank {self._rank}: no open outbound edge to rank {dst} (outbound:"
                f" {self._outbound}); is the channel started?"
            )
        tree: int | None = None
        if payload is None or isinstance(payload, torch.Tensor):
            t = payload
            if t is not None:
                rg = t.requires_grad
                t = t.detach()
                if not t.is_contiguous():
                    t = t.contiguous()
                if rg:  # the flag travels (REQUIRES_GRAD), not the graph
                    t = t.view(t.shape).requires_grad_(True)
        else:
            try:
                t, tree = pack_tree(payload)
            except ProtocolError as e:
                raise ProtocolError(
                    f"rank {self._rank} step {step}: cannot send the output for {task}: {e}"
                ) from None
        nbytes = 0 if t is None else t.nbytes
        if nbytes > self._max_bytes:
            assert t is not None
            raise ProtocolError(
                f"rank {self._rank} step {step}: the message for {task} ({tuple(t.shape)}"
                f" {t.dtype}) has {nbytes} bytes, more than the bound of {self._max_bytes}"
                f" bytes ({size_text(self._max_bytes)}) on {self._edge_out(dst)}; the receiver"
                f" would refuse it. If messages this large are expected, raise the bound with"
                f" {self._bound_name} on every rank"
            )
        if step > self._last_step:
            self._last_step = step
        cap = self._send_cap[dst]
        inline = t is None or (self._growing and HEADER_BYTES + nbytes <= cap)
        header = encode_header(seq, step, task, t, inline=inline, tree=tree)
        self._send_seq[dst] = seq + 1
        if inline and self._growing:
            msgs = [pack_inline(header, t)]
            self.inline_sent += 1
        elif inline:
            msgs = [torch.tensor(header, dtype=torch.int64, device=self._hdr_device)]
            self.inline_sent += 1
        else:
            assert t is not None  # only a payload can be too large to go inline
            if self._growing and t.device.type != "cpu":
                t = t.cpu()  # gloo carries CPU tensors (a CUDA payload is staged)
            elif tree is None and t.untyped_storage().data_ptr() == _storage_ptr(payload):
                # A send may read its buffer until its work is waited for (from the sender
                # thread, later), and a producer may reuse its output buffer in its next
                # forward (a CUDA graph's static output): the message gets its own copy, so
                # what is sent is what the buffer held at send() (invariant 10). Inline
                # messages are packed into a buffer of their own already.
                t = t.clone()
            msgs = [torch.tensor(header, dtype=torch.int64, device=self._hdr_device), t]
            if self._growing:
                self._send_cap[dst] = grow(cap, nbytes, self._max_bytes)
        what = (seq, task)
        with self._locks[dst]:
            if nbytes <= self._inline_send and not self._queued[dst]:
                # Nothing queued ahead on this edge: post it from here (no hand-off); the
                # sender thread reaps the works later.
                try:
                    works = [self._pg.send([m], self._peer_rank[dst], 0) for m in msgs]
                except Exception as e:
                    err = PeerError(self._send_failed(dst, what, e))
                    self._post(self._lose, dst, err)  # blame the peer, like a queued send
                    raise err from e
                self.direct_sent += 1
                un = self._unreaped[dst]
                un.append((works, what))
                if len(un) >= _REAP_BATCH:
                    self._queues[dst].put(("reap", un[:]))
                    un.clear()
            else:
                self._queued[dst] += 1
                self._queues[dst].put(("send", [(msgs, what)]))
        self.sent += 1

    def _send_failed(self, dst: int, what: tuple[int, object] | None, e: BaseException) -> str:
        seq, task = what or (-1, None)
        which = f"message seq {seq} ({task})" if seq >= 0 else str(task)
        return (
            f"{self._name(self._rank)} lost {self._name(dst)}: sending {which}"
            f" on {self._edge_out(dst)} failed: {e}"
        )

    def _edge_out(self, dst: int) -> str:
        return _Edge(self._rank, dst, self._global[self._rank], self._global[dst]).text

    def _name(self, rank: int) -> str:
        """``rank 1 (global 3)``: a pipeline rank of this channel, for messages."""
        return f"rank {rank} (global {self._global[rank]})"

    def _names(self, ranks: Iterable[int]) -> str:
        return ", ".join(self._name(r) for r in ranks) or "no rank"

    def _name_global(self, grank: int) -> str:
        """A global rank, named by its pipeline rank when it is one of this channel's."""
        r = self._by_global.get(grank)
        return f"global rank {grank}" if r is None else self._name(r)

    def _names_global(self, granks: Iterable[int]) -> str:
        names = [self._name_global(g) for g in granks]
        return ", ".join(names) if names else "an unknown rank"

    # ------------------------------------------------------------------ failures

    def arrivals(self, step: int) -> dict[int, int]:
        """Messages received for ``step`` so far, per source pipeline rank (the last few
        steps only). ``DistributedStage`` compares them with the plan to name the ranks a
        timed-out step waits for."""
        return dict(self._arrivals.get(step, {}))

    def at_step(self, step: int) -> None:
        """The stage starts ``step`` (the step a failing rank's CLOSE names)."""
        self._last_step = max(self._last_step, step)

    def blame(self, step: int, ranks: Iterable[int], *, timed_out: bool = True) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive: at ``step``
        it timed out waiting for (or lost) the pipeline ranks ``ranks``. The first cause
        recorded wins (it is the closest to the root)."""
        if self._cause is None:
            g = tuple(self._global[r] for r in ranks if r in self._global)[:MAX_BLAMED]
            self._cause = (TIMED_OUT if timed_out else LOST, step, g)

    @property
    def broken(self) -> bool:
        """Whether the channel failed for good (a lost peer, a corrupt message): every later
        step fails, and its CLOSE carries the cause."""
        return self._failed is not None

    def abort(self, step: int, cause: str, *, origin: int | None = None) -> bool:
        """Tell every rank of the pipeline that ``step`` failed (see the design note): send
        an ABORT down every outbound edge, once per step. ``origin`` is the global rank where
        it failed (default: this one); ``cause`` says why (text, cut to 1 KiB). Loop thread.

        Returns:
            Whether it went out: False when this rank sent or passed on an ABORT of the step
            before, or when the channel is not open or broken (a broken channel's CLOSE
            carries the cause instead).
        """
        if step in self._aborted:
            return False
        self._aborted.add(step)
        if not self._started or self._closing or self._failed is not None:
            return False
        self._send_abort(step, self._global[self._rank] if origin is None else origin, cause)
        return True

    def _send_abort(self, step: int, origin: int, cause: str, skip: int | None = None) -> None:
        header, text = encode_abort(step, origin, cause)
        what = (-1, f"the ABORT of step {step}")
        for dst, q in self._queues.items():
            if dst == skip:
                continue
            msgs = [torch.tensor(header, dtype=torch.int64, device=self._hdr_device)]
            if text:
                msgs.append(
                    torch.frombuffer(bytearray(text), dtype=torch.uint8).to(self._hdr_device)
                )
            # Through the sender thread, behind everything posted on the edge: no sequence
            # number, no capacity change (see the design note).
            with self._locks[dst]:
                self._queued[dst] += 1
                q.put(("send", [(msgs, what)]))

    def _peer_aborted(self, src: int, step: int, origin: int, cause: str) -> None:
        """An ABORT of ``step`` came from ``src`` (loop thread): pass it on once, and fail the
        step here (see the design note)."""
        if step in self._aborted:
            return
        self._aborted.add(step)
        if not self._closing and self._failed is None:
            self._send_abort(step, origin, cause, skip=src)
        where = self._name_global(origin)
        exc = PeerStepError(
            f"{self._name(self._rank)}: step {step} failed on {where}: {cause}; this rank fails"
            " the step too (its late messages are dropped) and runs the next one",
            step=step,
            origin=origin,
            cause=cause,
        )
        notify = getattr(self._sink, "step_aborted", None)
        if notify is not None:
            notify(step, exc)

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the sender and listener threads; completions enter ``loop`` (default: the
        running loop)."""
        if self._loop is not None:
            raise RuntimeError("the channel is already started")
        self._loop = loop or asyncio.get_running_loop()
        peers = [*self._inbound, *self._outbound]
        if peers:  # the process group's own send/recv, with ranks in the group
            pg = dist.group.WORLD if self._group is None else self._group
            if pg is None:
                raise RuntimeError("P2PChannel.start: torch.distributed is not initialized")
            self._pg = pg
            for r in peers:
                self._peer_rank[r] = dist.get_group_rank(pg, self._global[r])
        for dst in self._outbound:
            self._send_seq[dst] = 0
            self._send_cap[dst] = self._inline0
            self._queues[dst] = queue.SimpleQueue()
            self._locks[dst] = threading.Lock()
            self._queued[dst] = 0
            self._unreaped[dst] = []
            self._spawn(self._sender, dst, f"rrfp-send-{self._rank}->{dst}")
        for src in self._inbound:
            edge = _Edge(src, self._rank, self._global[src], self._global[self._rank]).text
            self._rx[src] = _Inbound(src, edge, self._inline0)
        if self._io_mode == "per_edge":
            for src in self._inbound:
                self._spawn(self._listener, src, f"rrfp-recv-{src}->{self._rank}")
        elif self._inbound:
            self._inbox = _Inbox(self._loop)
            self._io = _SharedIO(self._inbound)
            for src in self._inbound:
                w = threading.Thread(
                    target=self._watch,
                    args=(src,),
                    name=f"rrfp-watch-{src}->{self._rank}",
                    daemon=True,
                )
                w.start()
                self._watchers[src] = w
            t = threading.Thread(target=self._io_thread, name=f"rrfp-io-{self._rank}", daemon=True)
            t.start()
            self._io_thread_ = t
        self._started = True

    def _spawn(self, fn: Any, peer: int, name: str) -> None:
        t = threading.Thread(target=fn, args=(peer,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    async def __aenter__(self) -> P2PChannel:
        self.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        # On an error, peers may never send their CLOSE: do not wait for them.
        timeout = 30.0 if exc_type is None else 0.5
        self._send_close(failed=exc_type is not None)
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)

    def _send_close(self, *, failed: bool = False) -> None:
        """Queue CLOSE down every outbound edge, behind the messages already queued; the
        CLOSE of a failed rank carries its cause (see the design note)."""
        if self._closing or not self._started:
            return
        self._closing = True
        hdr = [MAGIC, CLOSE] + [0] * (HEADER_LEN - 2)
        if failed:
            cause, step, ranks = self._cause or (
                FAILED,
                self._last_step,
                (self._global[self._rank],),
            )
            hdr[2:5] = [cause, step, len(ranks)]
            hdr[5 : 5 + len(ranks)] = list(ranks)
        for dst, q in self._queues.items():
            with self._locks[dst]:
                un = self._unreaped[dst]
                if un:
                    q.put(("reap", list(un)))
                    un.clear()
                self._queued[dst] += 1
                msg = torch.tensor(hdr, dtype=torch.int64, device=self._hdr_device)
                q.put(("send", [([msg], None)]))
                if self._io_mode == "shared":  # ends the peer's watcher of this edge
                    q.put(("bye", [msg]))
                q.put(None)

    def close(self, timeout: float = 30.0) -> None:
        """Send CLOSE to every outbound peer (after the messages already posted), and wait
        (up to ``timeout`` s) for the posted sends and for the peers' CLOSE on every inbound
        edge."""
        self._send_close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        io, io_thread = self._io, self._io_thread_
        if io is not None and io_thread is not None:
            # Done once every edge closed or broke; a broken edge leaves the receive from
            # any source blocked (it never fails), so the thread is joined only when none did.
            io.done.wait(max(0.0, deadline - time.monotonic()))
            if not io.broke:
                io_thread.join(max(0.0, deadline - time.monotonic()))
            # The BYE follows the CLOSE: the watchers of closed edges end at once (so none is
            # left to take a later channel's BYE on this group); the others wait for nothing
            # that will come (the I/O thread failed, or their connection broke).
            for src, w in self._watchers.items():
                if self._rx[src].closed:
                    w.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ threads

    def _post(self, fn: Any, *args: Any) -> None:
        if self._inbox is not None:
            self._inbox.post(fn, *args)
        else:
            post(self._loop, fn, *args)

    def _fail(self, exc: RRFPError) -> None:
        if self._failed is None:
            self._failed = exc
        if self._sink is not None:
            self._sink.fail(exc)

    def _lose(self, peer: int, exc: RRFPError) -> None:
        """``peer``'s connection broke (loop thread): blame it, then fail."""
        if self._cause is None:
            self._cause = (LOST, self._last_step, (self._global[peer],))
        self._fail(exc)

    def _peer_failed(self, src: int, cause: int, step: int, ranks: tuple[int, ...]) -> None:
        """``src`` closed because it failed (loop thread): keep its cause for the error
        message, pass it on when this rank closes, and tell the stage the peer closed."""
        self._closed_in.add(src)
        if self._cause is None:
            self._cause = (cause, step, ranks)
        if cause == FAILED and ranks == (self._global[src],):
            why = " with an error of its own (see that rank's output)"
        else:
            why = ": " + blame_text(cause, self._names_global(ranks))
        self._peer_failures[src] = f"{self._name(src)} failed at step {step}{why}"
        self._peer_closed(src)

    def peer_failures(self) -> dict[int, str]:
        """Why peers failed, from their CLOSE: pipeline rank -> text (``DistributedStage``
        appends it to the error of a step that lost them)."""
        return dict(self._peer_failures)

    def _deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        got = self._arrivals.get(step)
        if got is None:
            got = self._arrivals[step] = {}
            for old in [s for s in self._arrivals if s < step - 3]:
                del self._arrivals[old]
        got[src] = got.get(src, 0) + 1
        if self._sink is None:
            self._pending.append((step, task, payload, src))
            return
        try:
            self._sink.deliver(step, task, payload, src)
        except Exception as e:  # raised inside a loop callback: route it to the stage
            self._sink.fail(e)

    def _replay(self, step: int, task: Task, payload: Any, src: int) -> None:
        """A message that came before ``bind`` (counted already)."""
        assert self._sink is not None
        try:
            self._sink.deliver(step, task, payload, src)
        except Exception as e:  # a loop callback too
            self._sink.fail(e)

    def _peer_closed(self, src: int) -> None:
        self._closed_in.add(src)
        if self._closing:
            return
        notify = getattr(self._sink, "peer_closed", None)
        if notify is not None:
            notify(src)

    def _sender(self, dst: int) -> None:
        q = self._queues[dst]
        peer = self._peer_rank[dst]
        lock = self._locks[dst]
        while True:
            item = q.get()
            if item is None:
                return
            kind, entries = item
            what = None
            try:
                if kind == "bye":
                    self._pg.send(entries, peer, _WATCH_TAG).wait()
                    continue
                if kind == "send":
                    ((msgs, what),) = entries
                    with lock:
                        try:
                            works = [self._pg.send([m], peer, 0) for m in msgs]
                        finally:
                            self._queued[dst] -= 1
                    for w in works:
                        w.wait()
                else:  # reap what send() posted itself, in order
                    for works, what in entries:  # noqa: B007 (named in the error)
                        for w in works:
                            w.wait()
            except Exception as e:
                if what is None:  # the CLOSE: the peer may be gone already
                    return
                self._post(self._lose, dst, PeerError(self._send_failed(dst, what, e)))
                return

    def _listener(self, src: int) -> None:
        """Per-edge I/O: this edge's own thread blocks in its receive."""
        rx = self._rx[src]
        raw: torch.Tensor | None = None  # reused while nothing kept a view of it
        while True:
            if raw is None or raw.numel() < rx.cap:
                raw = self._buffer(rx.cap)
            # The text is built only on a failure, inside the call (before the loop moves on).
            if not self._recv_or_lose(
                raw, src, lambda: f"waiting for message seq {rx.expect} on {rx.edge} ({rx.last()})"
            ):
                return
            more, kept = self._on_message(rx, raw)
            if kept:
                raw = None
            if not more:
                return

    def _buffer(self, cap: int) -> torch.Tensor:
        if self._growing:
            return torch.empty(cap, dtype=torch.uint8)
        return torch.empty(HEADER_LEN, dtype=torch.int64, device=self._hdr_device)

    def _io_thread(self) -> None:
        """Shared I/O: one thread receives every inbound edge's messages (see the note at
        ``_SharedIO``)."""
        io = self._io
        assert io is not None
        rxs = {self._peer_rank[src]: self._rx[src] for src in self._inbound}
        raw: torch.Tensor | None = None
        try:
            while io.open:
                # Large enough for every open edge's capacity: a smaller buffer aborts the
                # process, a larger one is partly filled.
                cap = max((rx.cap for rx in rxs.values() if rx.open), default=self._inline0)
                if raw is None or raw.numel() < cap:
                    raw = self._buffer(cap)
                try:
                    work = self._pg.recv_anysource([raw], 0)
                    work.wait()
                    g = work.source_rank()
                except Exception as e:
                    if not self._closing:
                        self._post(
                            self._fail,
                            PeerError(
                                f"{self._name(self._rank)}: the shared receive on the inbound"
                                f" edges from {self._names(io.waiting())} failed: {e}"
                            ),
                        )
                    return
                rx = rxs.get(g)
                if rx is None or not rx.open:
                    self._post(
                        self._fail,
                        ProtocolError(
                            f"{self._name(self._rank)}: a message from group rank {g}, which is"
                            f" no open inbound edge (open: {self._names(io.waiting())})"
                        ),
                    )
                    return
                more, kept = self._on_message(rx, raw)
                if kept:
                    raw = None
                if not more:
                    if rx.closed:  # its CLOSE: the edge is done
                        rx.open = False
                        io.end(rx.src)
                        continue
                    return  # a corrupt message or a broken pair: the channel failed
        finally:
            io.end_all()

    def _watch(self, src: int) -> None:
        """Shared I/O: a receive posted on ``src``'s own pair (tag 1) that only the peer's
        BYE completes, after its CLOSE; it raises when the connection breaks, which a
        receive from any source does not (see ``_SharedIO``)."""
        rx = self._rx[src]
        bye = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            self._pg.recv([bye], self._peer_rank[src], _WATCH_TAG).wait()
        except Exception as e:
            if not self._closing:
                err = PeerError(
                    f"{self._name(self._rank)} lost {self._name(src)}: the connection broke"
                    f" while waiting for message seq {rx.expect} on {rx.edge} ({rx.last()}): {e}"
                )
                self._post(self._watch_lost, src, err)
            assert self._io is not None
            self._io.lost(src)  # nothing more comes from it: the I/O thread need not wait

    def _watch_lost(self, src: int, exc: RRFPError) -> None:
        """``src``'s pair broke (loop thread; shared I/O): blame it unless its CLOSE came."""
        if src not in self._closed_in:
            self._lose(src, exc)

    def _on_message(self, rx: _Inbound, raw: torch.Tensor) -> tuple[bool, bool]:
        """A message from ``rx.src`` is in ``raw`` (its I/O thread): check it, receive the
        rest (a payload sent on its own, an ABORT's text) and hand it to the loop.

        Returns:
            (more, kept): ``more`` False when nothing more may be received on the edge (its
            CLOSE, a corrupt message, a broken pair); ``kept`` when ``raw`` must not be
            reused (the payload is a view of it).
        """
        src, edge, expect = rx.src, rx.edge, rx.expect
        h = read_header(raw)
        if h[0] == MAGIC and h[1] == ABORT:
            return self._receive_abort(h, src, edge), False
        try:
            closing, task, step, dtype, shape = self._check(h, expect, edge)
            code = h[7] & ~REQUIRES_GRAD if h[7] >= 0 else h[7]
            rg = h[7] >= 0 and bool(h[7] & REQUIRES_GRAD)
            tree_len = h[10] if code == TREE else 0
        except ProtocolError as e:
            self._post(self._fail, e)
            return False, False
        if closing:
            rx.closed = True
            if h[2] == CLEAN:
                self._post(self._peer_closed, src)
            else:
                n = min(max(h[4], 0), MAX_BLAMED)
                self._post(self._peer_failed, src, h[2], h[3], tuple(h[5 : 5 + n]))
            return False, False
        payload: Any = None
        kept = False
        if dtype is not None:
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            if h[1] == DATA_INLINE:
                if HEADER_BYTES + nbytes > rx.cap:
                    self._post(
                        self._fail,
                        ProtocolError(
                            f"{edge}: message seq {expect} ({task}) announces an inline"
                            f" payload of {nbytes} bytes, more than the edge's capacity"
                            f" {rx.cap - HEADER_BYTES}: the ranks disagree on inline_bytes"
                        ),
                    )
                    return False, False
                if 2 * (HEADER_BYTES + nbytes) < raw.numel():
                    # Copied out (the buffer is reused); a view would pin all of it.
                    payload = unpack_inline(raw, dtype, shape, nbytes)
                else:
                    body = raw[HEADER_BYTES : HEADER_BYTES + nbytes]
                    payload = body.view(dtype).view(shape)
                    kept = True  # the payload is a view of it
            else:
                # gloo carries CPU tensors: a CUDA payload lands on the CPU first.
                where = "cpu" if self._growing else self._device
                payload = torch.empty(shape, dtype=dtype, device=where)
                if not self._recv_or_lose(
                    payload,
                    src,
                    lambda: (
                        f"receiving the payload of seq {expect} ({task} of step {step}) on {edge}"
                    ),
                ):
                    return False, False
                if self._growing:
                    # The next receive needs the larger buffer (its caller sees rx.cap).
                    rx.cap = grow(rx.cap, nbytes, self._max_bytes)
            if code == TREE:
                try:
                    payload = unpack_tree(payload, tree_len, self._device)
                except ProtocolError as e:
                    self._post(
                        self._fail,
                        ProtocolError(f"{edge}: message seq {expect} ({task} of step {step}): {e}"),
                    )
                    return False, False
            else:
                if payload.device != self._device:
                    payload = payload.to(self._device)
                if rg and payload.is_floating_point():
                    payload.requires_grad_(True)
        rx.expect = expect + 1
        rx.prev = (task, step)
        if step > self._last_step:
            self._last_step = step
        self.received += 1
        self._post(self._deliver, step, task, payload, src)
        return True, kept

    def _recv_or_lose(self, buf: torch.Tensor, src: int, doing: Callable[[], str]) -> bool:
        """Listener thread: receive ``buf`` from ``src``; False (after blaming ``src``
        unless this rank is closing) when the connection broke ``doing`` what it says."""
        try:
            self._pg.recv([buf], self._peer_rank[src], 0).wait()
        except Exception as e:
            if not self._closing:
                err = PeerError(
                    f"{self._name(self._rank)} lost {self._name(src)}: the connection broke"
                    f" while {doing()}: {e}"
                )
                self._post(self._lose, src, err)
            return False
        return True

    def _receive_abort(self, h: list[int], src: int, edge: str) -> bool:
        """Listener thread: an ABORT header arrived from ``src``; receive its text and hand
        it to the loop. False when the listener must end (a bad header, a broken pair)."""
        step, origin, n = h[3], h[4], h[5]
        if step < 0 or origin < 0 or not 0 <= n <= MAX_ABORT_TEXT:
            self._post(
                self._fail,
                ProtocolError(
                    f"{edge}: corrupt ABORT header (step, origin, text bytes); header {h}"
                ),
            )
            return False
        cause = ""
        if n:
            text = torch.empty(n, dtype=torch.uint8, device=self._hdr_device)
            if not self._recv_or_lose(
                text, src, lambda: f"receiving the ABORT of step {step} on {edge}"
            ):
                return False
            cause = bytes(text.cpu().tolist()).decode("utf-8", "replace")
        self._post(self._peer_aborted, src, step, origin, cause)
        return True

    def _check(
        self, h: list[int], expect: int, edge: str
    ) -> tuple[bool, Task, int, torch.dtype | None, tuple[int, ...]]:
        def bad(why: str) -> ProtocolError:
            return ProtocolError(
                f"{edge}: corrupt or unexpected header at seq {expect}: {why}; header {h}"
            )

        if h[0] != MAGIC:
            raise bad(f"bad magic {h[0]:#x}")
        if h[1] == CLOSE:
            if h[2] not in (CLEAN, FAILED, LOST, TIMED_OUT):
                raise bad(f"unknown close cause {h[2]}")
            return True, Task(0, "F", 0), 0, None, ()
        if h[1] not in (DATA, DATA_INLINE):
            raise bad(f"unknown message kind {h[1]}")
        if h[2] != expect:
            raise bad(f"sequence number {h[2]}, expected {expect}")
        if not 0 <= h[5] < len(KINDS) or h[4] < 0 or h[6] < 0 or h[3] < 0:
            raise bad("invalid task or step")
        task = Task(h[4], KINDS[h[5]], h[6])
        if h[7] == NO_PAYLOAD:
            return False, task, h[3], None, ()
        code = h[7] & ~REQUIRES_GRAD if h[7] >= 0 else h[7]
        if code == TREE:
            total, doc = h[9], h[10]
            if h[8] != 2 or not 0 <= doc <= total:
                raise bad(f"a pytree payload needs shape (total, structure), got {h[8:11]}")
            if total > self._max_bytes:
                raise ProtocolError(
                    f"{edge}: message seq {expect} ({task} of step {h[3]}) announces a pytree"
                    f" payload of {total} bytes, more than the bound of {self._max_bytes}"
                    f" bytes ({size_text(self._max_bytes)}): refused before allocating it. If"
                    f" messages this large are expected, raise the bound with"
                    f" {self._bound_name} on every rank; header {h}"
                )
            return False, task, h[3], torch.uint8, (total,)
        if not 0 <= code < len(DTYPES):
            raise bad(f"unknown dtype code {h[7]}")
        ndim = h[8]
        if not 0 <= ndim <= MAX_NDIM:
            raise bad(f"ndim {ndim} out of range")
        shape = tuple(h[9 : 9 + ndim])
        if any(d < 0 for d in shape):
            raise bad(f"negative dimension in {shape}")
        dtype = DTYPES[code]
        size = math.prod(shape) * ITEMSIZE[dtype]
        if size > self._max_bytes:
            # Refused before anything is allocated: a header is not trusted with memory.
            raise ProtocolError(
                f"{edge}: message seq {expect} ({task} of step {h[3]}) announces a payload of"
                f" {size} bytes ({shape} {dtype}), more than the bound of {self._max_bytes}"
                f" bytes ({size_text(self._max_bytes)}): refused before allocating it. If messages"
                f" this large are expected, raise the bound with {self._bound_name} on every"
                f" rank (else the header is corrupt); header {h}"
            )
        return False, task, h[3], dtype, shape
