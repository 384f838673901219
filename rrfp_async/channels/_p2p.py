"""Message-driven point-to-point channel over torch.distributed (gloo on CPU, NCCL on GPU).

Design note
-----------
Every directed edge (this rank -> a neighbour, a neighbour -> this rank) is one FIFO,
matched by order, so nothing relies on tags (NCCL has none). A message is a fixed-size int64
*header* followed by its payload tensor:

    [magic, kind, seq, step, stage, task kind, microbatch, dtype, ndim, d0 .. d6]

The header names the task the payload feeds, so arrival order is free: a listener posts the
header receive, validates it (magic, sequence number, dtype, rank of the shape, size cap),
allocates a buffer of exactly the announced shape (an undersized gloo receive aborts the
process, an oversized one is silently partly filled; so the header comes first and shapes
may change per microbatch without padding), receives the payload and hands it to the stage
on the event loop (``call_soon_threadsafe``). Nothing is pickled.

gloo point-to-point work has no future and ``is_completed()`` stays False until ``wait()``;
a timed wait that expires closes the pair. So each inbound edge has a *listener thread*
that blocks in ``wait()``, and each outbound edge a *sender thread* fed by a queue: one
thread per outstanding wait, so a late message never blocks an early one and the loop is
never blocked. A failure on either side reaches the stage as ``Sink.fail`` with an error that
names the edge and the sequence number. ``close()`` sends a CLOSE header down every
outbound edge after the queued messages, so peers' listeners end cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
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
MAX_NDIM = HEADER_LEN - 9
_DATA, _CLOSE = 1, 2
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
_NO_PAYLOAD = -1


def encode_header(seq: int, step: int, task: Task, payload: torch.Tensor | None) -> list[int]:
    """The int64 header of a data message (pure; used by tests to forge bad ones)."""
    shape: tuple[int, ...]
    if payload is None:
        dtype, shape = _NO_PAYLOAD, ()
    else:
        if payload.dtype not in _DTYPE_CODE:
            raise ProtocolError(f"cannot send {task}: unsupported dtype {payload.dtype}")
        if payload.dim() > MAX_NDIM:
            raise ProtocolError(f"cannot send {task}: {payload.dim()} dims > {MAX_NDIM}")
        dtype, shape = _DTYPE_CODE[payload.dtype], tuple(payload.shape)
    h = [MAGIC, _DATA, seq, step, task.stage, _KIND_CODE[task.kind], task.mb, dtype, len(shape)]
    h += list(shape) + [0] * (MAX_NDIM - len(shape))
    return h


class _Edge:
    """Names an edge in errors: ``rank 1 -> rank 2 (global 3 -> 5)``."""

    def __init__(self, src: int, dst: int, gsrc: int, gdst: int) -> None:
        self.text = f"edge rank {src} -> rank {dst} (global {gsrc} -> {gdst})"


class P2PChannel:
    """This rank's end of a message-driven point-to-point channel over torch.distributed.

    Args:
        rank: This process's *pipeline* rank.
        global_ranks: Pipeline rank -> global rank of the peer this process talks to (the
            ranks of the same TP and DP index); must include ``rank``.
        inbound: Pipeline ranks that send to this rank (one listener thread each).
        outbound: Pipeline ranks this rank sends to (one sender thread each).
        group: Process group for the transfers (default: the default group).
        device: Where received tensors are allocated (``cuda`` for NCCL).
        max_bytes: Largest payload a header may announce; bigger is a protocol error.

    Use as ``async with channel:`` (starts the threads on the running loop, then closes),
    or call ``start()`` / ``close()`` yourself.
    """

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
    ) -> None:
        self._rank = rank
        self._global = dict(global_ranks)
        self._inbound = sorted(set(inbound))
        self._outbound = sorted(set(outbound))
        for r in [rank, *self._inbound, *self._outbound]:
            if r not in self._global:
                raise ValueError(f"pipeline rank {r} has no global rank in global_ranks")
        self._group = group
        self._device = torch.device(device)
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        self._hdr_device = self._device if backend == "nccl" else torch.device("cpu")
        self._max_bytes = max_bytes
        self._sink: Sink | None = None
        self._pending: list[tuple[int, Task, Any, int]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[
            int, queue.SimpleQueue[tuple[list[int], torch.Tensor | None] | None]
        ] = {}
        self._send_seq: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._failed: BaseException | None = None
        self.sent = 0
        self.received = 0

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
        """Queue ``payload`` (a tensor or None), the input of ``task``, for rank ``dst``."""
        if self._failed is not None:
            raise self._failed
        q = self._queues.get(dst)
        if q is None:
            raise ProtocolError(
                f"rank {self._rank}: no outbound edge to rank {dst} (outbound: {self._outbound});"
                " is the channel started?"
            )
        if payload is not None and not isinstance(payload, torch.Tensor):
            raise ProtocolError(
                f"rank {self._rank}: {task}'s output must be a tensor or None to cross ranks,"
                f" got {type(payload).__name__}"
            )
        t = None if payload is None else payload.detach().contiguous()
        seq = self._send_seq[dst]
        self._send_seq[dst] = seq + 1
        q.put((encode_header(seq, step, task, t), t))

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the listener and sender threads; completions enter ``loop`` (default: the
        running loop)."""
        if self._loop is not None:
            raise RuntimeError("the channel is already started")
        self._loop = loop or asyncio.get_running_loop()
        for dst in self._outbound:
            self._queues[dst] = queue.SimpleQueue()
            self._send_seq[dst] = 0
            self._spawn(self._sender, dst, f"rrfp-send-{self._rank}->{dst}")
        for src in self._inbound:
            self._spawn(self._listener, src, f"rrfp-recv-{src}->{self._rank}")

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
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Flush queued messages, send CLOSE to every outbound peer, and wait (up to
        ``timeout`` s) for the peers' CLOSE on every inbound edge."""
        if self._closing:
            return
        self._closing = True
        for q in self._queues.values():
            q.put(None)
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
        edge = _Edge(self._rank, dst, self._global[self._rank], gdst).text
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
            header, payload = item
            try:
                dist.send(
                    torch.tensor(header, dtype=torch.int64, device=self._hdr_device),
                    gdst,
                    group=self._group,
                )
                if payload is not None:
                    dist.send(payload, gdst, group=self._group)
                self.sent += 1
            except Exception as e:
                self._post(
                    self._fail,
                    PeerError(
                        f"{edge}: sending message seq {header[2]} ({_task_of(header)}) failed: {e}"
                    ),
                )
                return

    def _listener(self, src: int) -> None:
        gsrc = self._global[src]
        edge = _Edge(src, self._rank, gsrc, self._global[self._rank]).text
        expect = 0
        while True:
            hbuf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._hdr_device)
            try:
                dist.recv(hbuf, gsrc, group=self._group)
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
        if h[1] != _DATA:
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
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.empty((), dtype=dtype).element_size()
        if size > self._max_bytes:
            raise bad(f"payload of {size} bytes exceeds max_bytes={self._max_bytes}")
        return False, task, h[3], dtype, shape


def _task_of(h: list[int]) -> str:
    try:
        return str(Task(h[4], _KINDS[h[5]], h[6]))
    except (IndexError, TypeError):
        return "?"
