"""Channel threads still blocked in gloo when their channel closed: waited for at exit.

Design note
-----------
A daemon thread blocked in a gloo wait that *returns* while the interpreter finalizes asks
for the GIL of a finalizing interpreter; CPython 3.11-3.13 ends it with ``pthread_exit``,
and the forced unwind through torch's C++ frames calls ``std::terminate`` ("terminate called
without an active exception", SIGABRT: the design note of ``distributed._lifetime``). A
channel closed after a failure waits for its peers' CLOSE only briefly (the peers may never
send one), so under load a receiver (or a sender to a slow peer) may still be blocked when
the program ends, and the peer's own close or exit, a moment later, ends that wait during
finalization: a rank that failed cleanly, with its error printed, exits by SIGABRT.

So a channel leaves its threads that outlive its close here (:func:`leave`), and an
``atexit`` hook, registered when this module is imported (before any stage opens, so it
runs after ``_lifetime``'s hook, which closes the stages still open at exit), waits for
them, ``DRAIN_S`` seconds at most in all, while Python can still run them to their end. A
peer that closes or exits within that time ends their waits; a thread still blocked after
it (a peer that hangs) is left as before. The shared receive of a broken edge is left here
too: gloo does not fail it for the broken pair, but the other peers' exit ends it.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Iterable

from .._in_flight import exit_risks

__all__ = ["DRAIN_S", "leave", "left"]

DRAIN_S = 5.0
"""The longest the interpreter's exit waits for the threads left here, in all."""

_LOCK = threading.Lock()
_LEFT: list[threading.Thread] = []


def leave(threads: Iterable[threading.Thread]) -> None:
    """Wait at exit for those of ``threads`` still alive (see the design note)."""
    alive = [t for t in threads if t.is_alive()]
    if alive:
        with _LOCK:
            _LEFT[:] = [t for t in _LEFT if t.is_alive()] + alive


def left() -> list[threading.Thread]:
    """The threads left here that are still alive."""
    with _LOCK:
        return [t for t in _LEFT if t.is_alive()]


def _drain(limit: float = DRAIN_S) -> None:
    deadline = time.monotonic() + limit
    for t in left():
        t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_drain)
exit_risks.append(lambda: bool(left()))  # (see ``_bridges._exit``)
