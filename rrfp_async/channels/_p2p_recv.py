"""The p2p channel's receive threads: a listener per inbound edge, or the shared I/O thread.

Every thread here blocks in gloo only (headers, inline payloads, control messages): on the
device path a header that announces a device payload is handed to the issue thread
(``_p2p_device``), which posts its receive on the edge's payload communicator. See
``P2PChannel``'s design note (``_p2p``).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch

from .._errors import PeerError, ProtocolError, RRFPError
from .._tasks import Task
from ._p2p_io import WATCH_TAG, ChannelState, Inbound
from ._wire import (
    ABORT,
    CLEAN,
    CLOSE,
    DATA,
    DATA_DEVICE,
    DATA_INLINE,
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
    WARMUP,
    grow,
    read_header,
    size_text,
    unpack_inline,
    unpack_tree,
)

__all__ = ["ReceivePath"]

_Checked = tuple[bool, Task, int, torch.dtype | None, tuple[int, ...]]


class ReceivePath(ChannelState):
    """``P2PChannel``'s receive threads (a part: see ``_p2p_io``)."""

    def _listener(self, src: int) -> None:
        """Per-edge I/O: this edge's own thread blocks in its receive."""
        self._dev.bind_thread()
        rx = self._rx[src]
        raw: torch.Tensor | None = None  # reused while nothing kept a view of it
        while True:
            if raw is None or raw.numel() < rx.cap:
                raw = self._host_buffer(rx.cap)
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
                cap = max((rx.cap for rx in rxs.values() if rx.open), default=self._inline0)
                if raw is None or raw.numel() < cap:
                    raw = self._host_buffer(cap)
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
        receive from any source does not (see ``SharedIO``)."""
        rx = self._rx[src]
        bye = torch.empty(HEADER_LEN, dtype=torch.int64)
        try:
            self._pg.recv([bye], self._peer_rank[src], WATCH_TAG).wait()
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

    def _on_message(self, rx: Inbound, raw: torch.Tensor) -> tuple[bool, bool]:
        """A message from ``rx.src`` is in ``raw`` (its I/O thread): check it, receive the
        rest (a payload sent on its own, an ABORT's text, a device payload's structure) and
        hand it to the loop (a device payload: to the issue thread).

        Returns:
            (more, kept): ``more`` False when nothing more may be received on the edge (its
            CLOSE, a corrupt message, a broken pair); ``kept`` when ``raw`` must not be
            reused (the payload is a view of it).
        """
        src, edge, expect = rx.src, rx.edge, rx.expect
        h = read_header(raw)
        if h[0] == MAGIC and h[1] == ABORT:
            return self._receive_abort(h, src, edge), False
        if h[0] == MAGIC and h[1] == WARMUP and self._dmode:
            self.warm_announced(src)
            return True, False
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
                self._post_rx(self._peer_closed, src)
            else:
                n = min(max(h[4], 0), MAX_BLAMED)
                self._post_rx(self._peer_failed, src, h[2], h[3], tuple(h[5 : 5 + n]))
            return False, False
        if h[1] == DATA_DEVICE:
            assert dtype is not None
            doc = self._device_doc(rx, raw, tree_len, task, step) if code == TREE else None
            if code == TREE and doc is None:
                return False, False
            self._advance(rx, task, step)
            self.device_receive(src, step, task, dtype, shape, doc, rg)
            return True, False
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
                payload = torch.empty(shape, dtype=dtype, pin_memory=self._dev.is_cuda)
                if not self._recv_or_lose(
                    payload,
                    src,
                    lambda: (
                        f"receiving the payload of seq {expect} ({task} of step {step}) on {edge}"
                    ),
                ):
                    return False, False
                # The next receive needs the larger buffer (its caller sees rx.cap).
                rx.cap = grow(rx.cap, nbytes, self._max_bytes)
            try:
                payload = self._to_device(src, payload, code == TREE, tree_len, rg)
            except ProtocolError as e:
                self._post(
                    self._fail,
                    ProtocolError(f"{edge}: message seq {expect} ({task} of step {step}): {e}"),
                )
                return False, False
            if self._dev.is_cuda:
                kept = False  # copied to the device (and waited for): the buffer is free
        self._advance(rx, task, step)
        self._post_rx(self._deliver, step, task, payload, src)
        return True, kept

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
                return unpack_tree(payload, doc, self._device)
            if payload.device != self._device:
                payload = payload.to(self._device)
            if rg and payload.is_floating_point():
                payload.requires_grad_(True)
            return payload
        s = self._copy_streams.get(-1 - src)
        if s is None:
            s = self._copy_streams[-1 - src] = self._dev.new_stream(f"copy {src}->")
        with self._dev.use(s):
            if tree:
                out: Any = unpack_tree(payload, doc, self._device, non_blocking=True)
            else:
                out = payload.to(self._device, non_blocking=True)
                if rg and out.is_floating_point():
                    out.requires_grad_(True)
            done = self._dev.record(s)
        done.synchronize()
        return out

    def _advance(self, rx: Inbound, task: Task, step: int) -> None:
        rx.expect += 1
        rx.prev = (task, step)
        if step > self._last_step:
            self._last_step = step
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
            text = torch.empty(n, dtype=torch.uint8)
            if not self._recv_or_lose(
                text, src, lambda: f"receiving the ABORT of step {step} on {edge}"
            ):
                return False
            cause = ctypes.string_at(text.data_ptr(), n).decode("utf-8", "replace")
        # Not behind the edge's payloads: a failed step is told at once.
        self._post(self._peer_aborted, src, step, origin, cause)
        return True

    def _check(self, h: list[int], expect: int, edge: str) -> _Checked:
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
        if device and size == 0:
            raise bad("a device message without device bytes")
        return False, task, h[3], dtype, shape
