"""The p2p channel's receive side: the ``Receiver`` of every inbound edge, with a listener
thread per edge, or the shared I/O thread and its watchers, and the header checks.

Every thread of the ``Receiver`` blocks in gloo only (headers, inline payloads, control
messages): on the device path a header that announces a device payload is handed to the
``PayloadPath`` (``_p2p_device``), whose issue thread posts its receive on the edge's
payload communicator. What a thread learns goes to the loop through the ``LoopPort``: a
message to the ``Inlet``, an ABORT or a CLOSE to the ``ControlPath``. See ``P2PChannel``'s
design note (``_p2p``).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._errors import PeerError, ProtocolError, RRFPError
from .._resources import start_thread
from .._streams import Device
from .._tasks import Task
from ._p2p_control import ControlPath
from ._p2p_inlet import Inlet
from ._p2p_io import WATCH_TAG, Inbound, IOMode, Limits, LoopPort, Names, SharedIO
from ._wire import (
    ABORT,
    CLEAN,
    CLOSE,
    CLOSE_CAUSES,
    DATA,
    DATA_DEVICE,
    DATA_INLINE,
    DTYPES,
    HEADER_BYTES,
    HEADER_LEN,
    ITEMSIZE,
    KINDS,
    MAGIC,
    MAX_BLAMED,
    MAX_NDIM,
    NO_PAYLOAD,
    PLAN_FIELD,
    REQUIRES_GRAD,
    TREE,
    WARMUP,
    decode_abort,
    grow,
    read_header,
    size_text,
    unpack_inline,
    unpack_tree,
)

if TYPE_CHECKING:
    from ._p2p_device import PayloadPath

_LOSS_GRACE_S = 0.5
"""Seconds the shared receive, failed, leaves an edge's watcher to name the rank it lost."""

__all__ = ["Receiver"]

_Checked = tuple[bool, Task, int, torch.dtype | None, tuple[int, ...]]


class Receiver:
    """The inbound edges of a channel: owns each edge's receive state (``Inbound``), the
    threads that receive them and the header checks.

    Args:
        names: How messages name ranks and edges.
        pg: The gloo process group (its own ``recv``, ranks in the group).
        peers: Source pipeline rank -> its rank in ``pg``, one per inbound edge.
        dev: The stage's device (received payloads land there).
        limits: The channel's sizes (``Limits``).
        io: ``"per_edge"`` (a listener thread per edge) or ``"shared"`` (``SharedIO``).
        port: Hands calls to the loop.
        inlet: Takes the messages and the errors that fail the channel (loop thread).
        control: Takes ABORTs, CLOSEs and lost peers (loop thread); its ``closing`` tells
            expected errors (this rank closed) from losses.
        payload: The device path (None on gloo): device payloads' receives, and the order
            in which what a listener learned reaches the loop.
    """

    def __init__(
        self,
        *,
        names: Names,
        pg: Any,
        peers: Mapping[int, int],
        dev: Device,
        limits: Limits,
        io: IOMode,
        port: LoopPort,
        inlet: Inlet,
        control: ControlPath,
        payload: PayloadPath | None = None,
    ) -> None:
        self._names = names
        self._pg = pg
        self._peer_rank = dict(peers)
        self._inbound = sorted(peers)
        self._dev = dev
        self._limits = limits
        self._max_bytes = limits.max_bytes
        self._post = port.post
        self._inlet = inlet
        self._control = control
        self._payload = payload
        self._dmode = payload is not None
        self._rx = {s: Inbound(s, names.edge_in(s), limits.inline0) for s in self._inbound}
        self._copy_streams: dict[int, Any] = {}  # a CUDA stage on gloo: a source's stream
        self._threads: list[threading.Thread] = []
        self._io: SharedIO | None = None
        self._io_thread_: threading.Thread | None = None
        self._watchers: dict[int, threading.Thread] = {}
        self._shared = io == "shared"
        self.received = 0

    @property
    def _closing(self) -> bool:
        return self._control.closing

    def _post_rx(self, fn: Callable[..., object], *args: Any) -> None:
        """Hand what an inbound edge's listener learned to the loop *in that edge's order*:
        on the device path a payload reaches the loop from the issue thread, so everything
        after it (the next messages, the CLOSE) is handed on through that thread's queue."""
        if self._payload is not None:
            self._payload.post_in_order(fn, *args)
        else:
            self._post(fn, *args)

    def _fail(self, exc: RRFPError) -> None:
        self._post(self._inlet.fail, exc)

    def _lose(self, src: int, exc: RRFPError) -> None:
        self._post(self._control.lose, src, exc)

    def start(self) -> None:
        """Start the receiving threads."""
        rank = self._names.rank
        if not self._shared:
            for src in self._inbound:
                self._spawn(self._listener, src, f"rrfp-recv-{src}->{rank}")
            return
        if not self._inbound:
            return
        self._io = SharedIO(self._inbound)
        for src in self._inbound:
            w = threading.Thread(
                target=self._watch, args=(src,), name=f"rrfp-watch-{src}->{rank}", daemon=True
            )
            start_thread(w, self._names.me(), "the p2p channel's watcher")
            self._watchers[src] = w
        t = threading.Thread(target=self._io_thread, name=f"rrfp-io-{rank}", daemon=True)
        start_thread(t, self._names.me(), "the p2p channel's receiver")
        self._io_thread_ = t

    def _spawn(self, fn: Any, peer: int, name: str) -> None:
        t = threading.Thread(target=fn, args=(peer,), name=name, daemon=True)
        start_thread(t, self._names.me(), "the p2p channel's receiver")
        self._threads.append(t)

    def join(self, deadline: float, clock: Callable[[], float]) -> None:
        """Wait until ``deadline`` (on ``clock``) for the peers' CLOSE on every inbound edge
        (the threads that receive them end)."""
        for t in self._threads:
            t.join(max(0.0, deadline - clock()))
        io, io_thread = self._io, self._io_thread_
        if io is not None and io_thread is not None:
            # Done once every edge closed or broke; a broken edge leaves the receive from
            # any source blocked (it never fails), so the thread is joined only when none did.
            io.done.wait(max(0.0, deadline - clock()))
            if not io.broke:
                io_thread.join(max(0.0, deadline - clock()))
            # The BYE follows the CLOSE: the watchers of closed edges end at once (so none is
            # left to take a later channel's BYE on this group); the others wait for nothing
            # that will come (the I/O thread failed, or their connection broke).
            for src, w in self._watchers.items():
                if self._rx[src].closed:
                    w.join(max(0.0, deadline - clock()))

    def outliving(self) -> list[threading.Thread]:
        """The threads still blocked after ``join`` that a peer's close or exit may end
        (``_strays``). The shared receive of a broken edge among them: gloo does not fail it
        for the broken pair, but it returns when the other peers' connections close (their
        exit, a moment later); if that happens while the interpreter finalizes, its thread
        frees the receive's ``Work`` and aborts the process (fault campaign, seed 3000006)."""
        out = [t for t in self._threads if t.is_alive()]
        io = self._io
        if io is not None and self._io_thread_ is not None:
            out.append(self._io_thread_)
        out += [w for w in self._watchers.values() if w.is_alive()]
        return [t for t in out if t.is_alive()]

    def _listener(self, src: int) -> None:
        """Per-edge I/O: this edge's own thread blocks in its receive."""
        self._dev.bind_thread()
        rx = self._rx[src]
        raw: torch.Tensor | None = None  # reused (payloads are copied out of it)
        while True:
            if raw is None or raw.numel() < rx.cap:
                raw = self._host_buffer(rx.cap)
            # The text is built only on a failure, inside the call (before the loop moves on).
            if not self._recv_or_lose(
                raw, src, lambda: f"waiting for message seq {rx.expect} on {rx.edge} ({rx.last()})"
            ):
                return
            if not self._on_message(rx, raw):
                return

    def _io_thread(self) -> None:
        """Shared I/O: one thread receives every inbound edge's messages (see the note at
        ``SharedIO``)."""
        io = self._io
        assert io is not None
        self._dev.bind_thread()
        rxs = {self._peer_rank[src]: self._rx[src] for src in self._inbound}
        raw: torch.Tensor | None = None
        try:
            while io.open:
                # Large enough for every open edge's capacity: a smaller buffer aborts the
                # process, a larger one is partly filled.
                cap = max((rx.cap for rx in rxs.values() if rx.open), default=self._limits.inline0)
                if raw is None or raw.numel() < cap:
                    raw = self._host_buffer(cap)
                try:
                    work = self._pg.recv_anysource([raw], 0)
                    work.wait()
                    g = work.source_rank()
                except Exception as e:
                    # A broken pair can fail the receive from any source too (gloo's text
                    # names an address): the edge's watcher names the lost rank, a moment
                    # later on its own thread; its report goes first.
                    if not self._closing:
                        time.sleep(_LOSS_GRACE_S)
                    if not self._closing and self._inlet.failed is None:
                        self._fail(
                            PeerError(
                                f"{self._names.me()}: the shared receive on the inbound"
                                f" edges from {self._names.names(io.waiting())} failed: {e}"
                            ),
                        )
                    return
                rx = rxs.get(g)
                if rx is None or not rx.open:
                    self._fail(
                        ProtocolError(
                            f"{self._names.me()}: a message from group rank {g}, which is"
                            f" no open inbound edge (open: {self._names.names(io.waiting())})"
                        ),
                    )
                    return
                if not self._on_message(rx, raw):
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
        receive from any source does not (see ``SharedIO``)."""
        rx = self._rx[src]
        bye = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            self._pg.recv([bye], self._peer_rank[src], WATCH_TAG).wait()
        except Exception as e:
            if not self._closing:
                err = PeerError(
                    f"{self._names.me()} lost {self._names.name(src)}: the connection broke"
                    f" while waiting for message seq {rx.expect} on {rx.edge} ({rx.last()}): {e}"
                )
                self._post(self._control.watch_lost, src, err)
            assert self._io is not None
            self._io.lost(src)  # nothing more comes from it: the I/O thread need not wait

    def _on_message(self, rx: Inbound, raw: torch.Tensor) -> bool:
        """A message from ``rx.src`` is in ``raw`` (its I/O thread): check it, receive the
        rest (a payload sent on its own, an ABORT's text, a device payload's structure) and
        hand it to the loop (a device payload: to the issue thread).

        Returns:
            False when nothing more may be received on the edge (its CLOSE, a corrupt
            message, a broken pair). ``raw`` may be reused at once (nothing keeps a view of
            it).
        """
        src, edge, expect = rx.src, rx.edge, rx.expect
        h = read_header(raw)
        if h[0] == MAGIC and h[1] == ABORT:
            return self._receive_abort(h, src, edge)
        if h[0] == MAGIC and h[1] == WARMUP and self._payload is not None:
            self._payload.warm_announced(src)
            return True
        try:
            closing, task, step, dtype, shape = self._check(h, expect, edge)
            code = h[7] & ~REQUIRES_GRAD if h[7] >= 0 else h[7]
            rg = h[7] >= 0 and bool(h[7] & REQUIRES_GRAD)
            tree_len = h[10] if code == TREE else 0
        except ProtocolError as e:
            self._fail(e)
            return False
        if closing:
            rx.closed = True
            if h[2] == CLEAN:  # (its last step and itself, or nothing: an older peer)
                left = h[3] if h[4] == 1 else None
                self._post_rx(self._control.peer_left, src, left)
            else:
                n = min(max(h[4], 0), MAX_BLAMED)
                self._post_rx(self._control.peer_failed, src, h[2], h[3], tuple(h[5 : 5 + n]))
            return False
        if h[1] == DATA_DEVICE:
            assert dtype is not None
            doc = self._device_doc(rx, raw, tree_len, task, step) if code == TREE else None
            if code == TREE and doc is None:
                return False
            self._advance(rx, task, step)
            assert self._payload is not None  # ``_check`` refuses DATA_DEVICE on gloo
            if h[PLAN_FIELD]:  # compared before the payload reaches the loop
                self._post_rx(self._inlet.plan_seen, step, src, h[PLAN_FIELD])
            self._payload.device_receive(src, step, task, dtype, shape, doc, rg)
            return True
        payload: Any = None
        if dtype is not None:
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            if h[1] == DATA_INLINE:
                if HEADER_BYTES + nbytes > rx.cap:
                    self._fail(
                        ProtocolError(
                            f"{edge}: message seq {expect} ({task}) announces an inline"
                            f" payload of {nbytes} bytes, more than the edge's capacity"
                            f" {rx.cap - HEADER_BYTES}: the ranks disagree on inline_bytes"
                        ),
                    )
                    return False
                # Copied out, the buffer reused: a view would pin the whole buffer (the
                # edge's capacity, up to twice the payload) for as long as the stage keeps
                # the activation, memory that follows no size a byte budget can predict.
                payload = unpack_inline(raw, dtype, shape, nbytes)
            else:
                # gloo carries CPU tensors: a CUDA payload lands on the CPU first.
                payload = torch.empty(shape, dtype=dtype, pin_memory=self._dev.is_cuda)
                if not self._recv_or_lose(
                    payload,
                    src,
                    lambda: (
                        f"receiving the payload of seq {expect} ({task} of step {step}) on {edge}"
                    ),
                ):
                    return False
                # The next receive needs the larger buffer (its caller sees rx.cap).
                rx.cap = grow(rx.cap, nbytes, self._max_bytes)
            try:
                payload = self._to_device(src, payload, code == TREE, tree_len, rg)
            except ProtocolError as e:
                self._fail(
                    ProtocolError(f"{edge}: message seq {expect} ({task} of step {step}): {e}"),
                )
                return False
        self._advance(rx, task, step)
        self._post_rx(self._inlet.deliver, step, task, payload, src, h[PLAN_FIELD])
        return True

    def _host_buffer(self, n: int) -> torch.Tensor:
        """A gloo receive buffer: pinned on a CUDA stage (its copy to the device is then a
        non-blocking one), plain host memory elsewhere."""
        return torch.empty(n, dtype=torch.uint8, pin_memory=self._dev.is_cuda)

    def _to_device(self, src: int, payload: torch.Tensor, tree: bool, doc: int, rg: bool) -> Any:
        """A gloo payload on the stage's device (listener thread). On CUDA the copies run on
        the edge's copy stream, never the default stream, and this thread (not the consumer)
        waits for them: the receive buffer is reused next.

        Raises:
            ProtocolError: A corrupt pytree structure.
        """
        if not self._dev.is_cuda:
            if tree:
                return unpack_tree(payload, doc, self._dev.device)
            if payload.device != self._dev.device:
                payload = payload.to(self._dev.device)
            if rg and payload.is_floating_point():
                payload.requires_grad_(True)
            return payload
        s = self._copy_streams.get(-1 - src)
        if s is None:
            s = self._copy_streams[-1 - src] = self._dev.new_stream(f"copy {src}->")
        with self._dev.use(s):
            if tree:
                out: Any = unpack_tree(payload, doc, self._dev.device, non_blocking=True)
            else:
                out = payload.to(self._dev.device, non_blocking=True)
                if rg and out.is_floating_point():
                    out.requires_grad_(True)
            done = self._dev.record(s)
        done.synchronize()
        return out

    def _advance(self, rx: Inbound, task: Task, step: int) -> None:
        rx.expect += 1
        rx.prev = (task, step)
        self._control.at_step(step)
        self.received += 1

    def _device_doc(
        self, rx: Inbound, raw: torch.Tensor, doc_len: int, task: Task, step: int
    ) -> bytes | None:
        """A device pytree's structure (host bytes): behind its header when it fits the
        edge's capacity, else a gloo message of its own (then both sides grow the capacity,
        the rule of an inline payload). None when its receive failed (reported)."""
        if HEADER_BYTES + doc_len <= rx.cap:
            return ctypes.string_at(raw.data_ptr() + HEADER_BYTES, doc_len)
        buf = torch.empty(doc_len, dtype=torch.uint8)
        if not self._recv_or_lose(
            buf,
            rx.src,
            lambda: (
                f"receiving the structure of seq {rx.expect} ({task} of step {step}) on {rx.edge}"
            ),
        ):
            return None
        rx.cap = grow(rx.cap, doc_len, self._max_bytes)
        return ctypes.string_at(buf.data_ptr(), doc_len)

    def _recv_or_lose(self, buf: torch.Tensor, src: int, doing: Callable[[], str]) -> bool:
        """Listener thread: receive ``buf`` from ``src`` (gloo); False (after blaming
        ``src`` unless this rank is closing) when the connection broke ``doing`` what it
        says."""
        try:
            self._pg.recv([buf], self._peer_rank[src], 0).wait()
        except Exception as e:
            if not self._closing:
                err = PeerError(
                    f"{self._names.me()} lost {self._names.name(src)}: the connection broke"
                    f" while {doing()}: {e}"
                )
                self._lose(src, err)
            return False
        return True

    def _receive_abort(self, h: list[int], src: int, edge: str) -> bool:
        """Listener thread: an ABORT header arrived from ``src``; receive its text and hand
        it to the loop. False when the listener must end (a bad header, a broken pair)."""
        try:
            step, origin, n, kind = decode_abort(h)
        except ProtocolError as e:
            self._fail(ProtocolError(f"{edge}: {e}"))
            return False
        cause = ""
        if n:
            text = torch.empty(n, dtype=torch.uint8)
            if not self._recv_or_lose(
                text, src, lambda: f"receiving the ABORT of step {step} on {edge}"
            ):
                return False
            cause = ctypes.string_at(text.data_ptr(), n).decode("utf-8", "replace")
        # Not behind the edge's payloads: a failed step is told at once.
        self._post(self._control.peer_aborted, src, step, origin, cause, kind)
        return True

    def _check(self, h: list[int], expect: int, edge: str) -> _Checked:
        def bad(why: str) -> ProtocolError:
            return ProtocolError(
                f"{edge}: corrupt or unexpected header at seq {expect}: {why}; header {h}"
            )

        if h[0] != MAGIC:
            raise bad(f"bad magic {h[0]:#x}")
        if h[1] == CLOSE:
            if h[2] not in CLOSE_CAUSES:
                raise bad(f"unknown close cause {h[2]}")
            return True, Task(0, "F", 0), 0, None, ()
        device = h[1] == DATA_DEVICE
        if h[1] not in (DATA, DATA_INLINE) and not (device and self._dmode):
            raise bad(f"unknown message kind {h[1]}")
        if h[2] != expect:
            raise bad(f"sequence number {h[2]}, expected {expect}")
        if not 0 <= h[5] < len(KINDS) or h[4] < 0 or h[6] < 0 or h[3] < 0:
            raise bad("invalid task or step")
        task = Task(h[4], KINDS[h[5]], h[6])
        if h[7] == NO_PAYLOAD:
            if device:
                raise bad("a device message without a payload")
            return False, task, h[3], None, ()
        code = h[7] & ~REQUIRES_GRAD if h[7] >= 0 else h[7]
        if code == TREE:
            total, doc = h[9], h[10]
            # On the device path ``total`` counts the leaves' bytes alone, the structure
            # travels on gloo (see ``_wire``).
            if h[8] != 2 or not 0 <= doc <= (self._max_bytes if device else total):
                raise bad(f"a pytree payload needs shape (total, structure), got {h[8:11]}")
            if total > self._max_bytes or (device and total == 0):
                if device and total == 0:
                    raise bad("a device pytree without device bytes")
                raise ProtocolError(
                    f"{edge}: message seq {expect} ({task} of step {h[3]}) announces a pytree"
                    f" payload of {total} bytes, more than the bound of {self._max_bytes}"
                    f" bytes ({size_text(self._max_bytes)}): refused before allocating it. If"
                    f" messages this large are expected, raise the bound with"
                    f" {self._limits.bound_name} on every rank; header {h}"
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
                f" this large are expected, raise the bound with {self._limits.bound_name} on every"
                f" rank (else the header is corrupt); header {h}"
            )
        if device and size == 0:
            raise bad("a device message without device bytes")
        return False, task, h[3], dtype, shape
