"""Message delivery of a stage loop: inputs arriving, the ready set, and the wait for it.

A part of :class:`~rrfp_async.loop.StageLoop` (see the design note in ``_loop_fields``).

Design note
-----------
The ready set changes only on events, never by polling: a message arrives (``deliver``,
called by the channel on the loop thread) or one of the stage's own tasks ends; each
satisfies one input of a task (``_satisfy``), and the task whose last input that was
becomes ready and wakes the stage's one waiter (``_notify``). A message of a later step is
kept until that step starts (``_early``); one of a step that failed here is dropped; any
other that does not fit the step is a ``ProtocolError``. An untimed wait counts as
*blocked* for the deadlock monitor, and ``_notify`` unblocks the stage at once, so that a
monitor check in between never sees a stage that is about to run as blocked.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from typing import Any

from .._errors import PeerError, ProtocolError
from .._tasks import Task
from ._loop_failures import StepFailures
from ._state import StepState

__all__ = ["MessageDelivery"]

# The flight recorder's text per source rank (one per message).
_MESSAGE_FROM: dict[int, str] = {}


def _expire(w: asyncio.Future[bool]) -> None:
    if not w.done():
        w.set_result(False)


class MessageDelivery(StepFailures):
    """The message delivery of :class:`~rrfp_async.loop.StageLoop` (a mixin of it)."""

    def deliver(self, step: int, task: Task, payload: Any, src: int) -> None:
        """An input of ``task`` arrived from rank ``src`` (called by the channel)."""
        st = self._st
        if st is None or step != st.step:
            if step not in self._dead and (
                (st is None and step >= self._next_step) or (st is not None and step > st.step)
            ):
                self._early.setdefault(step, []).append((task, payload, src))
                return
            if step in self._dead:
                # Sent before its step failed: dropped, never handed to a later step.
                if self.recent is not None:
                    self.recent.append(
                        (
                            self._now(),
                            f"dropped (step {step} failed) message from rank {src} for",
                            task,
                        )
                    )
                return
            raise ProtocolError(
                f"rank {self.rank}: message for {task} of step {step} from rank {src} arrived"
                f" after that step ended"
            )
        pos = st.prog.pos.get(task)
        if pos is None:
            raise ProtocolError(
                f"rank {self.rank} step {step}: message from rank {src} names {task}, which is"
                " not a task of this rank"
            )
        if st.prog.src_rank[pos] != src:
            raise ProtocolError(
                f"rank {self.rank} step {step}: input of {task} came from rank {src}, expected"
                f" rank {st.prog.src_rank[pos]}"
            )
        if st.arrived[pos]:
            raise ProtocolError(
                f"rank {self.rank} step {step}: input of {task} from rank {src} arrived twice"
            )
        st.arrived[pos] = 1
        st.inbox[pos] = payload
        if self.recent is not None:
            text = _MESSAGE_FROM.get(src)
            if text is None:
                text = _MESSAGE_FROM[src] = f"message from rank {src} for"
            self.recent.append((self._now(), text, task))
        if self._obs is not None:
            self._obs.message(self, task, src)
        self._satisfy(st, pos)

    def _send_output(self, task: Task, out: Any, step: int) -> None:
        """The executor's output hook, on its compute thread: send a remote output now.

        Reads only data that is fixed while the task runs (the step's program). The output
        of a step that is no longer running (it failed while the task computed) is dropped.
        """
        st = self._st
        if st is None or st.step != step:
            return
        remote = st.prog.data_remote[st.prog.pos[task]]
        if remote is not None:
            self.endpoint.send(remote[0], st.step, remote[1], out)

    def peer_closed(self, src: int) -> None:
        """Rank ``src`` closed its channel: no message from it will come any more."""
        self._closed_peers.add(src)
        self._check_closed_peers()

    def _check_closed_peers(self) -> None:
        st = self._st
        if st is None or not self._closed_peers:
            return
        for pos, src in enumerate(st.prog.src_rank):
            if src in self._closed_peers and not st.arrived[pos]:
                self.fail(
                    PeerError(
                        f"rank {self.rank} step {st.step}: rank {src} closed its channel (it"
                        f" ended or failed) while {st.prog.order[pos]} still waits for its"
                        " message"
                    )
                )
                return

    def _satisfy(self, st: StepState, pos: int) -> None:
        st.missing[pos] -= 1
        if st.missing[pos] == 0:
            bisect.insort(st.ready, pos)
            st.version += 1
            if self._obs is not None:
                self._obs.ready(self, st.prog.order[pos])
            self._notify()

    def _notify(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)
            # Unblock now, not when this coroutine resumes, so that a monitor check in
            # between never sees a stage as blocked that is about to run.
            self.blocked = False
            if self.monitor is not None:
                self.monitor.unblocked(self)

    async def _wait(self, reason: Callable[[], str], timeout: float | None = None) -> bool:
        """Wait for the next change of the ready set; False if ``timeout`` passed first.

        ``reason`` says why nothing starts (the observer's ``stall`` event); it is called
        only when an observer listens, so an unobserved stall builds no text.
        Only an untimed wait counts as *blocked* for the deadlock monitor: a timed one
        has a wake-up of its own coming.
        """
        if self._failure is not None:
            raise self._failure
        loop = asyncio.get_running_loop()
        w: asyncio.Future[bool] = loop.create_future()
        self._waiter = w
        if self._obs is not None:
            self._obs.stall(self, reason())
        timer = None
        if timeout is None:
            self.blocked = True
            if self.monitor is not None:
                self.monitor.blocked(self)
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
                    self.monitor.unblocked(self)
