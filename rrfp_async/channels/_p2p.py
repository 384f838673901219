"""Message-driven point-to-point channel over torch.distributed (gloo; payloads on NCCL).

Design note
-----------
Every directed edge (this rank -> a neighbour, a neighbour -> this rank) is one FIFO,
matched by order, so nothing relies on tags (NCCL has none). A message is a fixed-size int64
*header*, then its payload:

    [magic, kind, seq, step, stage, task kind, microbatch, dtype, ndim, d0 .. d6, plan]

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
  its next forward (invariant 10; paid once per size on gloo, BENCHMARKS.md#channel-costs).
  The inline payload is copied out of the receive buffer (one ``memmove``; the buffer is
  reused), so a stashed activation holds its own bytes, not the edge's capacity: a view
  would pin up to twice the payload, more than a byte budget predicts from the sizes.
* **Small messages leave from the caller; large ones from the edge's sender thread.**
  ``send`` packs the message where it is called (the loop, or the stage's compute thread
  the moment the output exists; the header and an inline payload are ``memmove``d into one
  buffer). A message of at most ``inline_send_bytes`` (1 MiB by default) is
  posted right there with the process group's own ``send`` (no ``torch.distributed``
  wrapper, no thread hand-off) when nothing is queued ahead of it on the edge; its work is
  reaped later, in order, by the edge's sender thread (woken once per 16 such messages, and
  at close). A larger message is queued to the sender thread, which posts and waits for it:
  a gloo send writes to the socket in the calling thread (BENCHMARKS.md#channel-costs), which
  for a large message would stall the computation or the loop that called it for
  milliseconds. Per edge, a lock and a count of queued messages keep posts in ``send`` order
  (the receiver checks sequence numbers), and a slow peer never holds up the other edges. A
  failed send reaches the stage as ``PeerError`` naming the edge and sequence number.
* **One listener thread per inbound edge** blocks in the receive (into a buffer it reuses
  whenever the payload was copied out, header read with ``struct``) (``is_completed()`` never
  turns true without ``wait()``, and a timed wait that expires closes the pair) and hands
  each message to the loop with ``call_soon_threadsafe``: one thread per outstanding
  receive, so a late message never blocks an early one, and the loop never blocks.
  ``io="shared"`` (opt-in, gloo only) receives every inbound edge in one I/O thread
  instead, with a receive from any source, and hands completions to the loop in batches
  (``SharedIO``); per message it measured no better (BENCHMARKS.md#per-message).

**The device path** (``payload_groups``: ``build_groups(p2p_backend="nccl")``, or the
NCCL-rules checker's groups) keeps all of the above for headers and control, on gloo, and
moves payload bytes on a communicator per directed edge, issued by one thread, completed on
comm streams and consumed through events: its own design note is in ``_p2p_device``
(NCCL's rules by construction). ``send`` then packs on the device (``pack_tree_device``, no
host read) and never posts from the caller.

The parts, one module each, each owning its state and built with its collaborators passed
in; calls go one way, from the threads' parts to the loop's::

    P2PChannel ── wires them, counts ``sent``, routes ``send`` to an edge
     ├─ Inlet (_p2p_inlet)          the sink, messages before ``bind``, arrivals, the error
     │                              the channel broke with                    (loop thread)
     ├─ ControlPath (_p2p_control)  ABORT/CLOSE bookkeeping: steps aborted, the cause a
     │                              failing CLOSE carries, peers' failures, closing;
     │                              sends through two outlets it is given     (loop thread)
     ├─ Sender (_p2p_send)          one per outbound edge: sequence numbers, capacity,
     │                              queue, lock, counters, its sender thread
     ├─ Receiver (_p2p_recv)        the inbound edges' state (``Inbound``), listener or
     │                              shared I/O threads, header checks -> Inlet, ControlPath
     └─ PayloadPath (_p2p_device)   the device path: payload communicators, comm streams,
                                    the issue thread's items -> Sender (gloo headers)

``Names`` (how messages name ranks and edges), ``Limits`` (the sizes) and ``LoopPort`` (the
hand-off to the loop) are in ``_p2p_io``; the wire format is ``_wire``.

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
them: ``abort(step, cause, kind=...)`` sends an ABORT (the step, the global rank where it
failed, what kind of failure it was as a code, ``FailureKind``, and the cause as text; see
``_wire``) down every outbound edge. The kind is what a rank tests (a peer's step check that
found the ranks a step apart, ``STEP_DIFFERS``, is told from any other failure by it); the
text is only ever for messages. A rank that receives one for a step it has not heard of yet
passes it on down its own outbound edges (except back to the sender, kind and cause
unchanged) and hands the stage a ``PeerStepError`` (``step_aborted``; its ``kind`` is the
header's): the stage fails that step at once if it runs, or the moment it starts if it has
not started yet, and drops the step's messages by its number. Hop by hop, every rank of the
pipeline learns it within a few message latencies, whatever its distance from the origin;
each rank passes a step's ABORT on once, so the flood ends. This needs a path from every
rank to every other, so a stage's channel has edges both ways between pipeline neighbours
even when its plan sends only one way (a forward-only plan): an edge that carries no data
costs a thread that waits for the CLOSE.

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
import contextlib
import functools
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._bridges import run_blocking
from .._errors import FailureKind, ProtocolError, ResourceError, RRFPError
from .._pytree import tensor_leaves
from .._streams import Device
from .._tasks import Task
from . import _strays
from ._base import Sink
from ._p2p_control import ControlPath
from ._p2p_device import PayloadPath
from ._p2p_inlet import Inlet
from ._p2p_io import DEFAULT_INLINE_SEND_BYTES, IO_ENV, IO_MODES, IOMode, Limits, LoopPort, Names
from ._p2p_recv import Receiver
from ._p2p_send import Sender
from ._wire import DEFAULT_INLINE_BYTES, DEFAULT_MAX_BYTES, HEADER_BYTES

__all__ = ["IO_ENV", "IOMode", "P2PChannel"]


class P2PChannel:
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
            environment variable, else ``"per_edge"`` (BENCHMARKS.md#per-message has the
            two side by side). Every rank of a pipeline must use the same one.
        payload_groups: The device path (see ``_p2p_device``): ``(src, dst)`` pipeline ranks
            -> the NCCL group (2 ranks) that carries that directed edge's payloads, one per
            edge of this rank (``StageGroups.payload``). None: payloads on ``group`` (gloo).
        consumer_waits: On the device path, the consumer makes its stream wait on each
            received tensor's event itself (``_streams.wait_ready``: the torch executor
            does), so a payload reaches the sink at once; else once its receive completed.

    Raises:
        ValueError: A rank without a global rank, a negative size, an unknown ``io``, an NCCL
            ``group`` (headers need gloo: NCCL payloads go in ``payload_groups``), or an
            edge without its payload group.

    Use as ``async with channel:`` (starts the threads on the running loop, then closes),
    or call ``start()`` / ``close()`` yourself. ``send`` may be called from any thread, one
    thread at a time (``threadsafe_send``): a stage sends an output from its compute thread
    the moment it exists.

    The channel wires its parts (see the module's design note) and owns nothing else than
    what it counts itself (``sent``): the ``Inlet`` (the loop side), the ``ControlPath``
    (ABORT and CLOSE), a ``Sender`` per outbound edge and the ``Receiver`` of the inbound
    ones (made at ``start``, when the group and the loop are known), and the device path's
    ``PayloadPath``.
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
        consumer_waits: bool = False,
    ) -> None:
        self._rank = rank
        gl = dict(global_ranks)
        self._inbound = sorted(set(inbound))
        self._outbound = sorted(set(outbound))
        for r in [rank, *self._inbound, *self._outbound]:
            if r not in gl:
                raise ValueError(f"pipeline rank {r} has no global rank in global_ranks")
        if inline_bytes < 0 or max_bytes < 0 or inline_send_bytes < 0:
            raise ValueError("inline_bytes, max_bytes and inline_send_bytes must be >= 0")
        self._group = group
        self._dev = Device(device)
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        if backend == "nccl":
            raise ValueError(
                f"rank {rank}: the channel's group is an NCCL group; headers and control need"
                " gloo (a receive kept posted on an NCCL communicator blocks its stream): pass"
                " the pipeline's gloo group and the NCCL payload communicators as"
                " payload_groups (build_groups(p2p_backend='nccl') makes both)"
            )
        mode = io if io is not None else os.environ.get(IO_ENV, "per_edge")
        if mode not in IO_MODES:
            raise ValueError(f"io must be one of {IO_MODES}, got {mode!r}")
        self._io_mode: IOMode = mode
        self._max_bytes = max_bytes
        self._names = Names(rank, gl)
        self._inlet = Inlet(self._names.me())
        self._control = ControlPath(
            self._names,
            self._inlet,
            send_control=self._send_control,
            close_edges=self._close_edges,
        )
        self._payload: PayloadPath | None = None
        if payload_groups is not None:
            self._payload = PayloadPath(
                payload_groups,
                names=self._names,
                inbound=self._inbound,
                outbound=self._outbound,
                dev=self._dev,
                inlet=self._inlet,
                control=self._control,
                consumer_waits=consumer_waits,
            )
        self._consumer_waits = consumer_waits
        self._limits = Limits(
            max_bytes=max_bytes,
            bound_name=bound_name,
            inline0=HEADER_BYTES + min(inline_bytes, max_bytes),
            # The device path: every message through the issue thread, in order.
            inline_send=-1 if self._payload is not None else inline_send_bytes,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._port: LoopPort | None = None
        self._senders: dict[int, Sender] = {}
        self._receiver: Receiver | None = None
        self.sent = 0

    # ------------------------------------------------------------------ Endpoint

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self._rank

    @property
    def device(self) -> torch.device:
        """The channel's device (a CUDA device with its index)."""
        return self._dev.device

    @property
    def on_device(self) -> bool:
        """Whether payloads travel on payload communicators (the device path)."""
        return self._payload is not None

    @property
    def inflight(self) -> int:
        """Unknown across processes: -1."""
        return -1

    @property
    def io(self) -> IOMode:
        """How inbound messages are received (``"per_edge"`` or ``"shared"``)."""
        return self._io_mode

    @property
    def max_bytes(self) -> int:
        """Largest payload a header may announce (sent or received)."""
        return self._max_bytes

    @property
    def consumer_waits(self) -> bool:
        """Whether the consumer waits on a device payload's event itself (the constructor's
        ``consumer_waits``)."""
        return self._consumer_waits

    @property
    def handoffs(self) -> tuple[int, int]:
        """Shared I/O: (hand-offs to the loop, completions they carried); per-edge I/O
        hands each completion off alone: (-1, -1)."""
        inbox = None if self._port is None else self._port.inbox
        if inbox is None:
            return -1, -1
        return inbox.batches, inbox.items

    @property
    def received(self) -> int:
        """Data messages received (headers checked, payload handed on)."""
        return 0 if self._receiver is None else self._receiver.received

    @property
    def inline_sent(self) -> int:
        """Messages sent with the payload inline, behind the header."""
        return sum(s.inline_sent for s in self._senders.values())

    @property
    def direct_sent(self) -> int:
        """Messages posted by ``send`` itself, not by an edge's sender thread."""
        return sum(s.direct_sent for s in self._senders.values())

    @property
    def device_sent(self) -> int:
        """Payloads sent on payload communicators (the device path)."""
        return 0 if self._payload is None else self._payload.device_sent

    @property
    def device_received(self) -> int:
        """Payloads received on payload communicators (the device path)."""
        return 0 if self._payload is None else self._payload.device_received

    def bind(self, sink: Sink) -> None:
        """Route inbound messages to ``sink`` (messages that came earlier are replayed)."""
        self._inlet.bind(sink)

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
        failed = self._inlet.failed
        if failed is not None:
            raise failed
        sender = self._senders.get(dst)
        if sender is None or self._control.closing:
            raise ProtocolError(
                f"rank {self._rank}: no open outbound edge to rank {dst} (outbound:"
                f" {self._outbound}); is the channel started?"
            )
        self._control.at_step(step)
        if self._payload is not None:
            self._payload.send(sender, step, task, payload)
        elif self._dev.is_cuda and any(t.is_cuda for t in tensor_leaves(payload)):
            sender.send_staged(step, task, payload)
        else:
            sender.send(step, task, payload)
        self.sent += 1

    # ------------------------------------------------------------------ what the stage asks

    def arrivals(self, step: int) -> dict[int, int]:
        """Messages received for ``step`` so far, per source pipeline rank (the last few
        steps only). ``DistributedStage`` compares them with the plan to name the ranks a
        timed-out step waits for."""
        return self._inlet.arrivals(step)

    def at_step(self, step: int, plan: int = 0) -> None:
        """The stage starts ``step`` (the step a failing rank's CLOSE names) under the plan
        tag ``plan`` (0: none): each header of the step carries it, and a message of the
        step sent under another tag fails the step at once (``StepDiffersError`` through the
        sink's ``step_aborted``; see ``Inlet``'s design note). Loop thread."""
        self._control.at_step(step)
        self._inlet.at_step(step, plan)

    def blame(self, step: int, ranks: Iterable[int], *, timed_out: bool = True) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive: at ``step``
        it timed out waiting for (or lost) the pipeline ranks ``ranks``. The first cause
        recorded wins (it is the closest to the root)."""
        self._control.blame(step, ranks, timed_out=timed_out)

    def blame_global(self, step: int, ranks: Iterable[int], how: str) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive, in global ranks
        of the job (any pipeline): at ``step`` the ranks ``ranks`` stopped responding
        (``how`` "timed_out"), were lost ("lost") or failed by themselves ("failed"), as a
        collective of the control group found (``_pulse``). The first cause recorded wins."""
        self._control.blame_global(step, ranks, how)

    @property
    def broken(self) -> bool:
        """Whether the channel failed for good (a lost peer, a corrupt message): every later
        step fails, and its CLOSE carries the cause."""
        return self._inlet.failed is not None

    def abort(
        self, step: int, cause: str, *, origin: int | None = None, kind: int = FailureKind.OTHER
    ) -> bool:
        """Tell every rank of the pipeline that ``step`` failed (see the design note): send
        an ABORT down every outbound edge, once per step. Loop thread.

        Args:
            step: The failed step.
            cause: Why, as text for messages (cut to 1 KiB); never parsed.
            origin: The global rank where it failed (default: this one).
            kind: What kind of failure (a ``FailureKind`` code, 0 .. 255): carried in the
                ABORT's header, relayed unchanged, and ``PeerStepError.kind`` on every rank.

        Returns:
            Whether it went out: False when this rank sent or passed on an ABORT of the step
            before, or when the channel is not open or broken (a broken channel's CLOSE
            carries the cause instead).
        """
        return self._control.abort(step, cause, origin=origin, kind=kind)

    async def origin(self, wait: float = 3.0) -> str | None:
        """The failure this rank's channel knows of, origin first ("rank 2 (global 2) was
        lost ..."), waiting up to ``wait`` s for one (a neighbour's CLOSE); None if none
        came. ``DistributedStage`` names it when a collective of the control group breaks.
        Loop thread."""
        return await self._control.origin(wait)

    def policy_stuck(self, step: int) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive: at ``step`` its
        policy did not return a decision before the step's watchdog fired."""
        self._control.policy_stuck(step)

    async def stuck_policy(self, step: int, wait: float) -> tuple[int, str] | None:
        """The global rank whose policy did not return a decision at ``step`` and the cause
        its ABORT (``FailureKind.POLICY``) gave, waiting up to ``wait`` s for one; None if
        none came. Loop thread."""
        return await self._control.stuck_policy(step, wait)

    def peer_failures(self) -> dict[int, str]:
        """Why peers failed, from their CLOSE: pipeline rank -> text (``DistributedStage``
        appends it to the error of a step that lost them)."""
        return self._control.peer_failures()

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the sender and listener threads (and the device path's issue thread);
        completions enter ``loop`` (default: the running loop).

        Raises:
            RuntimeError: Started before, or torch.distributed is not initialized.
            ResourceError: A thread cannot be started (the threads that started are closed,
                and the peers told that this rank failed).
        """
        if self._loop is not None:
            raise RuntimeError("the channel is already started")
        self._loop = loop or asyncio.get_running_loop()
        shared = self._io_mode == "shared"
        self._port = port = LoopPort(self._loop, batched=shared and bool(self._inbound))
        pg: Any = None
        group_rank: dict[int, int] = {}
        peers = [*self._inbound, *self._outbound]
        if peers:  # the process group's own send/recv, with ranks in the group
            pg = dist.group.WORLD if self._group is None else self._group
            if pg is None:
                raise RuntimeError("P2PChannel.start: torch.distributed is not initialized")
            for r in peers:
                group_rank[r] = dist.get_group_rank(pg, self._names.global_ranks[r])
        try:
            self._start_threads(pg, group_rank, port, shared)
        except ResourceError:
            # The threads that did start tell the peers this rank failed (a CLOSE with its
            # cause, "failed at step -1"), so they name it rather than wait for it.
            self._control.open()
            with contextlib.suppress(Exception):
                self.close(0.5, failed=True)
            raise
        self._control.open()

    def _start_threads(
        self, pg: Any, group_rank: dict[int, int], port: LoopPort, shared: bool
    ) -> None:
        control = self._control
        for dst in self._outbound:
            sender = Sender(
                dst,
                names=self._names,
                pg=pg,
                peer=group_rank[dst],
                dev=self._dev,
                limits=self._limits,
                lost=functools.partial(_edge_lost, control, port, dst),
                bye=shared,
                plan_of=self._inlet.plan_of,
            )
            sender.start()
            self._senders[dst] = sender
        self._receiver = Receiver(
            names=self._names,
            pg=pg,
            peers={src: group_rank[src] for src in self._inbound},
            dev=self._dev,
            limits=self._limits,
            io=self._io_mode,
            port=port,
            inlet=self._inlet,
            control=control,
            payload=self._payload,
        )
        if self._payload is not None:
            self._payload.start(port, self._senders)
        self._receiver.start()

    async def __aenter__(self) -> P2PChannel:
        self.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        # On an error, peers may never send their CLOSE: do not wait for them.
        timeout = 30.0 if exc_type is None else 0.5
        self._control.send_close(failed=exc_type is not None)
        # A thread of its own, not the loop's default executor: that one refuses work once
        # the interpreter has begun to exit (a stage closed by an ``atexit`` hook).
        await run_blocking(self.close, timeout, name="rrfp-close")

    def close(self, timeout: float = 30.0, *, failed: bool = False) -> None:
        """Send CLOSE to every outbound peer (after the messages already posted), and wait
        (up to ``timeout`` s) for the posted sends and for the peers' CLOSE on every inbound
        edge; on the device path, then for the payload sends in flight (their
        communicators are aborted when they do not complete in time). ``failed``: the
        CLOSE says this rank failed (with its cause), as ``__aexit__`` on an error."""
        self._control.send_close(failed=failed)
        deadline = time.monotonic() + timeout
        for s in self._senders.values():
            s.thread.join(max(0.0, deadline - time.monotonic()))
        if self._receiver is not None:
            self._receiver.join(deadline, time.monotonic)
        if self._payload is not None:
            self._payload.close(deadline)
        # Threads still blocked in gloo are waited for at exit (``_strays``' design note).
        _strays.leave([s.thread for s in self._senders.values()])
        if self._receiver is not None:
            _strays.leave(self._receiver.outliving())

    # ------------------------------------------------------------------ the parts' outlets

    def _send_control(
        self, msgs: list[torch.Tensor], what: tuple[int, object], skip: int | None
    ) -> None:
        """An ABORT down every outbound edge but ``skip`` (the ``ControlPath``'s outlet)."""
        for dst, sender in self._senders.items():
            if dst == skip:
                continue
            if self._payload is not None:
                self._payload.control(dst, msgs, what)  # behind the issue thread's headers
            else:
                sender.queue_control(msgs, what)

    def _close_edges(self, hdr: list[int]) -> None:
        """The CLOSE ``hdr`` down every outbound edge, which then ends (the
        ``ControlPath``'s outlet)."""
        if self._payload is not None:
            self._payload.close_edges(hdr)
            return
        for sender in self._senders.values():
            sender.end(hdr)


def _edge_lost(control: ControlPath, port: LoopPort, dst: int, exc: RRFPError) -> None:
    """An outbound edge's connection broke (any thread): the cause goes into this rank's
    CLOSE at once (a send from the loop thread raises the error right after, and the stage
    may close before the loop runs anything posted), the rest on the loop."""
    control.note_lost(dst)
    port.post(control.lose, dst, exc)
