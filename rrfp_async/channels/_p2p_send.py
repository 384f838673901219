"""The p2p channel's send path: ``send`` and each outbound edge's sender thread.

See ``P2PChannel``'s design note (``_p2p``) for the rules; on the device path (payload
communicators) ``send`` packs on the device and hands the message to the issue thread
(``_p2p_device``), and the sender thread only reaps the gloo headers' works.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .._errors import PeerError, ProtocolError
from .._pytree import tensor_leaves
from .._tasks import Task
from ._p2p_io import REAP_BATCH, WATCH_TAG, ChannelState, edge_text, storage_ptr
from ._wire import (
    CONNECTION_BROKE,
    HEADER_BYTES,
    encode_header,
    grow,
    pack_inline,
    pack_tree,
    pack_tree_device,
    size_text,
    up8,
    write_header,
)

__all__ = ["SendPath"]


class SendPath(ChannelState):
    """``P2PChannel``'s send path (a part: see ``_p2p_io``)."""

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        """Send ``payload`` (a tensor, a pytree of tensors or None), the input of ``task``,
        to rank ``dst``.

        On gloo the message is packed now; a small one is posted from here, a large one by
        the edge's sender thread. On the device path it is packed on the device, on the
        calling thread's current stream, and the edge's payload send is issued by the issue
        thread (see the design note). A failure reaches the stage.

        Raises:
            ProtocolError: No open outbound edge to ``dst``, a payload over ``max_bytes``, or
                a value the wire does not carry.
            PeerError: The channel broke before (the error it broke with), or the post failed.
        """
        if self._failed is not None:
            raise self._failed
        seq = self._send_seq.get(dst)
        if seq is None or not self._started or self._closing:
            raise ProtocolError(
                f"rank {self._rank}: no open outbound edge to rank {dst} (outbound:"
                f" {self._outbound}); is the channel started?"
            )
        if self._dmode:
            self.device_send(dst, seq, step, task, payload)
            self.sent += 1
            return
        if self._dev.is_cuda and any(t.is_cuda for t in tensor_leaves(payload)):
            self._send_staged(dst, seq, step, task, payload)
            self.sent += 1
            return
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
        self.check_size(dst, step, task, t, nbytes)
        if step > self._last_step:
            self._last_step = step
        msgs = self.host_messages(dst, seq, step, task, t, tree)
        if (
            tree is None
            and len(msgs) > 1
            and msgs[1] is t
            and storage_ptr(t) == storage_ptr(payload)
        ):
            # A send may read its buffer until its work is waited for (from the sender
            # thread, later), and a producer may reuse its output buffer in its next
            # forward (a CUDA graph's static output): the message gets its own copy, so
            # what is sent is what the buffer held at send() (invariant 10). Inline
            # messages are packed into a buffer of their own already.
            msgs[1] = t.clone()
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
                self.reap_later(dst, works, what)
            else:
                self._queued[dst] += 1
                self._queues[dst].put(("send", [(msgs, what)]))
        self.sent += 1

    def _send_staged(self, dst: int, seq: int, step: int, task: Task, payload: Any) -> None:
        """gloo with CUDA payloads (see the design note): pack on the device, on the calling
        thread's current stream (nothing blocks the compute thread), record an event there,
        and let the edge's sender thread copy the bytes into pinned host memory on a stream
        of its own once the event completed (``_stage``), then post the message."""
        doc: bytes | None = None
        meta: torch.Tensor
        dev: torch.Tensor | None
        if isinstance(payload, torch.Tensor):
            x = payload.detach()
            dev = x.to(self._device) if x.device != self._device else x.clone()
            dev = dev.contiguous()
            meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
            if payload.requires_grad and x.is_floating_point():
                meta.requires_grad_(True)
            nbytes = dev.nbytes
        else:
            try:
                doc, dev = pack_tree_device(payload, self._device)
            except ProtocolError as e:
                raise ProtocolError(
                    f"rank {self._rank} step {step}: cannot send the output for {task}: {e}"
                ) from None
            nbytes = up8(len(doc)) + (0 if dev is None else dev.nbytes)
            meta = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self.check_size(dst, step, task, meta, nbytes)
        if step > self._last_step:
            self._last_step = step
        cap = self._send_cap[dst]
        inline = HEADER_BYTES + nbytes <= cap
        header = encode_header(
            seq, step, task, meta, inline=inline, tree=None if doc is None else len(doc)
        )
        self._send_seq[dst] = seq + 1
        if inline:
            self.inline_sent += 1
        else:
            self._send_cap[dst] = grow(cap, nbytes, self._max_bytes)
        ready = self._dev.record()
        with self._locks[dst]:
            self._queued[dst] += 1
            self._queues[dst].put(("stage", [(header, inline, doc, dev, ready, (seq, task))]))

    def _stage(
        self,
        dst: int,
        header: list[int],
        inline: bool,
        doc: bytes | None,
        dev: torch.Tensor | None,
        ready: Any,
    ) -> list[torch.Tensor]:
        """Sender thread: the gloo messages of a staged payload, in pinned host memory (the
        layout of ``pack_inline`` / ``pack_tree``), copied from the device with a
        non-blocking copy on this edge's copy stream after the producer's event."""
        off = HEADER_BYTES if inline else 0
        body = (0 if doc is None else up8(len(doc))) + (0 if dev is None else dev.nbytes)
        host = torch.zeros(off + body, dtype=torch.uint8, pin_memory=True)
        if inline:
            write_header(host, header)
        if doc is not None:
            ctypes.memmove(host.data_ptr() + off, doc, len(doc))
            off += up8(len(doc))
        if dev is not None and dev.nbytes:
            s = self._copy_streams.get(dst)
            if s is None:
                s = self._copy_streams[dst] = self._dev.new_stream(f"copy ->{dst}")
            with self._dev.use(s):
                self._dev.wait_event(ready, s)
                host[off:].copy_(dev.reshape(-1).view(torch.uint8), non_blocking=True)
                done = self._dev.record(s)
            done.synchronize()  # this thread waits, not the compute thread
        return [host] if inline else [pack_inline(header, None), host]

    def host_messages(
        self, dst: int, seq: int, step: int, task: Task, t: torch.Tensor | None, tree: int | None
    ) -> list[torch.Tensor]:
        """The gloo messages of a payload packed on the host (``t``: a tensor, a
        ``pack_tree`` buffer whose structure takes ``tree`` bytes, or None), with sequence
        number ``seq`` on edge ``dst``: the header with the payload inline when it fits the
        edge's capacity, else the header and the payload (a CUDA payload staged to the CPU)
        as two messages, and then the capacity grows on both sides (see the design note)."""
        nbytes = 0 if t is None else t.nbytes
        cap = self._send_cap[dst]
        inline = t is None or HEADER_BYTES + nbytes <= cap
        header = encode_header(seq, step, task, t, inline=inline, tree=tree)
        self._send_seq[dst] = seq + 1
        if inline:
            self.inline_sent += 1
            return [pack_inline(header, t)]
        assert t is not None  # only a payload can be too large to go inline
        self._send_cap[dst] = grow(cap, nbytes, self._max_bytes)
        if t.device.type != "cpu":
            t = t.cpu()  # gloo carries CPU tensors (a CUDA payload is staged)
        return [pack_inline(header, None), t]

    def check_size(
        self, dst: int, step: int, task: Task, t: torch.Tensor | None, nbytes: int
    ) -> None:
        """Refuse a payload over ``max_bytes`` where it is sent (the receiver would)."""
        if nbytes > self._max_bytes:
            assert t is not None
            raise ProtocolError(
                f"rank {self._rank} step {step}: the message for {task} ({tuple(t.shape)}"
                f" {t.dtype}) has {nbytes} bytes, more than the bound of {self._max_bytes}"
                f" bytes ({size_text(self._max_bytes)}) on {self._edge_out(dst)}; the receiver"
                f" would refuse it. If messages this large are expected, raise the bound with"
                f" {self._bound_name} on every rank"
            )

    def reap_later(self, dst: int, works: list[Any], what: tuple[int, object]) -> None:
        """Works posted on edge ``dst`` outside its sender thread (lock held): the sender
        thread waits for them, in order, once per ``REAP_BATCH`` (and at close)."""
        un = self._unreaped[dst]
        un.append((works, what))
        if len(un) >= REAP_BATCH:
            self._queues[dst].put(("reap", un[:]))
            un.clear()

    def _send_failed(self, dst: int, what: tuple[int, object] | None, e: BaseException) -> str:
        seq, task = what or (-1, None)
        which = f"message seq {seq} ({task})" if isinstance(seq, int) and seq >= 0 else str(task)
        # The cause in the words of every other lost-peer message (the receive side's, the
        # decisions channel's): which side notices first is a race, the text is not.
        return (
            f"{self._name(self._rank)} lost {self._name(dst)}: sending {which}"
            f" on {self._edge_out(dst)} failed ({CONNECTION_BROKE}): {e}"
        )

    def _edge_out(self, dst: int) -> str:
        return edge_text(self._rank, dst, self._global[self._rank], self._global[dst])

    def _sender(self, dst: int) -> None:
        """An outbound edge's sender thread: posts and waits for what ``send`` queued, and
        waits (reaps) for what was posted elsewhere, in order."""
        self._dev.bind_thread()
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
                    self._pg.send(entries, peer, WATCH_TAG).wait()
                    continue
                if kind == "stage":
                    ((header, inline, doc, dev, ready, what),) = entries
                    try:
                        msgs = self._stage(dst, header, inline, doc, dev, ready)
                    except BaseException:
                        with lock:
                            self._queued[dst] -= 1
                        raise
                    kind = "send"
                    entries = [(msgs, what)]
                if kind == "send":
                    ((msgs, what),) = entries
                    with lock:
                        try:
                            works = [self._pg.send([m], peer, 0) for m in msgs]
                        finally:
                            self._queued[dst] -= 1
                    for w in works:
                        w.wait()
                else:  # reap what was posted elsewhere, in order
                    for works, what in entries:  # noqa: B007 (named in the error)
                        for w in works:
                            w.wait()
            except Exception as e:
                if what is None:  # the CLOSE: the peer may be gone already
                    return
                self._post(self._lose, dst, PeerError(self._send_failed(dst, what, e)))
                return
