"""The p2p channel's send side: one ``Sender`` per outbound edge, owning that edge's sequence
numbers, capacity, queue, lock, counters and sender thread.

See ``P2PChannel``'s design note (``_p2p``) for the rules. On the device path (payload
communicators) the ``PayloadPath`` (``_p2p_device``) packs on the device and posts the gloo
headers through the edge's ``Sender`` (``post_now``), whose thread then only reaps their
works.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._errors import PeerError, ProtocolError, RRFPError
from .._resources import start_thread
from .._streams import Device
from .._tasks import Task
from ._p2p_io import REAP_BATCH, WATCH_TAG, Limits, Names, storage_ptr
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

__all__ = ["Sender"]

_What = tuple[int, object]
"""What a message is, for errors: (sequence number or -1, the task or a description)."""


def _no_plan(step: int) -> int:
    return 0


class Sender:
    """One outbound edge: packs and posts its messages in ``send`` order, and its thread
    posts the large ones and reaps (waits for) the works of those posted elsewhere.

    Args:
        dst: The peer's pipeline rank.
        names: How messages name ranks and edges.
        pg: The gloo process group (its own ``send``, ranks in the group).
        peer: ``dst``'s rank in ``pg``.
        dev: The stage's device (the thread binds to it; CUDA payloads are staged on it).
        limits: The channel's sizes (``Limits``).
        lost: Called (from any thread) when the edge's connection broke, with the error
            naming the edge and message: it hands the loss to the loop.
        bye: Post a BYE after the CLOSE (the peer receives with shared I/O: ``SharedIO``).
        plan_of: The plan tag of a step, for its headers (``Inlet.plan_of``; default: none).
    """

    def __init__(
        self,
        dst: int,
        *,
        names: Names,
        pg: Any,
        peer: int,
        dev: Device,
        limits: Limits,
        lost: Callable[[RRFPError], None],
        bye: bool = False,
        plan_of: Callable[[int], int] | None = None,
    ) -> None:
        self.dst = dst
        self.pg = pg
        self._names = names
        self._peer = peer
        self._dev = dev
        self._limits = limits
        self._lost = lost
        self._bye = bye
        self.plan_of = plan_of if plan_of is not None else _no_plan
        self.seq = 0  # sequence number of the next data message
        self.cap = limits.inline0  # the edge's capacity (the receiver's rule: see the note)
        self.lock = threading.Lock()  # keeps posts in ``send`` order
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queued = 0  # messages queued to the thread, not posted yet
        self._unreaped: list[tuple[list[Any], _What]] = []
        self._copy_stream: Any = None  # gloo with CUDA payloads: the staging stream
        self.thread = threading.Thread(
            target=self._run, name=f"rrfp-send-{names.rank}->{dst}", daemon=True
        )
        self.inline_sent = 0
        self.direct_sent = 0  # posted by ``send`` itself, not the sender thread

    def start(self) -> None:
        """Start the sender thread.

        Raises:
            ResourceError: The thread cannot be started (this process is out of threads).
        """
        start_thread(self.thread, self._names.me(), "the p2p channel's sender")

    # ------------------------------------------------------------------ the caller's side

    def send(self, step: int, task: Task, payload: Any) -> None:
        """Pack ``payload`` (a tensor, a pytree of tensors or None) on the host and post it:
        a small one from the calling thread when nothing is queued ahead, a large one by the thread.

        Raises:
            ProtocolError: A payload over ``max_bytes``, or a value the wire does not carry.
            PeerError: Posting from the calling thread failed (the loss reached the loop too).
        """
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
                raise self._unsendable(step, task, e) from None
        nbytes = 0 if t is None else t.nbytes
        self.check_size(step, task, t, nbytes)
        what = (self.seq, task)
        msgs = self.host_messages(step, task, t, tree)
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
        with self.lock:
            if nbytes <= self._limits.inline_send and not self._queued:
                # Nothing queued ahead on this edge: post it from the caller (no hand-off);
                # the sender thread reaps the works later.
                try:
                    works = [self.pg.send([m], self._peer, 0) for m in msgs]
                except Exception as e:
                    err = PeerError(self.failed_text(what, e))
                    self._lost(err)  # blame the peer, like a queued send
                    raise err from e
                self.direct_sent += 1
                self.reap_later(works, what)
            else:
                self._queued += 1
                self._queue.put(("send", [(msgs, what)]))

    def send_staged(self, step: int, task: Task, payload: Any) -> None:
        """gloo with CUDA payloads (see the design note): pack on the device, on the calling
        thread's current stream (nothing blocks the compute thread), record an event there,
        and let the sender thread copy the bytes into pinned host memory on a stream of its
        own once the event completed (``_stage``), then post the message.

        Raises:
            ProtocolError: A payload over ``max_bytes``, or a value the wire does not carry.
        """
        device = self._dev.device
        doc: bytes | None = None
        meta: torch.Tensor
        dev: torch.Tensor | None
        if isinstance(payload, torch.Tensor):
            x = payload.detach()
            dev = x.to(device) if x.device != device else x.clone()
            dev = dev.contiguous()
            meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
            if payload.requires_grad and x.is_floating_point():
                meta.requires_grad_(True)
            nbytes = dev.nbytes
        else:
            try:
                doc, dev = pack_tree_device(payload, device)
            except ProtocolError as e:
                raise self._unsendable(step, task, e) from None
            nbytes = up8(len(doc)) + (0 if dev is None else dev.nbytes)
            meta = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self.check_size(step, task, meta, nbytes)
        seq = self.seq
        inline = self.fits(nbytes)
        header = encode_header(
            seq,
            step,
            task,
            meta,
            inline=inline,
            tree=None if doc is None else len(doc),
            plan=self.plan_of(step),
        )
        self.seq = seq + 1
        if inline:
            self.inline_sent += 1
        ready = self._dev.record()
        with self.lock:
            self._queued += 1
            self._queue.put(("stage", [(header, inline, doc, dev, ready, (seq, task))]))

    def _unsendable(self, step: int, task: Task, e: ProtocolError) -> ProtocolError:
        return ProtocolError(
            f"rank {self._names.rank} step {step}: cannot send the output for {task}: {e}"
        )

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of payload travel inline, behind the header; when they do not,
        the edge's capacity grows to hold them (the receiver applies the same rule to the
        announced size, so both sides agree without talking)."""
        if HEADER_BYTES + nbytes <= self.cap:
            return True
        self.cap = grow(self.cap, nbytes, self._limits.max_bytes)
        return False

    def host_messages(
        self, step: int, task: Task, t: torch.Tensor | None, tree: int | None
    ) -> list[torch.Tensor]:
        """The gloo messages of a payload packed on the host (``t``: a tensor, a
        ``pack_tree`` buffer whose structure takes ``tree`` bytes, or None), with the next
        sequence number: the header with the payload inline when it fits the edge's
        capacity, else the header and the payload (a CUDA payload staged to the CPU) as two
        messages (see ``fits``)."""
        nbytes = 0 if t is None else t.nbytes
        inline = t is None or self.fits(nbytes)
        header = encode_header(
            self.seq, step, task, t, inline=inline, tree=tree, plan=self.plan_of(step)
        )
        self.seq += 1
        if inline:
            self.inline_sent += 1
            return [pack_inline(header, t)]
        assert t is not None  # only a payload can be too large to go inline
        if t.device.type != "cpu":
            t = t.cpu()  # gloo carries CPU tensors (a CUDA payload is staged)
        return [pack_inline(header, None), t]

    def check_size(self, step: int, task: Task, t: torch.Tensor | None, nbytes: int) -> None:
        """Refuse a payload over ``max_bytes`` where it is sent (the receiver would).

        Raises:
            ProtocolError: Naming the bound, the argument that raises it, the edge and task.
        """
        limit = self._limits.max_bytes
        if nbytes > limit:
            assert t is not None
            raise ProtocolError(
                f"rank {self._names.rank} step {step}: the message for {task}"
                f" ({tuple(t.shape)} {t.dtype}) has {nbytes} bytes, more than the bound of"
                f" {limit} bytes ({size_text(limit)}) on {self._names.edge_out(self.dst)}; the"
                f" receiver would refuse it. If messages this large are expected, raise the"
                f" bound with {self._limits.bound_name} on every rank"
            )

    def post_now(self, msgs: list[torch.Tensor], what: _What) -> None:
        """Post ``msgs`` from the calling thread, in order with everything else on the
        edge; the sender thread reaps their works.

        Raises:
            Exception: The group's own error when a post failed (the caller reports it).
        """
        with self.lock:
            works = [self.pg.send([m], self._peer, 0) for m in msgs]
            self.reap_later(works, what)

    def reap_later(self, works: list[Any], what: _What) -> None:
        """Works posted outside the sender thread (lock held): the thread waits for them,
        in order, once per ``REAP_BATCH`` (and at close)."""
        un = self._unreaped
        un.append((works, what))
        if len(un) >= REAP_BATCH:
            self._queue.put(("reap", un[:]))
            un.clear()

    def queue_control(self, msgs: list[torch.Tensor], what: _What) -> None:
        """A control message (an ABORT) through the sender thread, behind everything posted
        on the edge: no sequence number, no capacity change (see the design note)."""
        with self.lock:
            self._queued += 1
            self._queue.put(("send", [(msgs, what)]))

    def end(self, hdr: list[int]) -> None:
        """Post the CLOSE ``hdr`` through the sender thread, after what was posted before
        (and a BYE for a peer on shared I/O), and end the thread."""
        with self.lock:
            q = self._queue
            if self._unreaped:
                q.put(("reap", list(self._unreaped)))
                self._unreaped.clear()
            self._queued += 1
            msg = pack_inline(hdr, None)
            q.put(("send", [([msg], None)]))
            if self._bye:  # ends the peer's watcher of this edge
                q.put(("bye", [msg]))
            q.put(None)

    def failed_text(self, what: _What | None, e: BaseException) -> str:
        """The error of a send of ``what`` that failed with ``e`` (a lost peer)."""
        seq, task = what or (-1, None)
        which = f"message seq {seq} ({task})" if isinstance(seq, int) and seq >= 0 else str(task)
        n = self._names
        # The cause in the words of every other lost-peer message (the receive side's, the
        # decisions channel's): which side notices first is a race, the text is not.
        return (
            f"{n.me()} lost {n.name(self.dst)}: sending {which} on {n.edge_out(self.dst)}"
            f" failed ({CONNECTION_BROKE}): {e}"
        )

    # ------------------------------------------------------------------ the thread

    def _stage(
        self,
        header: list[int],
        inline: bool,
        doc: bytes | None,
        dev: torch.Tensor | None,
        ready: Any,
    ) -> list[torch.Tensor]:
        """The gloo messages of a staged payload, in pinned host memory (the layout of
        ``pack_inline`` / ``pack_tree``), copied from the device with a non-blocking copy on
        this edge's copy stream after the producer's event."""
        off = HEADER_BYTES if inline else 0
        body = (0 if doc is None else up8(len(doc))) + (0 if dev is None else dev.nbytes)
        host = torch.zeros(off + body, dtype=torch.uint8, pin_memory=True)
        if inline:
            write_header(host, header)
        if doc is not None:
            ctypes.memmove(host.data_ptr() + off, doc, len(doc))
            off += up8(len(doc))
        if dev is not None and dev.nbytes:
            s = self._copy_stream
            if s is None:
                s = self._copy_stream = self._dev.new_stream(f"copy ->{self.dst}")
            with self._dev.use(s):
                self._dev.wait_event(ready, s)
                host[off:].copy_(dev.reshape(-1).view(torch.uint8), non_blocking=True)
                done = self._dev.record(s)
            done.synchronize()  # this thread waits, not the compute thread
        return [host] if inline else [pack_inline(header, None), host]

    def _run(self) -> None:
        """Posts and waits for what ``send`` queued, and waits (reaps) for what was posted
        elsewhere, in order."""
        self._dev.bind_thread()
        q, peer, lock = self._queue, self._peer, self.lock
        while True:
            item = q.get()
            if item is None:
                return
            kind, entries = item
            what = None
            try:
                if kind == "bye":
                    self.pg.send(entries, peer, WATCH_TAG).wait()
                    continue
                if kind == "stage":
                    ((header, inline, doc, dev, ready, what),) = entries
                    try:
                        msgs = self._stage(header, inline, doc, dev, ready)
                    except BaseException:
                        with lock:
                            self._queued -= 1
                        raise
                    kind = "send"
                    entries = [(msgs, what)]
                if kind == "send":
                    ((msgs, what),) = entries
                    with lock:
                        try:
                            works = [self.pg.send([m], peer, 0) for m in msgs]
                        finally:
                            self._queued -= 1
                    for w in works:
                        w.wait()
                else:  # reap what was posted elsewhere, in order
                    for works, what in entries:  # noqa: B007 (named in the error)
                        for w in works:
                            w.wait()
            except Exception as e:
                if what is None:  # the CLOSE: the peer may be gone already
                    return
                self._lost(PeerError(self.failed_text(what, e)))
                return
