"""The running step of a stage: its state, its ready set, inputs arriving, and the one wait.

Design note
-----------
The ready set changes only on events, never by polling: a message arrives (``deliver``,
called through the stage by the channel on the loop thread) or one of the stage's own tasks
ends; each satisfies one input of a task (``satisfy``), and the task whose last input that
was becomes ready and wakes the step's one waiter (``notify``). An untimed wait counts as
*blocked* for the deadlock monitor, and ``notify`` unblocks the stage at once, so that a
monitor check in between never sees a stage that is about to run as blocked.

``fail`` ends the running step (or the next one) by waking the waiter with the error; the
dispatch loops raise it at their next turn. Only a broken channel (a ``ChannelError``) stays
set for every later step (``start`` clears any other).

:class:`StepRun` owns all of this: the step's :class:`~rrfp_async.loop._state.StepState`
(None between steps), the stage clock of that step, its guarded observer, the waiter, the
blocked flag, the step's failure and the peers that closed their channels. It knows the
stage only as the value it hands the monitor (``owner``).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import ChannelError, PeerError, PeerStepError, ProtocolError
from .._tasks import Task
from ._observe import GuardedObserver
from ._state import StepState

__all__ = ["BlockMonitor", "FlightRecorder", "StepRun"]

#: The flight recorder of a stage: ``(time, what, task)`` of its recent events.
FlightRecorder = collections.deque[tuple[float, str, Task]]

# The flight recorder's text per source rank (one per message).
_MESSAGE_FROM: dict[int, str] = {}


class BlockMonitor(Protocol):
    """A :class:`~rrfp_async.loop.StageMonitor` as the step's waiter calls it (the stage is
    typed ``Any``: the monitor protocol proper names ``StageLoop``, which imports this)."""

    def blocked(self, stage: Any) -> None:
        """``stage`` is waiting for its ready set to change and runs nothing."""

    def unblocked(self, stage: Any) -> None:
        """``stage`` is no longer blocked."""


def _expire(w: asyncio.Future[bool]) -> None:
    if not w.done():
        w.set_result(False)


class StepRun:
    """The running step of one stage (see the module's design note).

    Args:
        rank: The stage's pipeline rank (for messages).
        monitor: The deadlock monitor told when the stage blocks and unblocks, or None.
        owner: What the monitor is told blocks (the stage loop).
        recent: The stage's flight recorder, or None.
    """

    __slots__ = (
        "_closed_peers",
        "_closed_why",
        "_waiter",
        "blocked",
        "failure",
        "monitor",
        "now",
        "obs",
        "obs_error",
        "owner",
        "rank",
        "recent",
        "state",
    )

    def __init__(
        self,
        rank: int,
        *,
        monitor: BlockMonitor | None = None,
        owner: object = None,
        recent: FlightRecorder | None = None,
    ) -> None:
        self.rank = rank
        self.monitor = monitor
        self.owner = owner
        self.recent = recent
        #: The running step's state, None between steps.
        self.state: StepState | None = None
        #: The stage clock of the running (or last) step.
        self.now: Callable[[], float] = time.monotonic
        #: The running step's guarded observer (None: none, inactive, or it raised).
        self.obs: GuardedObserver | None = None
        #: What the observer raised during the running step (see ``_observe``).
        self.obs_error: BaseException | None = None
        #: Why the running (or next) step fails, once something failed it.
        self.failure: BaseException | None = None
        #: Whether the step waits, untimed, for its ready set to change (the monitor's view).
        self.blocked = False
        self._waiter: asyncio.Future[bool] | None = None
        self._closed_peers: set[int] = set()
        self._closed_why: dict[int, str] = {}  # what a closed peer's CLOSE said

    # ------------------------------------------------------------------ the step's life

    def clear_failure(self) -> BaseException | None:
        """A step is about to start: forget the last step's failure, unless the channel is
        broken (then every later step fails); return what stays."""
        f = self.failure
        if not isinstance(f, ChannelError) or isinstance(f, PeerStepError):
            self.failure = None
        return self.failure

    def start(self, st: StepState, now: Callable[[], float]) -> None:
        """``st`` is the running step from now on, timed by ``now``."""
        self.now = now
        self.state = st

    def end(self) -> None:
        """The step ended (well or not)."""
        self.state = None

    def computing(self) -> StepState | None:
        """The running step's state while one of its tasks is on the executor, else None."""
        st = self.state
        return st if st is not None and st.running >= 0 else None

    def fail(self, exc: BaseException) -> None:
        """End the running (or next) step with ``exc`` (a broken channel, a deadlock)."""
        if self.failure is None:
            self.failure = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)
            self.blocked = False

    # ------------------------------------------------------------------ inputs arriving

    def deliver(self, st: StepState, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` of the running step ``st`` arrived from rank ``src``.

        Raises:
            ProtocolError: ``task`` is not this rank's, its input comes from another rank,
                or it arrived before.
        """
        pos = st.prog.pos.get(task)
        if pos is None:
            raise ProtocolError(
                f"rank {self.rank} step {st.step}: message from rank {src} names {task}, which"
                " is not a task of this rank"
            )
        if st.prog.src_rank[pos] != src:
            raise ProtocolError(
                f"rank {self.rank} step {st.step}: input of {task} came from rank {src},"
                f" expected rank {st.prog.src_rank[pos]}"
            )
        if st.arrived[pos]:
            raise ProtocolError(
                f"rank {self.rank} step {st.step}: input of {task} from rank {src} arrived twice"
            )
        st.arrived[pos] = 1
        st.inbox[pos] = payload
        if self.recent is not None:
            text = _MESSAGE_FROM.get(src)
            if text is None:
                text = _MESSAGE_FROM[src] = f"message from rank {src} for"
            self.recent.append((self.now(), text, task))
        if self.obs is not None:
            self.obs.message(task, src)
        self.satisfy(st, pos)

    def peer_closed(self, src: int, *, why: str | None = None) -> None:
        """Rank ``src`` closed its channel: no message from it will come any more (``why``:
        what its CLOSE said, origin first: the error opens with it)."""
        self._closed_peers.add(src)
        if why is not None:
            self._closed_why[src] = why
        self.check_closed_peers()

    def check_closed_peers(self) -> None:
        """Fail the running step if one of its tasks waits for a peer that closed."""
        st = self.state
        if st is None or not self._closed_peers:
            return
        for pos, src in enumerate(st.prog.src_rank):
            if src in self._closed_peers and not st.arrived[pos]:
                why = self._closed_why.get(src)
                waits = f"{st.prog.order[pos]} still waits for its message"
                if why is None:
                    text = f"rank {src} closed its channel (it ended or failed) while {waits}"
                else:  # the origin its CLOSE passed on, not "rank 2 closed its channel"
                    text = f"{why}; rank {src}'s channel is closed, and {waits}"
                self.fail(PeerError(f"rank {self.rank} step {st.step}: {text}"))
                return

    def satisfy(self, st: StepState, pos: int) -> None:
        """One input of the task at ``pos`` is present; its last makes it ready."""
        st.missing[pos] -= 1
        if st.missing[pos] == 0:
            bisect.insort(st.ready, pos)
            st.version += 1
            if self.obs is not None:
                self.obs.ready(st.prog.order[pos])
            self.notify()

    def notify(self) -> None:
        """The ready set changed: wake the waiter."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)
            # Unblock now, not when this coroutine resumes, so that a monitor check in
            # between never sees a stage as blocked that is about to run.
            self.blocked = False
            if self.monitor is not None:
                self.monitor.unblocked(self.owner)

    async def wait(self, reason: Callable[[], str], timeout: float | None = None) -> bool:
        """Wait for the next change of the ready set; False if ``timeout`` passed first.

        ``reason`` says why nothing starts (the observer's ``stall`` event); it is called
        only when an observer listens, so an unobserved stall builds no text.
        Only an untimed wait counts as *blocked* for the deadlock monitor: a timed one
        has a wake-up of its own coming.
        """
        if self.failure is not None:
            raise self.failure
        loop = asyncio.get_running_loop()
        w: asyncio.Future[bool] = loop.create_future()
        self._waiter = w
        if self.obs is not None:
            self.obs.stall(reason())
        timer = None
        if timeout is None:
            self.blocked = True
            if self.monitor is not None:
                self.monitor.blocked(self.owner)
        else:
            timer = loop.call_later(max(0.0, timeout), _expire, w)
        try:
            return await w
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
            if self.blocked:
                self.blocked = False
                if self.monitor is not None:
                    self.monitor.unblocked(self.owner)
