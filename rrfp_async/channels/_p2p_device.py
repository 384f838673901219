"""The p2p channel's device path: payloads on a communicator per directed edge, issued by one
thread, completed on comm streams.

Design note: NCCL's rules by construction
-----------------------------------------
Under NCCL a communicator is one stream per rank pair (its operations run in issue order, a
send matches the peer's receive of the same position, no tags), ``Work.wait()`` makes the
calling thread's *current stream* wait instead of the host, no two threads may issue on one
communicator, and none may issue in parallel on two communicators of one device. The gloo
path breaks every one of these (a header receive always posted on the pair both directions
share, listener and sender threads issuing on it, ``wait()`` on the default stream). The
device path keeps them by construction:

* **Headers and control on gloo, payloads on their own communicators.** Every header,
  pytree structure, ABORT and CLOSE travels on the channel's gloo group as on the gloo path
  (with its sequence numbers, checks and capacity rule); a payload's bytes travel on the
  payload communicator of its *directed* edge (``payload_groups[(src, dst)]``: a 2-rank
  group, so a communicator carries one direction and its two ends are one sender and one
  receiver whose operations match position by position).
* **A receive is posted only after its header came.** The edge's listener (gloo) reads a
  ``DATA_DEVICE`` header and hands (shape, dtype, structure) to the issue thread, which posts
  the receive; nothing is kept posted on a payload communicator. The sender issues the
  payload's send *before* it posts the header, so every receive posted has its send enqueued.
* **One issuing thread per device and process** (``rrfp-issue-<device>``, ``_Issuer``): it
  issues every payload send and receive of every channel on that device, in the order they
  were handed to it, so no communicator ever has two issuers and no two communicators of a
  device are issued on at once (NCCL's thread-safety rules), also when a process opens
  several stages, one after the other or at once. It never blocks on the device: an issue
  is an enqueue, and ``wait()`` orders a stream.
* **Comm streams and events.** Each edge has a comm stream per direction; an operation is
  issued with it current, ``wait()`` orders it there, and an event recorded after it is
  what the other side waits on: ``send`` records an event on the producer's current stream
  (the compute side stream, which made the payload) and the send's comm stream waits on it;
  a receive's event is attached to the delivered tensors (``_streams.mark_ready``) and the
  consumer makes its compute stream wait on it (``wait_ready``). Nothing waits on the
  default stream.
* **In flight, alive.** A payload is packed on the device into a buffer of its own (a copy
  of a caller's tensor, or the ``pack_tree_device`` buffer), so a producer that overwrites
  its output buffer changes nothing in flight (invariant 10); the buffer is kept (and
  ``record_stream``ed on its comm stream) until the event after its send completed.
* **Communicators open in one order.** NCCL creates a p2p communicator at its first
  operation, blocking until the peer's first operation on it. So a channel's first item on
  the issue thread opens every payload communicator of its rank in one global order (by the
  edges' global ranks): the sender posts a ``WARMUP`` header (gloo), then a 1-byte send; the
  receiver posts the 1-byte receive once that header came. Every rank opens its edges in the
  same order, so the smallest edge not yet open always has both ends at it: no deadlock
  (channels open in the order their stages start, the same on every rank). A channel that
  closes while a peer never opened gives up waiting; one stuck in a communicator's creation
  has its payload communicators aborted at close.
* **Failures on gloo.** Every host thread blocks in gloo only (listeners, sender threads)
  or in nothing (the issue thread), so a dead peer breaks a gloo pair and is named as on the
  gloo path; a hung one is the step watchdog's. At close, payload sends still in flight
  after the timeout get their communicators aborted rather than waited for.

The CPU stand-ins of ``_streams`` (host streams and events) run the same code on gloo, and
the NCCL-rules checker (``_nccl_rules``) checks it there: ``RRFP_NCCL_RULES=1`` builds
checked payload groups in ``build_groups``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .._bridges import after_fork_in_child, run_blocking
from .._errors import PeerError, ProtocolError, RRFPError
from .._resources import start_thread
from .._streams import Device, mark_ready
from .._tasks import Task
from ._p2p_control import ControlPath
from ._p2p_inlet import Inlet
from ._p2p_io import LoopPort, Names
from ._p2p_send import Sender
from ._wire import (
    HEADER_LEN,
    MAGIC,
    REQUIRES_GRAD,
    WARMUP,
    encode_header,
    pack_inline,
    pack_tree,
    pack_tree_device,
    unpack_tree_device,
)

__all__ = ["PayloadPath"]

_POLL_S = 0.05
"""How often a wait of the issue thread (a peer's WARMUP, the sends in flight at close) looks
whether the channel is closing or failed."""
BLOCKING_WAIT_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""Environment variables that make NCCL's ``wait()`` block the host (refused)."""
_GRACE_S = 2.0
"""How long a closing channel waits at least for the issue thread to reach its end."""


class _Issuer:
    """The issue thread of one device in this process: every channel's payload operations
    on that device, in the order they were queued (see the design note: no two threads issue
    on communicators of one device). Made on first use, a daemon thread, never stopped; a
    child process after ``fork`` makes its own."""

    _by_device: ClassVar[dict[str, _Issuer]] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.queue: queue.SimpleQueue[tuple[PayloadPath, tuple[Any, ...]]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"rrfp-issue-{device}", daemon=True)
        start_thread(self.thread, f"device {device}", "the p2p channel's payload issuer")

    @classmethod
    def of(cls, device: torch.device) -> _Issuer:
        """The issuer of ``device`` (made on first use)."""
        with cls._lock:
            got = cls._by_device.get(str(device))
            if got is None:
                got = cls._by_device[str(device)] = cls(device)
            return got

    def _run(self) -> None:
        Device(self.device).bind_thread()
        while True:
            channel, item = self.queue.get()
            try:
                channel.issue_item(item)
            except Exception as e:  # a bug here must not end the thread of every channel
                channel.issue_failed(e)
            del channel, item


def _synchronize(dev: Device, event: Any) -> None:
    """Wait for ``event`` on a helper thread bound to the channel's device."""
    dev.bind_thread()
    event.synchronize()


def _forget_issuers() -> None:
    _Issuer._by_device = {}
    _Issuer._lock = threading.Lock()


after_fork_in_child(_forget_issuers)


class PayloadPath:
    """The device path of a ``P2PChannel`` (see the design note above): owns the payload
    communicators of this rank's edges, their comm streams, the payloads in flight and this
    channel's items on the issue thread.

    Args:
        payload_groups: ``(src, dst)`` pipeline ranks -> the 2-rank NCCL group of that
            directed edge, one per edge of this rank.
        names: How messages name ranks and edges.
        inbound: Pipeline ranks that send to this rank.
        outbound: Pipeline ranks this rank sends to.
        dev: The stage's device (the comm streams', the payloads').
        inlet: Takes the payloads and the errors that fail the channel (loop thread).
        control: Takes lost peers (loop thread); ``closing`` tells expected errors.
        consumer_waits: The consumer makes its stream wait on each received tensor's event
            itself (``_streams.wait_ready``): a payload reaches it at once, else once its
            receive completed.

    Raises:
        ValueError: An edge without a payload group, a group that is no NCCL group (or the
            NCCL-rules checker's), an edge to itself, or a blocking NCCL wait configured.
    """

    def __init__(
        self,
        payload_groups: Mapping[tuple[int, int], Any],
        *,
        names: Names,
        inbound: Iterable[int],
        outbound: Iterable[int],
        dev: Device,
        inlet: Inlet,
        control: ControlPath,
        consumer_waits: bool = False,
    ) -> None:
        self._names = names
        self._rank = names.rank
        self._global = names.global_ranks
        self._inbound = sorted(set(inbound))
        self._outbound = sorted(set(outbound))
        self._dev = dev
        self._device = dev.device
        self._inlet = inlet
        self._control = control
        self.consumer_waits = consumer_waits
        self._payload = dict(payload_groups)
        self._issuer: _Issuer | None = None
        self._port: LoopPort | None = None
        self._senders: Mapping[int, Sender] = {}
        self._opened = False
        self._ended = threading.Event()
        self._streams: dict[tuple[int, int], Any] = {}
        self._payload_peer: dict[tuple[int, int], int] = {}
        self._inflight: list[tuple[Any, torch.Tensor]] = []
        self._warm_seen: dict[int, threading.Event] = {}
        self.device_sent = 0
        self.device_received = 0
        for var in BLOCKING_WAIT_ENV:
            if os.environ.get(var, "0").lower() not in ("", "0", "false"):
                # A blocking wait() would hold the issue thread until a receive completed,
                # and a send until the peer's receive is posted: two ranks sending to each
                # other at once would each wait for a receive queued behind its own send.
                raise ValueError(
                    f"rank {self._rank}: {var}={os.environ[var]} makes NCCL's Work.wait()"
                    " block the host, which the device path never does (one issue thread per"
                    f" device): unset it; failures are detected on gloo (docs/gpu.md)"
                )
        want = {(self._rank, d) for d in self._outbound} | {(s, self._rank) for s in self._inbound}
        missing = sorted(want - set(self._payload))
        if missing:
            raise ValueError(
                f"rank {self._rank}: no payload group for the edges {missing} (payload_groups"
                " needs one per directed edge of this rank: build_groups makes them for"
                " neighbouring pipeline ranks)"
            )
        for a, b in want:
            if a == b:
                raise ValueError(
                    f"rank {self._rank}: an edge to itself on the device path (use the"
                    " in-process channel for a stage's own edges)"
                )
        self._payload = {e: self._payload[e] for e in want}
        for e, pg in self._payload.items():
            backend = dist.get_backend(pg) if dist.is_initialized() else "?"
            if backend != "nccl":
                # A gloo send's wait() blocks until the peer posts its receive, which the
                # device path posts only after the header that follows the send: it needs
                # NCCL's deferred completion (or the NCCL-rules checker's model of it).
                raise ValueError(
                    f"rank {self._rank}: the payload group of edge {e} is {backend!r}; payload"
                    " groups are NCCL groups (build_groups(p2p_backend='nccl')), or the"
                    " NCCL-rules checker's (RRFP_NCCL_RULES=1)"
                )

    @property
    def _closing(self) -> bool:
        return self._control.closing

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        assert self._port is not None
        self._port.post(fn, *args)

    def _fail(self, exc: RRFPError) -> None:
        self._inlet.fail(exc)

    def _lose(self, peer: int, exc: RRFPError) -> None:
        self._control.lose(peer, exc)

    def start(self, port: LoopPort, senders: Mapping[int, Sender]) -> None:
        """Resolve the payload groups' ranks, make the comm streams and start the issue
        thread's work for this channel: ``port`` hands calls to the loop, ``senders`` (one
        per outbound edge) post the gloo headers."""
        self._port = port
        self._senders = senders
        for (a, b), pg in self._payload.items():
            peer = b if a == self._rank else a
            self._payload_peer[(a, b)] = dist.get_group_rank(pg, self._global[peer])
            self._streams[(a, b)] = self._dev.new_stream(f"comm {a}->{b}")
        for s in self._inbound:
            self._warm_seen[s] = threading.Event()
        self._issuer = _Issuer.of(self._device)
        self._put("open")

    def _put(self, *item: Any) -> None:
        """Queue an item of this channel for the issue thread."""
        assert self._issuer is not None
        self._issuer.queue.put((self, item))

    # ------------------------------------------------------------------ the caller's side

    def send(self, sender: Sender, step: int, task: Task, payload: Any) -> None:
        """``send`` on the device path (the caller's thread), on ``sender``'s edge: pack on
        the device, on the current stream, record the event the send waits for, hand it to
        the issue thread.

        Raises:
            ProtocolError: A payload over ``max_bytes``, or a value the wire does not carry.
        """
        dst = sender.dst
        t: torch.Tensor | None = None
        doc: bytes | None = None
        rg = False
        if isinstance(payload, torch.Tensor):
            rg = payload.requires_grad
            x = payload.detach()
            # Its own buffer on the stage's device, whatever the producer does next.
            t = x.to(self._device) if x.device != self._device else x.clone()
            if not t.is_contiguous():
                t = t.contiguous()
        elif payload is not None:
            try:
                doc, t = pack_tree_device(payload, self._device)
            except ProtocolError as e:
                raise ProtocolError(
                    f"rank {self._rank} step {step}: cannot send the output for {task}: {e}"
                ) from None
        nbytes = 0 if t is None else t.nbytes
        sender.check_size(step, task, t, nbytes)
        what = (sender.seq, task)
        if t is None or nbytes == 0:
            # Nothing for the device: the header (and an empty value) on gloo alone.
            if doc is not None:
                host, tree = pack_tree(payload)  # structure only: no leaf has a byte
                msgs = sender.host_messages(step, task, host, tree)
            else:
                empty = None if t is None else torch.empty(t.shape, dtype=t.dtype)
                msgs = sender.host_messages(step, task, empty, None)
            self._put("send", dst, msgs, None, None, what)
            return
        header = encode_header(
            sender.seq,
            step,
            task,
            t,
            tree=None if doc is None else len(doc),
            device=True,
            plan=sender.plan_of(step),
        )
        if rg:
            header[7] |= REQUIRES_GRAD
        msgs = [pack_inline(header, None)]
        if doc is not None:
            text = torch.frombuffer(bytearray(doc), dtype=torch.uint8)
            if sender.fits(len(doc)):
                msgs = [pack_inline(header, text)]
            else:  # the structure on its own; both sides grow the edge (see _p2p_recv)
                msgs.append(text)
        sender.seq += 1
        ready = self._dev.record()  # after the packing, on the producer's stream
        self._put("send", dst, msgs, t, ready, what)

    def control(self, dst: int, msgs: list[torch.Tensor], what: tuple[int, object]) -> None:
        """A control message (an ABORT) for edge ``dst``, behind its headers."""
        self._put("send", dst, msgs, None, None, what)

    def close_edges(self, hdr: list[int]) -> None:
        """Post the CLOSE ``hdr`` on every outbound edge, behind its headers."""
        self._put("close", hdr)

    # ------------------------------------------------------------------ the listeners' side

    def warm_announced(self, src: int) -> None:
        """Listener of ``src``: its WARMUP header came (its payload communicator opens)."""
        ev = self._warm_seen.get(src)
        if ev is not None:
            ev.set()

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
        """Listener of ``src``: a ``DATA_DEVICE`` header came; the issue thread posts its
        receive (in the edge's order)."""
        self._put("recv", src, step, task, dtype, shape, doc, rg)

    def post_in_order(self, fn: Callable[..., object], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop behind the payloads handed to the issue thread."""
        self._put("post", fn, args)

    # ------------------------------------------------------------------ the issue thread

    def issue_item(self, item: tuple[Any, ...]) -> None:
        """Run one item of this channel on the issue thread (see ``_Issuer``)."""
        kind = item[0]
        if kind == "open":
            try:
                self._opened = self._open_edges()
            except Exception as e:  # a payload communicator that cannot open
                if not self._closing:
                    self._post(
                        self._fail,
                        PeerError(
                            f"{self._names.me()}: opening the payload communicators failed: {e}"
                        ),
                    )
            return
        if kind == "end":
            self._ended.set()
            return
        self._reap_inflight()
        if not self._opened and kind in ("send", "recv"):
            return  # the channel failed or closed while opening; the stage knows
        handlers: dict[str, Callable[..., None]] = {
            "send": self._issue_send,
            "recv": self._issue_recv,
            "post": self._issue_post,
            "close": self._issue_close,
        }
        handlers[kind](*item[1:])

    def _open_edges(self) -> bool:
        """Open every payload communicator of this rank in one global order (see the note).
        False when the channel closed or failed before."""
        order = sorted(self._payload, key=lambda e: (self._global[e[0]], self._global[e[1]]))
        one = torch.zeros(1, dtype=torch.uint8, device=self._device)
        for a, b in order:
            edge = (a, b)
            s = self._streams[edge]
            if a == self._rank:
                hello = pack_inline([MAGIC, WARMUP] + [0] * (HEADER_LEN - 2), None)
                if not self._post_gloo(b, [hello], (-1, "the WARMUP of its payload edge")):
                    return False
                buf = one.clone()
                with self._dev.use(s):
                    self._payload[edge].send([buf], self._payload_peer[edge], 0).wait()
                    self._inflight.append((self._dev.record(s), buf))
            else:
                seen = self._warm_seen[a]
                while not seen.wait(_POLL_S):
                    if self._closing or self._inlet.failed is not None:
                        return False
                buf = torch.empty(1, dtype=torch.uint8, device=self._device)
                with self._dev.use(s):
                    self._payload[edge].recv([buf], self._payload_peer[edge], 0).wait()
                    self._inflight.append((self._dev.record(s), buf))
        return True

    def _issue_send(
        self,
        dst: int,
        msgs: list[torch.Tensor],
        t: torch.Tensor | None,
        ready: Any,
        what: tuple[int, object],
    ) -> None:
        if t is not None:
            edge = (self._rank, dst)
            s = self._streams[edge]
            try:
                with self._dev.use(s):
                    self._dev.wait_event(ready, s)
                    self._payload[edge].send([t], self._payload_peer[edge], 0).wait()
                    done = self._dev.record(s)
            except Exception as e:
                if not self._closing:
                    self._post(self._lose, dst, PeerError(self._senders[dst].failed_text(what, e)))
                return
            if self._dev.is_cuda:
                t.record_stream(s)
            self._inflight.append((done, t))
            self.device_sent += 1
        # The header after the payload's send was issued: its receive will find a send.
        self._post_gloo(dst, msgs, what)

    def _post_gloo(self, dst: int, msgs: list[torch.Tensor], what: tuple[int, object]) -> bool:
        """Post ``msgs`` on edge ``dst`` of the gloo group (the sender thread reaps them)."""
        sender = self._senders[dst]
        try:
            sender.post_now(msgs, what)
        except Exception as e:
            if not self._closing:
                self._post(self._lose, dst, PeerError(sender.failed_text(what, e)))
            return False
        return True

    def _issue_recv(
        self,
        src: int,
        step: int,
        task: Task,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        doc: bytes | None,
        rg: bool,
    ) -> None:
        edge = (src, self._rank)
        s = self._streams[edge]
        try:
            with self._dev.use(s):
                buf = torch.empty(shape, dtype=dtype, device=self._device)
                self._payload[edge].recv([buf], self._payload_peer[edge], 0).wait()
                ready = self._dev.record(s)
        except Exception as e:
            if not self._closing:
                err = PeerError(
                    f"{self._names.me()} lost {self._names.name(src)}: receiving the payload of"
                    f" {task} of step {step} on the payload communicator of"
                    f" {self._names.edge_in(src)} failed: {e}"
                )
                self._post(self._lose, src, err)
            return
        payload: Any = buf
        if doc is not None:
            try:
                payload = unpack_tree_device(doc, buf, self._device)
            except ProtocolError as e:
                err2 = ProtocolError(f"{self._names.edge_in(src)}: {task} of step {step}: {e}")
                self._post(self._fail, err2)
                return
        elif rg and buf.is_floating_point():
            buf.requires_grad_(True)
        mark_ready(payload, ready)
        self.device_received += 1
        self._post(self._deliver_received, step, task, payload, src, ready)

    def issue_failed(self, exc: BaseException) -> None:
        """An item of this channel raised on the issue thread: the channel fails with it."""
        err = PeerError(f"{self._names.me()}: the payload issue thread failed: {exc!r}")
        self._post(self._fail, err)

    def _issue_post(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._post(fn, *args)

    def _issue_close(self, hdr: list[int]) -> None:
        for dst in self._outbound:
            self._senders[dst].end(hdr)

    def _reap_inflight(self) -> None:
        """Forget the payloads whose sends (and warm-ups) completed (never blocks)."""
        if self._inflight:
            self._inflight = [(ev, t) for ev, t in self._inflight if not ev.query()]

    # ------------------------------------------------------------------ the loop's side

    def _deliver_received(self, step: int, task: Task, payload: Any, src: int, ready: Any) -> None:
        """A device payload reached the loop with its receive's event. A consumer that waits
        on the event itself (``consumer_waits``: the torch executor's ``wait_ready``) gets
        it at once; any other gets it once the event completed (waited for off the loop)."""
        if self.consumer_waits or ready.query():
            self._inlet.deliver(step, task, payload, src)
            return

        def done(fut: Any) -> None:
            if fut.cancelled():
                return
            exc = fut.exception()
            if exc is not None:
                self._lose(
                    src,
                    PeerError(
                        f"{self._names.me()} lost {self._names.name(src)}: the payload of"
                        f" {task} of step {step} did not arrive: {exc}"
                    ),
                )
                return
            self._inlet.deliver(step, task, payload, src)

        run_blocking(
            _synchronize, self._dev, ready, name=f"rrfp-ready-{src}->{self._rank}"
        ).add_done_callback(done)

    # ------------------------------------------------------------------ close

    def close(self, deadline: float) -> None:
        """End this channel's use of the issue thread (after the listeners: what they
        handed on still reaches the loop), wait for the payload sends in flight until
        ``deadline``, and abort the payload communicators when they do not complete, or
        when the issue thread is stuck opening a communicator of a peer that never came
        (any thread)."""
        if self._issuer is None:
            return
        self._put("end")
        # At least a moment, even past the deadline: the thread is seldom busy for long.
        if not self._ended.wait(max(_GRACE_S, deadline - time.monotonic())):
            self._abort_payload_groups()
            return
        while self._inflight and time.monotonic() < deadline:
            self._reap_inflight()
            if self._inflight:
                time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        self._reap_inflight()
        if self._inflight:
            self._abort_payload_groups()

    def _abort_payload_groups(self) -> None:
        """Abort every payload communicator (NCCL: ``ncclCommAbort``), so that nothing in
        flight waits for a peer that will not come."""
        for pg in self._payload.values():
            # Newer torch: ProcessGroup.abort(); older: the private c10d _abort_process_group(pg).
            abort = getattr(pg, "abort", None)
            try:
                if callable(abort):
                    abort()
                else:
                    aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
                    if aborter is not None:
                        aborter(pg)
            except Exception:  # closing: nothing is left to tell
                continue
