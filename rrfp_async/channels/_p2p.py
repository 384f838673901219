"""Message-driven point-to-point channel over torch.distributed (gloo; payloads on NCCL).

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
  does not pin a large buffer).
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

**The device path** (``payload_groups``: ``build_groups(p2p_backend="nccl")``, or the
NCCL-rules checker's groups) keeps all of the above for headers and control, on gloo, and
moves payload bytes on a communicator per directed edge, issued by one thread, completed on
comm streams and consumed through events: its own design note is in ``_p2p_device``
(NCCL's rules by construction). ``send`` then packs on the device (``pack_tree_device``, no
host read) and never posts from the caller.

The parts, one module each: ``_p2p_io`` (shared state, inbound-edge state, shared I/O, the
inbox), ``_p2p_send`` (``send``, sender threads), ``_p2p_recv`` (listener and shared I/O
threads, header checks), ``_p2p_control`` (ABORT, CLOSE, failure bookkeeping),
``_p2p_device`` (the device path); the wire format is ``_wire``.

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
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._errors import RRFPError
from .._streams import Device
from .._tasks import Task
from ._base import Sink
from ._p2p_control import ControlPath
from ._p2p_device import DevicePath
from ._p2p_io import (
    DEFAULT_INLINE_SEND_BYTES,
    IO_ENV,
    IO_MODES,
    ChannelState,
    Inbound,
    Inbox,
    IOMode,
    SharedIO,
    edge_text,
)
from ._p2p_recv import ReceivePath
from ._p2p_send import SendPath
from ._wire import DEFAULT_INLINE_BYTES, DEFAULT_MAX_BYTES, HEADER_BYTES, LOST

__all__ = ["IO_ENV", "IOMode", "P2PChannel"]


class P2PChannel(ControlPath, SendPath, ReceivePath, DevicePath, ChannelState):
    """This rank's end of a message-driven point-to-point channel over torch.distributed.

    Args:
        rank: This process's *pipeline* rank.
        global_ranks: Pipeline rank -> global rank of the peer this process talks to (the
            ranks of the same TP and DP index); must include ``rank``.
        inbound: Pipeline ranks that send to this rank (one listener thread each).
        outbound: Pipeline ranks this rank sends to.
        group: gloo process group for the messages (default: the default group): headers,
            inline payloads and control on every path.
        device: Where received tensors are allocated, and the device of the comm streams
            and threads (a CUDA device keeps its index; without one, the current device's).
        max_bytes: Largest payload a header may announce (default 256 MiB): a larger one is
            refused before anything is allocated (``ProtocolError``), and never sent.
        inline_bytes: Initial payload bytes carried inline with the header (it grows to the
            largest payload seen, up to ``max_bytes``). Every rank must use the same value:
            it sizes the peer's receive buffers.
        bound_name: How errors tell the user to raise ``max_bytes`` (``DistributedStage``
            passes its own argument's name).
        inline_send_bytes: Largest payload ``send`` posts itself, from the calling thread
            (gloo path; larger ones go through the edge's sender thread). 0: every payload
            through the sender thread.
        io: How inbound messages are received: ``"per_edge"`` (a listener thread per inbound
            edge) or ``"shared"`` (one I/O thread for every inbound edge, completions handed
            to the loop in batches; see ``SharedIO``). None: the ``RRFP_P2P_IO``
            environment variable, else ``"per_edge"`` (BENCHMARKS.md, "Per message", has
            the two side by side). Every rank of a pipeline must use the same one.
        payload_groups: The device path (see ``_p2p_device``): ``(src, dst)`` pipeline ranks
            -> the NCCL group (2 ranks) that carries that directed edge's payloads, one per
            edge of this rank (``StageGroups.payload``). None: payloads on ``group`` (gloo).

    Raises:
        ValueError: A rank without a global rank, a negative size, an unknown ``io``, an NCCL
            ``group`` (headers need gloo: NCCL payloads go in ``payload_groups``), or an
            edge without its payload group.

    Use as ``async with channel:`` (starts the threads on the running loop, then closes),
    or call ``start()`` / ``close()`` yourself. ``send`` may be called from any thread, one
    thread at a time (``threadsafe_send``): a stage sends an output from its compute thread
    the moment it exists. On the device path, set ``consumer_waits`` when the consumer makes
    its stream wait on each received tensor's event itself (``_streams.wait_ready``: the
    torch executor does); else a payload reaches the sink once its receive completed.
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
        payload_groups: Mapping[tuple[int, int], Any] | None = None,
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
        self._dev = Device(device)
        self._device = self._dev.device
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        if backend == "nccl":
            raise ValueError(
                f"rank {rank}: the channel's group is an NCCL group; headers and control need"
                " gloo (a receive kept posted on an NCCL communicator blocks its stream): pass"
                " the pipeline's gloo group and the NCCL payload communicators as"
                " payload_groups (build_groups(p2p_backend='nccl') makes both)"
            )
        self._growing = True
        self._inline0 = HEADER_BYTES + min(inline_bytes, max_bytes)
        mode = io if io is not None else os.environ.get(IO_ENV, "per_edge")
        if mode not in IO_MODES:
            raise ValueError(f"io must be one of {IO_MODES}, got {mode!r}")
        self._io_mode: IOMode = mode
        self._io: SharedIO | None = None
        self._io_thread_: threading.Thread | None = None
        self._watchers: dict[int, threading.Thread] = {}
        self._inbox: Inbox | None = None
        self._rx: dict[int, Inbound] = {}
        self._closed_in: set[int] = set()  # inbound edges whose CLOSE reached the loop
        self._max_bytes = max_bytes
        self._bound_name = bound_name
        self._sink: Sink | None = None
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_seq = {}
        self._send_cap = {}
        self._queues = {}
        self._locks = {}
        self._queued = {}
        self._unreaped = {}
        self._pg: Any = None
        self._peer_rank: dict[int, int] = {}  # pipeline rank -> rank in the group
        self._inline_send = inline_send_bytes
        self._by_global = {g: r for r, g in self._global.items()}
        # (cause, step, global ranks to blame): what this rank's CLOSE says when it failed.
        self._cause: tuple[int, int, tuple[int, ...]] | None = None
        self._last_step = -1  # the latest step of a message sent or received
        self._arrivals: dict[int, dict[int, int]] = {}  # step -> {src: messages}
        self._peer_failures: dict[int, str] = {}
        self._aborted: set[int] = set()  # steps whose ABORT this rank sent or passed on
        self._threads: list[threading.Thread] = []
        self._copy_streams = {}
        self._started = False
        self._closing = False
        self._failed: BaseException | None = None
        self.consumer_waits = False
        self.sent = 0
        self.received = 0
        self.inline_sent = 0
        self.direct_sent = 0  # posted by ``send`` itself, not the sender thread
        self.device_init(payload_groups)
        if self._dmode:
            self._inline_send = -1  # every message through the issue thread, in order

    # ------------------------------------------------------------------ Endpoint

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The channel's device (a CUDA device with its index)."""
        return self._device

    @property
    def on_device(self) -> bool:
        """Whether payloads travel on payload communicators (the device path)."""
        return self._dmode

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

    def _name(self, rank: int) -> str:
        """``rank 1 (global 3)``: a pipeline rank of this channel, for messages."""
        return f"rank {rank} (global {self._global[rank]})"

    def _names(self, ranks: Iterable[int]) -> str:
        return ", ".join(self._name(r) for r in ranks) or "no rank"

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the sender and listener threads (and the device path's issue thread);
        completions enter ``loop`` (default: the running loop).

        Raises:
            RuntimeError: Started before, or torch.distributed is not initialized.
        """
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
            edge = edge_text(src, self._rank, self._global[src], self._global[self._rank])
            self._rx[src] = Inbound(src, edge, self._inline0)
        self.device_start()
        if self._io_mode == "per_edge":
            for src in self._inbound:
                self._spawn(self._listener, src, f"rrfp-recv-{src}->{self._rank}")
        elif self._inbound:
            self._inbox = Inbox(self._loop)
            self._io = SharedIO(self._inbound)
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

    # ------------------------------------------------------------------ the loop's side

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
