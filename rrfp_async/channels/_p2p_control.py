"""The p2p channel's control messages: ABORT (a step failed somewhere), CLOSE (with the
cause of a failing rank), and what the loop learns from them.

``ControlPath`` owns the bookkeeping: the steps whose ABORT went out, the cause a failing
rank's CLOSE carries, why peers failed, which inbound edges closed, whether the channel is
open or closing. It sends through two callables it is given (an ABORT down the outbound
edges, a CLOSE down every one), so it knows nothing of threads or groups: control messages
always travel on the gloo group, behind the messages already posted on their edge (on the
device path: through the issue thread, behind its headers). See ``P2PChannel``'s design
note (``_p2p``): "A failing rank says why when it closes", "A step fails everywhere or
nowhere".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import torch

from .._errors import FailureKind, RRFPError, peer_step_error
from ._base import AbortSink, ClosingSink
from ._p2p_inlet import Inlet
from ._p2p_io import Names
from ._wire import (
    CLEAN,
    CLOSE,
    CONNECTION_BROKE,
    FAILED,
    HEADER_LEN,
    LEFT,
    LOST,
    MAGIC,
    MAX_BLAMED,
    POLICY,
    TIMED_OUT,
    encode_abort,
    origin_text,
    pack_inline,
)

__all__ = ["ControlPath", "SendControl"]

SendControl = Callable[[list[torch.Tensor], tuple[int, object], "int | None"], None]
"""Posts a control message (``msgs``, what it is for errors) down every outbound edge except
the one to ``skip``, behind what is posted there (loop thread)."""


def _as_kind(kind: int) -> int:
    """A known ``FailureKind`` as the enum, an unknown code as it came."""
    try:
        return FailureKind(kind)
    except ValueError:
        return kind


class ControlPath:
    """ABORT and CLOSE: what this rank tells its peers when a step or the rank fails, and
    what it learns from theirs (loop thread, except ``close_hdr``'s callers).

    Args:
        names: How messages name ranks.
        inlet: The loop side: the sink told of an aborted step or a closed peer, and the
            error the channel broke with.
        send_control: Posts an ABORT's messages down the outbound edges (see
            ``SendControl``).
        close_edges: Posts the CLOSE header it is given down every outbound edge and ends
            the edges.
    """

    def __init__(
        self,
        names: Names,
        inlet: Inlet,
        *,
        send_control: SendControl,
        close_edges: Callable[[list[int]], None],
    ) -> None:
        self._names = names
        self._inlet = inlet
        self._send_control = send_control
        self._close_edges = close_edges
        self.started = False  # the edges are open (``open``)
        self.closing = False  # this rank's CLOSE went out: errors after it are expected
        # (cause, step, global ranks to blame): what this rank's CLOSE says when it failed.
        self._cause: tuple[int, int, tuple[int, ...]] | None = None
        self._last_step = -1  # the latest step of a message sent or received
        self._aborted: set[int] = set()  # steps whose ABORT this rank sent or passed on
        self._peer_failures: dict[int, str] = {}
        # What a peer's CLOSE said (it failed, or left cleanly after a step), for the stage's
        # error when it still waits for that peer: pipeline rank -> text, origin first.
        self._why: dict[int, str] = {}
        # A peer left cleanly: what this rank's CLOSE passes on if it fails and no other
        # cause was recorded (LEFT, the peer's last step, its global rank).
        self._left: tuple[int, int, tuple[int, ...]] | None = None
        self._news = asyncio.Event()  # set when ``_why`` learns something (loop thread)
        # A stuck policy (``FailureKind.POLICY``): step -> (origin global rank, cause text),
        # as its ABORT told; and the steps whose POLICY ABORT this rank sent or passed on.
        self._stuck: dict[int, tuple[int, str]] = {}
        self._stuck_told: set[int] = set()
        self._stuck_news = asyncio.Event()
        self._closed_in: set[int] = set()  # inbound edges whose CLOSE reached the loop

    # ------------------------------------------------------------------ state

    def open(self) -> None:
        """The channel's edges are open: ABORT and CLOSE may go out."""
        self.started = True

    @property
    def cause(self) -> tuple[int, int, tuple[int, ...]] | None:
        """What this rank's CLOSE says if it fails: (``FAILED``/``LOST``/``TIMED_OUT``,
        step, global ranks to blame), or None when nothing was recorded."""
        return self._cause

    @property
    def last_step(self) -> int:
        """The latest step of a message sent or received, or that the stage started."""
        return self._last_step

    @property
    def aborted(self) -> frozenset[int]:
        """The steps whose ABORT this rank sent or passed on."""
        return frozenset(self._aborted)

    def closed_in(self, src: int) -> bool:
        """Whether ``src``'s CLOSE reached the loop."""
        return src in self._closed_in

    def at_step(self, step: int) -> None:
        """A message of ``step`` went or came, or the stage starts it (any thread: the
        latest wins, a race only delays it by a message)."""
        if step > self._last_step:
            self._last_step = step

    def blame(self, step: int, ranks: Iterable[int], *, timed_out: bool = True) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive: at ``step``
        it timed out waiting for (or lost) the pipeline ranks ``ranks``. The first cause
        recorded wins (it is the closest to the root)."""
        if self._cause is None:
            g = self._names.global_ranks
            blamed = tuple(g[r] for r in ranks if r in g)[:MAX_BLAMED]
            self._cause = (TIMED_OUT if timed_out else LOST, step, blamed)

    def blame_global(self, step: int, ranks: Iterable[int], how: str) -> None:
        """``blame`` in global ranks, with what happened to them (``how``: "timed_out",
        "lost" or "failed"); see ``P2PChannel.blame_global``."""
        code = {"timed_out": TIMED_OUT, "lost": LOST, "failed": FAILED}[how]
        blamed = tuple(ranks)[:MAX_BLAMED]
        # It replaces a waiter's cause of the same step (the ranks whose messages did not
        # come: weaker evidence than a stopped heartbeat or a rank's own note).
        weak = self._cause is not None and self._cause[:2] == (TIMED_OUT, step)
        if blamed and (self._cause is None or weak):
            self._cause = (code, step, blamed)

    def policy_stuck(self, step: int) -> None:
        """Record why this rank is failing, for the CLOSE its peers receive: at ``step`` its
        policy did not return a decision before the watchdog fired. It replaces a cause
        recorded before (a peer's ABORT that came while the policy ran): this is the root."""
        if self._cause is None or self._cause[0] != LOST:
            self._cause = (POLICY, step, (self._names.global_ranks[self._names.rank],))

    def note_lost(self, peer: int) -> None:
        """``peer``'s connection broke: what this rank's CLOSE says, unless a cause was
        recorded first (any thread: one assignment; ``lose`` does the rest on the loop)."""
        if self._cause is None:
            self._cause = (LOST, self._last_step, (self._names.global_ranks[peer],))

    def lose(self, peer: int, exc: RRFPError) -> None:
        """``peer``'s connection broke (loop thread): blame it, then fail the channel."""
        if self._cause is None:
            self._cause = (LOST, self._last_step, (self._names.global_ranks[peer],))
        self._why.setdefault(peer, f"{self._names.name(peer)} was lost ({CONNECTION_BROKE})")
        self._news.set()
        self._inlet.fail(exc)

    def watch_lost(self, src: int, exc: RRFPError) -> None:
        """``src``'s pair broke (loop thread; shared I/O): blame it unless its CLOSE came."""
        if src not in self._closed_in:
            self.lose(src, exc)

    # ------------------------------------------------------------------ ABORT

    def abort(
        self, step: int, cause: str, *, origin: int | None = None, kind: int = FailureKind.OTHER
    ) -> bool:
        """Tell every rank of the pipeline that ``step`` failed: an ABORT down every outbound
        edge, once per step. See ``P2PChannel.abort``."""
        # A stuck policy's ABORT goes out even after this rank failed the step for a peer's
        # ABORT (the peers timed out at the same moment, waiting for it), once per step.
        if kind == FailureKind.POLICY and step not in self._stuck_told:
            self._stuck_told.add(step)
        elif step in self._aborted:
            return False
        self._aborted.add(step)
        if not self.started or self.closing or self._inlet.failed is not None:
            return False
        me = self._names.global_ranks[self._names.rank]
        self._send_abort(step, me if origin is None else origin, cause, int(kind))
        return True

    def _send_abort(
        self, step: int, origin: int, cause: str, kind: int, skip: int | None = None
    ) -> None:
        header, text = encode_abort(step, origin, cause, kind)
        msgs = [pack_inline(header, None)]
        if text:
            msgs.append(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        # No sequence number, no capacity change (see the design note).
        self._send_control(msgs, (-1, f"the ABORT of step {step}"), skip)

    def peer_aborted(self, src: int, step: int, origin: int, cause: str, kind: int = 0) -> None:
        """An ABORT of ``step`` came from ``src`` (loop thread): pass it on once, its kind
        unchanged, and fail the step on this rank too (see the design note). A stuck
        policy's ABORT is kept (``stuck_policy``) and passed on once, even for a step that
        failed here already."""
        if kind == FailureKind.POLICY and step not in self._stuck_told:
            self._stuck_told.add(step)
            self._stuck.setdefault(step, (origin, cause))
            self._stuck_news.set()
            if self._cause is not None and self._cause[:2] == (TIMED_OUT, step):
                self._cause = (POLICY, step, (origin,))  # (what this rank's CLOSE passes on)
            if step in self._aborted and not self.closing and self._inlet.failed is None:
                self._send_abort(step, origin, cause, kind, skip=src)
        if step in self._aborted:
            return
        self._aborted.add(step)
        if not self.closing and self._inlet.failed is None:
            self._send_abort(step, origin, cause, kind, skip=src)
        names = self._names
        exc = peer_step_error(kind)(
            f"{names.me()}: step {step} failed on {names.name_global(origin)}: {cause}; this"
            " rank fails the step too (its late messages are dropped) and runs the next one",
            step=step,
            origin=origin,
            cause=cause,
            kind=_as_kind(kind),
        )
        sink = self._inlet.sink  # (``is not None`` first: mypy narrows no Optional to a protocol)
        if sink is not None and isinstance(sink, AbortSink):
            sink.step_aborted(step, exc)

    # ------------------------------------------------------------------ CLOSE

    def send_close(self, *, failed: bool = False) -> None:
        """CLOSE down every outbound edge, behind the messages already queued, once; the
        CLOSE of a failed rank carries its cause (see the design note)."""
        if self.closing or not self.started:
            return
        self.closing = True
        hdr = [MAGIC, CLOSE] + [0] * (HEADER_LEN - 2)
        me = self._names.global_ranks[self._names.rank]
        # Clean: this rank's last step and itself, so that a peer still running a later step
        # says "rank 3 left after step 1" and passes it on (see the wire's module note).
        close: tuple[int, int, tuple[int, ...]] = (CLEAN, self._last_step, (me,))
        if failed:
            close = self._cause or self._left or (FAILED, self._last_step, (me,))
        cause, step, ranks = close
        hdr[2:5] = [cause, step, len(ranks)]
        hdr[5 : 5 + len(ranks)] = list(ranks)
        self._close_edges(hdr)

    def peer_failed(self, src: int, cause: int, step: int, ranks: tuple[int, ...]) -> None:
        """``src`` closed because it failed (loop thread): keep its cause for the error
        message, pass it on when this rank closes, and tell the stage the peer closed."""
        self._closed_in.add(src)
        if self._cause is None:
            self._cause = (cause, step, ranks)
        names = self._names
        if cause == FAILED and ranks == (names.global_ranks[src],):
            text = f"{names.name(src)} failed at step {step} with an error of its own (see"
            text += " that rank's output)"
        else:  # the origin first: the rank lost, left or failed, then who passed it on
            text = origin_text(cause, step, names.names_global(ranks), names.name(src))
        self._peer_failures[src] = self._why[src] = text
        self._news.set()
        self.peer_closed(src)

    def peer_left(self, src: int, step: int | None) -> None:
        """``src`` closed cleanly after ``step`` (None: its CLOSE did not say; loop thread):
        keep it for the error of a step that still waits for ``src``, and for this rank's
        CLOSE if it fails without another cause (the origin passed on, not re-described)."""
        if step is not None and step >= 0:
            names = self._names
            self._why[src] = f"{names.name(src)} left after step {step} (its stage closed cleanly)"
            if self._left is None:
                self._left = (LEFT, step, (names.global_ranks[src],))
            self._news.set()
        self.peer_closed(src)

    async def origin(self, wait: float) -> str | None:
        """The failure this channel knows of, origin first (a peer it lost, or what a
        peer's CLOSE passed on: lost, left, failed), waiting up to ``wait`` s for one to
        come (loop thread). For the error of a collective that broke: gloo's text names an
        address, never a rank, and a rank that is no neighbour of the lost one learns it
        only from its neighbour's CLOSE, a moment later."""
        if not self._why and wait > 0:
            try:
                async with asyncio.timeout(wait):
                    await self._news.wait()
            except TimeoutError:
                pass
        return next(iter(self._why.values()), None)

    async def stuck_policy(self, step: int, wait: float) -> tuple[int, str] | None:
        """The rank whose policy did not return a decision at ``step`` (its global rank) and
        the cause its ABORT gave, waiting up to ``wait`` s for one to come (loop thread):
        for the error of a rank whose watchdog fired at the same moment as that rank's,
        while it waited for it."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while step not in self._stuck and loop.time() < end:
            self._stuck_news.clear()
            try:
                async with asyncio.timeout(end - loop.time()):
                    await self._stuck_news.wait()
            except TimeoutError:
                break
        return self._stuck.get(step)

    def peer_closed(self, src: int) -> None:
        """``src`` sent its CLOSE (loop thread): tell a sink that listens, unless this rank
        is closing itself."""
        self._closed_in.add(src)
        if self.closing:
            return
        sink = self._inlet.sink
        if sink is not None and isinstance(sink, ClosingSink):
            why = self._why.get(src)
            if why is None:
                sink.peer_closed(src)
            else:
                sink.peer_closed(src, why=why)

    def peer_failures(self) -> dict[int, str]:
        """Why peers failed, from their CLOSE: pipeline rank -> text."""
        return dict(self._peer_failures)
