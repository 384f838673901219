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
  later one is inline again. The inline payload is a view of the receive buffer (no copy)
  unless it uses less than half of it (then it is copied out, so a stashed activation
  does not pin a large buffer). NCCL needs exact sizes: there the capacity stays at the
  header and every payload is a second message.
* **One sender thread per outbound edge.** ``send`` packs the message where it is called
  (the loop, or the stage's compute thread the moment the output exists) and queues it;
  the edge's sender thread sends it and waits for it. A gloo ``isend`` writes to the socket
  in the calling thread (about 0.5 ms for 200 KiB on this machine), so sending inline
  would stall the computation or the loop that called it; a queue hand-off costs tens of
  µs. One thread per edge keeps each edge a FIFO (the receiver checks sequence numbers)
  and a slow peer from holding up the others. A failed send reaches the stage as
  ``PeerError`` naming the edge and sequence number.
* **One listener thread per inbound edge** blocks in the receive (``is_completed()`` never
  turns true without ``wait()``, and a timed wait that expires closes the pair) and hands
  each message to the loop with ``call_soon_threadsafe``: one thread per outstanding
  receive, so a late message never blocks an early one, and the loop never blocks.

``close()`` sends a CLOSE header down every outbound edge after the messages already
posted, so peers' listeners end cleanly; a peer that closes while a task still waits for
its message fails that task's stage with ``PeerError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PeerError, ProtocolError, RRFPError
from .._tasks import Kind, Task
from ._base import Sink

__all__ = ["HEADER_LEN", "P2PChannel"]

MAGIC = 0x52524650  # "RRFP"
HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAX_NDIM = HEADER_LEN - 9
_DATA, _CLOSE, _DATA_INLINE = 1, 2, 3
DEFAULT_INLINE_BYTES = 1 << 16
"""Initial payload bytes an edge carries inline, behind the header (it grows as needed)."""
_KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")
_KIND_CODE = {k: i for i, k in enumerate(_KINDS)}
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES}
_NO_PAYLOAD = -1


def encode_header(
    seq: int, step: int, task: Task, payload: torch.Tensor | None, *, inline: bool = False
) -> list[int]:
    """The int64 header of a data message (pure; used by tests to forge bad ones).

    ``inline``: the payload follows in the same message (else as a message of its own).
    """
    shape: tuple[int, ...]
    if payload is None:
        dtype, shape = _NO_PAYLOAD, ()
    else:
        if payload.dtype not in _DTYPE_CODE:
            raise ProtocolError(f"cannot send {task}: unsupported dtype {payload.dtype}")
        if payload.dim() > MAX_NDIM:
            raise ProtocolError(f"cannot send {task}: {payload.dim()} dims > {MAX_NDIM}")
        dtype, shape = _DTYPE_CODE[payload.dtype], tuple(payload.shape)
    kind = _DATA_INLINE if inline else _DATA
    h = [MAGIC, kind, seq, step, task.stage, _KIND_CODE[task.kind], task.mb, dtype, len(shape)]
    h += list(shape) + [0] * (MAX_NDIM - len(shape))
    return h


class _Edge:
    """Names an edge in errors: ``rank 1 -> rank 2 (global 3 -> 5)``."""

    def __init__(self, src: int, dst: int, gsrc: int, gdst: int) -> None:
        self.text = f"edge rank {src} -> rank {dst} (global {gsrc} -> {gdst})"


def _grow(cap: int, nbytes: int, limit: int) -> int:
    """The edge capacity after a payload of ``nbytes`` did not fit inline (both sides)."""
    need = HEADER_BYTES + nbytes
    return min(max(cap, need + need // 4), HEADER_BYTES + limit)


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
        max_bytes: Largest payload a header may announce; bigger is a protocol error.
        inline_bytes: Initial payload bytes carried inline with the header (gloo only; it
            grows to the largest payload seen, up to ``max_bytes``). Every rank must use the
            same value: it sizes the peer's receive buffers.

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
        max_bytes: int = 1 << 31,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        self._rank = rank
        self._global = dict(global_ranks)
        self._inbound = sorted(set(inbound))
        self._outbound = sorted(set(outbound))
        for r in [rank, *self._inbound, *self._outbound]:
            if r not in self._global:
                raise ValueError(f"pipeline rank {r} has no global rank in global_ranks")
        if inline_bytes < 0 or max_bytes < 0:
            raise ValueError("inline_bytes and max_bytes must be >= 0")
        self._group = group
        self._device = torch.device(device)
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self._hdr_device = self._device if backend == "nccl" else torch.device("cpu")
        # NCCL matches sizes exactly: no inline payloads there.
        self._growing = backend != "nccl"
        self._inline0 = HEADER_BYTES + min(inline_bytes, max_bytes) if self._growing else 0
        self._max_bytes = max_bytes
        self._sink: Sink | None = None
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_seq: dict[int, int] = {}
        self._send_cap: dict[int, int] = {}
        self._queues: dict[int, queue.SimpleQueue[tuple[list[torch.Tensor], str] | None]] = {}
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closing = False
        self._failed: BaseException | None = None
        self.sent = 0
        self.received = 0
        self.inline_sent = 0

    # ------------------------------------------------------------------ Endpoint

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self._rank

    @property
    def inflight(self) -> int:
        """Unknown across processes: -1."""
        return -1

    def bind(self, sink: Sink) -> None:
        """Route inbound messages to ``sink`` (messages that came earlier are replayed)."""
        self._sink = sink
        pending, self._pending = self._pending, []
        for step, task, payload, src in pending:
            self._deliver(step, task, payload, src)

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        """Send ``payload`` (a tensor or None), the input of ``task``, to rank ``dst``.

        The message is packed now and sent by the edge's sender thread; a failure reaches
        the stage.
        """
        if self._failed is not None:
            raise self._failed
        seq = self._send_seq.get(dst)
        if seq is None or not self._started or self._closing:
            raise ProtocolError(
                f"rank {self._rank}: no open outbound edge to rank {dst} (outbound:"
                f" {self._outbound}); is the channel started?"
            )
        if payload is not None and not isinstance(payload, torch.Tensor):
            raise ProtocolError(
                f"rank {self._rank}: {task}'s output must be a tensor or None to cross ranks,"
                f" got {type(payload).__name__}"
            )
        t = None if payload is None else payload.detach().contiguous()
        nbytes = 0 if t is None else t.numel() * t.element_size()
        if nbytes > self._max_bytes:
            raise ProtocolError(
                f"rank {self._rank}: {task}'s output has {nbytes} bytes > max_bytes="
                f"{self._max_bytes} (the receiver would refuse it)"
            )
        cap = self._send_cap[dst]
        inline = t is None or (self._growing and HEADER_BYTES + nbytes <= cap)
        header = encode_header(seq, step, task, t, inline=inline)
        self._send_seq[dst] = seq + 1
        htensor = torch.tensor(header, dtype=torch.int64, device=self._hdr_device)
        if inline and t is not None:
            buf = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
            buf[:HEADER_BYTES].view(torch.int64).copy_(htensor)
            buf[HEADER_BYTES:].view(t.dtype).view(t.shape).copy_(t)
            msgs = [buf]
            self.inline_sent += 1
        elif inline:
            msgs = [htensor]
            self.inline_sent += 1
        else:
            assert t is not None  # only a payload can be too large to go inline
            msgs = [htensor, t]
            if self._growing:
                self._send_cap[dst] = _grow(cap, nbytes, self._max_bytes)
        self._queues[dst].put((msgs, f"sending message seq {seq} ({task})"))
        self.sent += 1

    def _edge_out(self, dst: int) -> str:
        return _Edge(self._rank, dst, self._global[self._rank], self._global[dst]).text

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the sender and listener threads; completions enter ``loop`` (default: the
        running loop)."""
        if self._loop is not None:
            raise RuntimeError("the channel is already started")
        self._loop = loop or asyncio.get_running_loop()
        for dst in self._outbound:
            self._send_seq[dst] = 0
            self._send_cap[dst] = self._inline0
            self._queues[dst] = queue.SimpleQueue()
            self._spawn(self._sender, dst, f"rrfp-send-{self._rank}->{dst}")
        for src in self._inbound:
            self._spawn(self._listener, src, f"rrfp-recv-{src}->{self._rank}")
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
        self._send_close()
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)

    def _send_close(self) -> None:
        """Queue CLOSE down every outbound edge, behind the messages already queued."""
        if self._closing or not self._started:
            return
        self._closing = True
        for q in self._queues.values():
            q.put(None)

    def close(self, timeout: float = 30.0) -> None:
        """Send CLOSE to every outbound peer (after the messages already posted), and wait
        (up to ``timeout`` s) for the posted sends and for the peers' CLOSE on every inbound
        edge."""
        self._send_close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ threads

    def _post(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed in between
            loop.call_soon_threadsafe(fn, *args)

    def _fail(self, exc: RRFPError) -> None:
        if self._failed is None:
            self._failed = exc
        if self._sink is not None:
            self._sink.fail(exc)

    def _deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        if self._sink is None:
            self._pending.append((step, task, payload, src))
            return
        try:
            self._sink.deliver(step, task, payload, src)
        except RRFPError as e:  # raised inside a loop callback: route it to the stage
            self._sink.fail(e)

    def _peer_closed(self, src: int) -> None:
        if self._closing:
            return
        notify = getattr(self._sink, "peer_closed", None)
        if notify is not None:
            notify(src)

    def _sender(self, dst: int) -> None:
        q = self._queues[dst]
        gdst = self._global[dst]
        edge = self._edge_out(dst)
        while True:
            item = q.get()
            if item is None:
                hdr = [MAGIC, _CLOSE] + [0] * (HEADER_LEN - 2)
                with contextlib.suppress(Exception):  # the peer may be gone already
                    dist.send(
                        torch.tensor(hdr, dtype=torch.int64, device=self._hdr_device),
                        gdst,
                        group=self._group,
                    )
                return
            msgs, what = item
            try:
                for m in msgs:
                    dist.send(m, gdst, group=self._group)
            except Exception as e:
                self._post(self._fail, PeerError(f"{edge}: {what} failed: {e}"))
                return

    def _listener(self, src: int) -> None:
        gsrc = self._global[src]
        edge = _Edge(src, self._rank, gsrc, self._global[self._rank]).text
        expect = 0
        cap = self._inline0
        while True:
            if self._growing:
                raw = torch.empty(cap, dtype=torch.uint8)
                hbuf = raw[:HEADER_BYTES].view(torch.int64)
            else:
                raw = hbuf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._hdr_device)
            try:
                dist.recv(raw, gsrc, group=self._group)
            except Exception as e:
                if not self._closing:
                    self._post(
                        self._fail,
                        PeerError(f"{edge}: waiting for message seq {expect} failed: {e}"),
                    )
                return
            h = hbuf.tolist()
            try:
                closing, task, step, dtype, shape = self._check(h, expect, edge)
            except ProtocolError as e:
                self._post(self._fail, e)
                return
            if closing:
                self._post(self._peer_closed, src)
                return
            payload = None
            if dtype is not None:
                numel = math.prod(shape)
                nbytes = numel * _ITEMSIZE[dtype]
                if h[1] == _DATA_INLINE:
                    if HEADER_BYTES + nbytes > cap:
                        self._post(
                            self._fail,
                            ProtocolError(
                                f"{edge}: message seq {expect} ({task}) announces an inline"
                                f" payload of {nbytes} bytes, more than the edge's capacity"
                                f" {cap - HEADER_BYTES}: the ranks disagree on inline_bytes"
                            ),
                        )
                        return
                    body = raw[HEADER_BYTES : HEADER_BYTES + nbytes]
                    if 2 * (HEADER_BYTES + nbytes) < cap:
                        body = body.clone()  # do not pin the whole buffer
                    payload = body.view(dtype).view(shape)
                else:
                    payload = torch.empty(shape, dtype=dtype, device=self._device)
                    try:
                        dist.recv(payload, gsrc, group=self._group)
                    except Exception as e:
                        if not self._closing:
                            self._post(
                                self._fail,
                                PeerError(
                                    f"{edge}: receiving the payload of seq {expect} ({task})"
                                    f" failed: {e}"
                                ),
                            )
                        return
                    if self._growing:
                        cap = _grow(cap, nbytes, self._max_bytes)
                if payload.device != self._device:
                    payload = payload.to(self._device)
            expect += 1
            self.received += 1
            self._post(self._deliver, step, task, payload, src)

    def _check(
        self, h: list[int], expect: int, edge: str
    ) -> tuple[bool, Task, int, torch.dtype | None, tuple[int, ...]]:
        def bad(why: str) -> ProtocolError:
            return ProtocolError(
                f"{edge}: corrupt or unexpected header at seq {expect}: {why}; header {h}"
            )

        if h[0] != MAGIC:
            raise bad(f"bad magic {h[0]:#x}")
        if h[1] == _CLOSE:
            return True, Task(0, "F", 0), 0, None, ()
        if h[1] not in (_DATA, _DATA_INLINE):
            raise bad(f"unknown message kind {h[1]}")
        if h[2] != expect:
            raise bad(f"sequence number {h[2]}, expected {expect}")
        if not 0 <= h[5] < len(_KINDS) or h[4] < 0 or h[6] < 0 or h[3] < 0:
            raise bad("invalid task or step")
        task = Task(h[4], _KINDS[h[5]], h[6])
        if h[7] == _NO_PAYLOAD:
            return False, task, h[3], None, ()
        if not 0 <= h[7] < len(_DTYPES):
            raise bad(f"unknown dtype code {h[7]}")
        ndim = h[8]
        if not 0 <= ndim <= MAX_NDIM:
            raise bad(f"ndim {ndim} out of range")
        shape = tuple(h[9 : 9 + ndim])
        if any(d < 0 for d in shape):
            raise bad(f"negative dimension in {shape}")
        dtype = _DTYPES[h[7]]
        size = math.prod(shape) * _ITEMSIZE[dtype]
        if size > self._max_bytes:
            raise bad(f"payload of {size} bytes exceeds max_bytes={self._max_bytes}")
        return False, task, h[3], dtype, shape
