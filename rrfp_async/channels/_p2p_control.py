"""The p2p channel's control messages: ABORT (a step failed somewhere), CLOSE (with the
cause of a failing rank), and what the loop learns from them. See ``P2PChannel``'s design
note (``_p2p``): "A failing rank says why when it closes", "A step fails everywhere or
nowhere". Control messages always travel on the gloo group, behind the messages already
posted on their edge (on the device path: through the issue thread, behind its headers).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .._errors import PeerStepError
from ._base import AbortSink, ClosingSink
from ._p2p_io import ChannelState
from ._wire import (
    CLOSE,
    FAILED,
    HEADER_LEN,
    LOST,
    MAGIC,
    MAX_BLAMED,
    TIMED_OUT,
    blame_text,
    encode_abort,
    pack_inline,
)

__all__ = ["ControlPath"]


class ControlPath(ChannelState):
    """``P2PChannel``'s control messages and failure bookkeeping (a part: see ``_p2p_io``)."""

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
            msgs = [pack_inline(header, None)]
            if text:
                msgs.append(torch.frombuffer(bytearray(text), dtype=torch.uint8))
            if self._dmode:
                # Behind the headers the issue thread posts on this edge.
                self.device_control(dst, msgs, what)
                continue
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
        sink = self._sink  # (``is not None`` first: mypy narrows no Optional to a protocol)
        if sink is not None and isinstance(sink, AbortSink):
            sink.step_aborted(step, exc)

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
        if self._dmode:
            self.device_close_edges(hdr)
            return
        for dst in self._queues:
            with self._locks[dst]:
                self.end_edge(dst, hdr)

    def end_edge(self, dst: int, hdr: list[int]) -> None:
        """Post the CLOSE ``hdr`` on edge ``dst`` through its sender thread, after what was
        posted before, and end that thread (the edge's lock held)."""
        q = self._queues[dst]
        un = self._unreaped[dst]
        if un:
            q.put(("reap", list(un)))
            un.clear()
        self._queued[dst] += 1
        msg = pack_inline(hdr, None)
        q.put(("send", [([msg], None)]))
        if self._io_mode == "shared":  # ends the peer's watcher of this edge
            q.put(("bye", [msg]))
        q.put(None)

    def close(self, timeout: float = 30.0, *, failed: bool = False) -> None:
        """Send CLOSE to every outbound peer (after the messages already posted), and wait
        (up to ``timeout`` s) for the posted sends and for the peers' CLOSE on every inbound
        edge; on the device path, then for the payload sends in flight (their
        communicators are aborted when they do not complete in time). ``failed``: the
        CLOSE says this rank failed (with its cause), as ``__aexit__`` on an error."""
        self._send_close(failed=failed)
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
        if self._dmode:
            self.device_close(deadline)

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

    def _peer_closed(self, src: int) -> None:
        self._closed_in.add(src)
        if self._closing:
            return
        sink = self._sink
        if sink is not None and isinstance(sink, ClosingSink):
            sink.peer_closed(src)

    def peer_failures(self) -> dict[int, str]:
        """Why peers failed, from their CLOSE: pipeline rank -> text (``DistributedStage``
        appends it to the error of a step that lost them)."""
        return dict(self._peer_failures)

    def _name_global(self, grank: int) -> str:
        """A global rank, named by its pipeline rank when it is one of this channel's."""
        r = self._by_global.get(grank)
        return f"global rank {grank}" if r is None else self._name(r)

    def _names_global(self, granks: Iterable[int]) -> str:
        names = [self._name_global(g) for g in granks]
        return ", ".join(names) if names else "an unknown rank"
