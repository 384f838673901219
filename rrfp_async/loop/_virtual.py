"""A virtual-time asyncio event loop: a discrete-event simulator for unchanged asyncio code.

Design note
-----------
asyncio's loop asks its selector to wait ``timeout`` seconds for I/O until the next timer is
due. This loop's selector does not wait: it polls the real selector without blocking and, if
nothing is ready, *advances the virtual clock* by ``timeout``, which makes the next timer due
at once. Code built on ``asyncio.sleep``, ``call_later``, futures and tasks therefore runs
unchanged, in virtual time, as fast as the CPU allows. Real I/O (thread wake-ups through
``call_soon_threadsafe``) still works; when there is no timer at all the loop blocks on the
real selector, for at most ``stall_timeout`` real seconds.

Three guards turn a program that can no longer progress into an error instead of a hang,
raised out of ``run_until_complete`` with every task left exactly where it was waiting (so
the caller can say what each one waited for, then cancel them and run the loop again to let
them unwind):

* a *stall* (``VirtualClockStall``): nothing is scheduled and no I/O comes. With
  ``stall_when_idle`` (a closed simulation: only threads started through
  ``run_in_executor`` can wake the loop) it is raised at once when none of those is
  pending, rather than after ``stall_timeout`` real seconds;
* ``time_limit`` (``VirtualTimeLimit``): the clock would pass this virtual time, e.g. a
  coroutine that sleeps in a loop forever;
* ``wall_limit`` (``VirtualTimeLimit``): the loop has run this many real seconds, e.g. a
  coroutine that yields (``sleep(0)``) in a loop forever.

Exact time. asyncio runs every timer whose time is below ``clock + _clock_resolution``. A
fixed resolution is wrong at both ends of the scale: 1e-9 s made timers 1e-12 s apart run
together (tasks that short looked 2.5 times faster than possible), and beyond 2**24 seconds,
where neighbouring floats lie further apart than that, ``clock + (when - clock)`` could
round below ``when`` and the clock never reached the timer. So the clock jumps to the next
timer's own time (``_advance``), and the resolution is the spacing of floats at the
current clock (``math.ulp``): a timer is due exactly when its time is <= the clock, with
relative precision at any magnitude (a 1e-12 s task near t = 0, a 1e6 s task anywhere).
It costs one ``ulp`` per clock jump.

A closed simulation's iterations (``stall_when_idle``, no ``run_in_executor`` job pending,
no file descriptor registered but the loop's own wake-up pipe, not in debug mode) skip the
selector: no I/O can be ready there, so polling it only cost a system call per iteration (a
simulated task takes two or three iterations). ``_run_once`` then does exactly what
asyncio's does with a selector that returns nothing: the same cancelled-timer cleanup, the
same clock jump (``_advance``) when nothing is ready, the same due timers moved to the
ready queue in the same order, and the same callbacks run; when nothing at all is
scheduled it hands over to asyncio's own (the stall, or a wait for a thread). While the
next iteration would skip the selector too, ``_run_once`` runs it at once rather than
returning to ``run_forever`` (which only checks ``_stopping`` in between, as this loop
does); it runs each callback without ``Handle._run``'s frame (one that raises is reported
as asyncio reports it), and ``call_soon`` queues the same handle in two frames fewer. Tests
hold both paths to identical simulated steps (``tests/test_simulate_speed.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import math
import selectors
import time
from asyncio import base_events, format_helpers
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, TypeVarTuple, Unpack, runtime_checkable

from .._check import check_real
from .._errors import PlanError, RRFPError, StepTimeoutError

__all__ = [
    "VirtualClockLoop",
    "VirtualClockStall",
    "VirtualEventLoop",
    "VirtualTimeLimit",
    "new_virtual_event_loop",
]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


@runtime_checkable
class VirtualClockLoop(Protocol):
    """Optional: an event loop whose ``time()`` is a simulated clock.

    A stage reads its clock when a step starts: the running loop's ``time()`` when the loop
    has a true ``virtual_clock`` attribute (``VirtualEventLoop`` has; another simulated
    loop may declare it too), else ``time.monotonic`` (one clock for every process, so that
    spans of different ranks line up). Any other loop works without it.
    """

    virtual_clock: bool


class VirtualClockStall(RRFPError, RuntimeError):
    """Nothing is scheduled on the virtual loop and nothing outside it will wake it: no
    timer, and no I/O for ``stall_timeout`` real seconds (or, with ``stall_when_idle``, no
    pending ``run_in_executor`` job). Every task still waits for something no one will do.
    """


class VirtualTimeLimit(StepTimeoutError):
    """The virtual loop ran past its ``time_limit`` (virtual seconds) or ``wall_limit``
    (real seconds).

    Attributes:
        limit: ``"time_limit"`` or ``"wall_limit"``.
        value: The limit, seconds.
    """

    def __init__(self, message: str, *, limit: str, value: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.value = value


# asyncio's thresholds for rebuilding the timer heap without its cancelled timers
# (``BaseEventLoop._run_once``); the fast iteration applies the same rule.
_MIN_SCHEDULED = getattr(base_events, "_MIN_SCHEDULED_TIMER_HANDLES", 100)
_MIN_CANCELLED_FRACTION = getattr(base_events, "_MIN_CANCELLED_TIMER_HANDLES_FRACTION", 0.5)
_MAX_SELECT_TIMEOUT = getattr(base_events, "MAXIMUM_SELECT_TIMEOUT", 24 * 3600)


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, stall_timeout: float | None) -> None:
        super().__init__()
        self.loop: VirtualEventLoop | None = None
        self.stall_timeout = stall_timeout
        self.registered = 0  # file descriptors registered (the loop's own pipe is one)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = super().register(fileobj, events, data)
        self.registered += 1
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self.registered -= 1
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        assert loop is not None
        loop._check_wall()
        if timeout is None:
            if loop.stall_when_idle and loop._jobs == 0:
                events = super().select(0)
                if not events:
                    raise VirtualClockStall(
                        "nothing is scheduled (no timer, no ready callback), no I/O is ready and"
                        " no run_in_executor job is pending: nothing can wake the loop"
                    )
                return events
            events = super().select(self.stall_timeout)
            if not events and self.stall_timeout is not None:
                raise VirtualClockStall(
                    f"nothing scheduled and no I/O for {self.stall_timeout} s of real time"
                )
            return events
        events = super().select(0)
        if events or timeout <= 0:
            return events
        loop._advance(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock jumps to the next timer whenever nothing is runnable.

    Args:
        start: The initial clock value.
        stall_timeout: Real seconds to block when nothing at all is scheduled before raising
            ``VirtualClockStall`` (None: block forever, like a normal loop).
        stall_when_idle: Raise ``VirtualClockStall`` at once when nothing is scheduled, no
            I/O is ready and no ``run_in_executor`` job is pending (for closed simulations,
            where only such jobs can wake the loop; ``stall_timeout`` then only bounds the
            wait for a pending job).
        time_limit: Raise ``VirtualTimeLimit`` when the clock would pass this value (None:
            no limit).
        wall_limit: Raise ``VirtualTimeLimit`` once the loop has run this many real seconds,
            counted from its first iteration (None: no limit).

    Raises:
        PlanError: A limit that is not a number > 0 (``time_limit``: > ``start``).
    """

    virtual_clock = True
    """Marks a loop whose ``time()`` is a simulated clock (stage loops then use it)."""

    def __init__(
        self,
        *,
        start: float = 0.0,
        stall_timeout: float | None = 60.0,
        stall_when_idle: bool = False,
        time_limit: float | None = None,
        wall_limit: float | None = None,
    ) -> None:
        sel = _VirtualSelector(None)
        super().__init__(selector=sel)
        try:
            start = check_real("start", start)
            if stall_timeout is not None:
                stall_timeout = check_real("stall_timeout", stall_timeout, minimum=0.0)
            time_limit, wall_limit = _check_limits(start, time_limit, wall_limit)
        except PlanError:
            self.close()  # a refused argument leaves no open loop behind
            raise
        sel.stall_timeout = stall_timeout
        sel.loop = self
        self._vsel = sel
        # The fast iteration needs asyncio's loop internals as CPython 3.11-3.13 has them;
        # without them every iteration is asyncio's own (slower, the same steps).
        self._fast_path = all(
            hasattr(self, a) for a in ("_scheduled", "_ready", "_timer_cancelled_count", "_debug")
        )
        self._vtime = start
        # See "Exact time" in the module's note: a timer is due when its time <= the clock.
        self._clock_resolution = math.ulp(start)
        self.stall_when_idle = bool(stall_when_idle)
        self._jobs = 0
        #: Iterations run without the selector (see "A closed simulation" in the module's
        #: note); tests read it to see that a simulation takes that path.
        self.fast_iterations = 0
        self.time_limit = time_limit
        self.wall_limit = wall_limit
        self._wall_deadline: float | None = None

    def time(self) -> float:
        """The virtual clock, seconds."""
        return self._vtime

    def set_limits(self, *, time_limit: float | None, wall_limit: float | None) -> None:
        """Replace both limits; ``wall_limit`` then counts from the next loop iteration.

        Raises:
            PlanError: A limit that is not a number > 0 (``time_limit``: > the clock).
        """
        time_limit, wall_limit = _check_limits(self._vtime, time_limit, wall_limit)
        self.time_limit = time_limit
        self.wall_limit = wall_limit
        self._wall_deadline = None

    def run_in_executor(
        self,
        executor: concurrent.futures.Executor | None,
        func: Callable[[Unpack[_Ts]], _T],
        *args: *_Ts,
    ) -> asyncio.Future[_T]:
        """As asyncio's; counts the job as pending (see ``stall_when_idle``) until it ends."""
        fut = super().run_in_executor(executor, func, *args)
        self._jobs += 1
        fut.add_done_callback(self._job_done)
        return fut

    def _job_done(self, fut: asyncio.Future[Any]) -> None:
        self._jobs -= 1

    def call_soon(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        """As asyncio's: the same handle, queued the same way (two frames fewer outside
        debug mode; a simulated task queues two or three callbacks)."""
        me: Any = self  # asyncio's loop internals are not in its type stubs
        if me._debug or not self._fast_path:
            return super().call_soon(callback, *args, context=context)
        if me._closed:
            raise RuntimeError("Event loop is closed")
        handle = asyncio.Handle(callback, args, self, context)
        me._ready.append(handle)
        return handle

    def _selector_free(self) -> bool:
        """Whether the next iteration may skip the selector (see the module's note)."""
        me: Any = self  # asyncio's loop internals are not in its type stubs
        return (
            self._fast_path
            and self.stall_when_idle
            and not self._jobs
            and self._vsel.registered <= 1
            and not me._debug
            and bool(me._ready or me._scheduled or me._stopping)
        )

    def _run_once(self) -> None:
        # See "A closed simulation" in the module's note: asyncio's own iteration, less the
        # selector (which could return nothing at this point) and the debug-mode timing; and while
        # the next iteration would be one of these too, it runs at once instead of
        # after a return to ``run_forever`` (which does nothing in between but check
        # ``_stopping``, as this loop does).
        if not self._selector_free():
            super()._run_once()  # type: ignore[misc]
            return
        me: Any = self
        ready = me._ready
        popleft = ready.popleft
        heappop = heapq.heappop
        vsel = self._vsel
        while True:
            self.fast_iterations += 1
            if self.wall_limit is not None:
                self._check_wall()
            scheduled = me._scheduled
            n = len(scheduled)
            if n > _MIN_SCHEDULED and me._timer_cancelled_count / n > _MIN_CANCELLED_FRACTION:
                live = []
                for h in scheduled:
                    if h._cancelled:
                        h._scheduled = False
                    else:
                        live.append(h)
                heapq.heapify(live)
                me._scheduled = scheduled = live
                me._timer_cancelled_count = 0
            else:
                while scheduled and scheduled[0]._cancelled:
                    me._timer_cancelled_count -= 1
                    heappop(scheduled)._scheduled = False
            if not ready and not me._stopping:
                if not scheduled:  # only cancelled timers were left: asyncio's stall path
                    super()._run_once()  # type: ignore[misc]
                    return
                # The selector would have been asked to wait this long: jump instead.
                timeout = min(max(0.0, scheduled[0]._when - self._vtime), _MAX_SELECT_TIMEOUT)
                if timeout > 0:
                    self._advance(timeout)
            end = self._vtime + me._clock_resolution
            while scheduled:
                if scheduled[0]._when >= end:
                    break
                h = heappop(scheduled)
                h._scheduled = False
                ready.append(h)
            for _ in range(len(ready)):
                h = popleft()
                if h._cancelled:
                    continue
                # ``Handle._run`` inlined (one Python frame less per callback); a callback
                # that raises is reported exactly as asyncio does.
                try:
                    h._context.run(h._callback, *h._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    _report(h, exc)
            h = None  # break reference cycles when a callback raised
            # What run_forever would check, then what the next _run_once would.
            if (
                me._stopping
                or not (ready or me._scheduled)
                or self._jobs
                or vsel.registered > 1
                or me._debug
                or not self.stall_when_idle
            ):
                return

    def _advance(self, dt: float) -> None:
        # Jump to the next timer's own time, not to clock + dt: asyncio computed dt as
        # (when - clock), capped at a day, and clock + (when - clock) can round below when.
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        t = scheduled[0].when() if scheduled else self._vtime + dt
        if t <= self._vtime:  # never backwards, never stuck: the least step a float has
            t = math.nextafter(self._vtime, math.inf)
        if self.time_limit is not None and t > self.time_limit:
            self._vtime = self.time_limit
            raise VirtualTimeLimit(
                f"the virtual clock reached time_limit={self.time_limit} s with a timer still"
                f" pending {t - self.time_limit:.6g} s later",
                limit="time_limit",
                value=self.time_limit,
            )
        self._vtime = t
        self._clock_resolution = math.ulp(t)

    def _check_wall(self) -> None:
        if self.wall_limit is None:
            return
        now = time.perf_counter()
        if self._wall_deadline is None:
            self._wall_deadline = now + self.wall_limit
        elif now > self._wall_deadline:
            self._wall_deadline = None  # a later run of the loop gets the limit afresh
            raise VirtualTimeLimit(
                f"the loop ran past wall_limit={self.wall_limit} s of real time (virtual clock"
                f" at {self._vtime:.6g} s)",
                limit="wall_limit",
                value=self.wall_limit,
            )


def _report(h: asyncio.Handle, exc: BaseException) -> None:
    """What ``Handle._run`` does with a callback's exception: hand it to the loop's
    exception handler."""
    me: Any = h  # the handle's internals are not in asyncio's type stubs
    cb = format_helpers._format_callback_source(me._callback, me._args)
    context: dict[str, Any] = {
        "message": f"Exception in callback {cb}",
        "exception": exc,
        "handle": h,
    }
    if me._source_traceback:
        context["source_traceback"] = me._source_traceback
    me._loop.call_exception_handler(context)


def _check_limits(
    now: float, time_limit: float | None, wall_limit: float | None
) -> tuple[float | None, float | None]:
    if time_limit is not None:
        time_limit = check_real("time_limit", time_limit, minimum=now, strict_minimum=True)
    if wall_limit is not None:
        wall_limit = check_real("wall_limit", wall_limit, minimum=0.0, strict_minimum=True)
    return time_limit, wall_limit


def new_virtual_event_loop(**kwargs: Any) -> VirtualEventLoop:
    """A ``loop_factory`` for ``asyncio.Runner`` that makes a ``VirtualEventLoop``."""
    return VirtualEventLoop(**kwargs)
