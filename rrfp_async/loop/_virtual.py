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
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

__all__ = ["VirtualClockStall", "VirtualEventLoop", "new_virtual_event_loop"]


class VirtualClockStall(RuntimeError):
    """The virtual loop had no timer and no I/O for ``stall_timeout`` real seconds."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, stall_timeout: float | None) -> None:
        super().__init__()
        self.loop: VirtualEventLoop | None = None
        self.stall_timeout = stall_timeout

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            events = super().select(self.stall_timeout)
            if not events and self.stall_timeout is not None:
                raise VirtualClockStall(
                    f"nothing scheduled and no I/O for {self.stall_timeout} s of real time"
                )
            return events
        events = super().select(0)
        if events or timeout <= 0:
            return events
        assert self.loop is not None
        self.loop._advance(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock jumps to the next timer whenever nothing is runnable.

    Args:
        start: The initial clock value.
        stall_timeout: Real seconds to block when nothing at all is scheduled before raising
            ``VirtualClockStall`` (None: block forever, like a normal loop).
    """

    virtual_clock = True
    """Marks a loop whose ``time()`` is a simulated clock (stage loops then use it)."""

    def __init__(self, *, start: float = 0.0, stall_timeout: float | None = 60.0) -> None:
        sel = _VirtualSelector(stall_timeout)
        super().__init__(selector=sel)
        sel.loop = self
        self._vtime = float(start)
        # Timers due within the resolution count as due; the virtual clock is exact, so keep
        # it tiny but nonzero to absorb float rounding of (when - now) + now.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        """The virtual clock, seconds."""
        return self._vtime

    def _advance(self, dt: float) -> None:
        self._vtime += dt


def new_virtual_event_loop(**kwargs: Any) -> VirtualEventLoop:
    """A ``loop_factory`` for ``asyncio.Runner`` that makes a ``VirtualEventLoop``."""
    return VirtualEventLoop(**kwargs)
