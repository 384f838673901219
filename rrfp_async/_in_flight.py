"""What completes on a foreign thread and has not yet, counted, and the program's exit, which
waits for it.

Design note: why the exit waits
-------------------------------
A torch future's completion callback is Python, run on the thread that completes the future
(a gloo worker, a C++ thread), and a blocking call's thread (``_bridges.run_blocking``)
returns into Python; either, if it happens while the interpreter finalizes, asks for the
GIL of a finalizing interpreter, which CPython 3.11-3.13 answers with ``pthread_exit``, and
the forced unwind through torch's C++ frames calls ``std::terminate`` (SIGABRT, "terminate
called without an active exception"). After the callback, the same gloo thread frees the
operation's ``Work`` and with it tensors whose Python objects it keeps: one GIL request more.
So ``_bridges`` counts every future it bridges until the future lets go of its callback,
and every blocking call until it returns; a collective posted for the peers and awaited by
no one (a failed step's agreement) is counted by :func:`track`. At exit the count is waited
for (:data:`EXIT_DRAIN_S` in all), then a moment more (:data:`_SETTLE_S`) when it had to
wait: a collective left posted by a failed step completes, with an error, when its peers
exit a moment later, inside the drain, while Python still runs. What is still in flight
after the drain waits for a peer that hangs (a stopped rank keeps a collective pending); the
peer's later end fails it while the interpreter finalizes, or in the C exit handlers
(SIGSEGV). A program that ends with an uncaught exception (status 1) then ends at once with
that status, its output flushed (``_exit``); any other leaves its exit as it is.

Design note: the works a failed step left are never freed at exit
------------------------------------------------------------------
After the callback, gloo's thread drops its reference to the operation's ``Work``; where
that is the last one, it frees the ``Work`` and the tensors in it, whose Python objects then
need the GIL. The settle above gives it :data:`_SETTLE_S` for that, which a loaded machine
can outlast (seen once in a fault campaign: a ``HANG`` victim's peer ended by SIGABRT, the
core showing gloo's ``runLoop`` in ``~AsyncAllgatherWork`` asking for the GIL while
``Py_FinalizeEx`` ran). So :func:`track` keeps a reference to each ``Work`` it counts (a step's
agreement: a row of integers): gloo's thread never holds the last one. A later ``track``
lets go of the works it found complete the time before (the job is running then: any thread
may free them); at exit the ones still kept are kept for good (their list is never freed:
the process ends without freeing them). A work that is awaited (``_bridges.work_future``)
is not kept: its awaiter holds it, and keeping every one would hold the tensors of a step's
last messages into the next step; one whose awaiter gave up (a timed-out wait) is freed on
gloo's thread within the settle, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EXIT_DRAIN_S", "IN_FLIGHT", "KEPT", "InFlight", "exit_risks", "in_flight", "track"]

EXIT_DRAIN_S = 5.0
"""The longest the interpreter's exit waits, in all, for torch futures whose callback has not
run and for blocking calls still running on their threads (see the design note)."""


_SETTLE_S = 0.25
"""How long the exit waits, after the last operation in flight completed, for its thread to
let go of it (see ``InFlight.drain``)."""


class InFlight:
    """What completes on a foreign thread and has not yet: counted, so that the program's
    exit can wait for it while Python still runs (see the design note)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._futures = 0  # torch futures whose (Python) completion callback has not run
        self._calls = 0  # blocking calls running on their dedicated threads

    def _after_fork(self) -> None:  # a child process inherits none of them
        self._cond = threading.Condition(threading.Lock())
        self._futures = self._calls = 0

    def add(self, *, future: bool) -> None:
        with self._cond:
            if future:
                self._futures += 1
            else:
                self._calls += 1

    def done(self, *, future: bool) -> None:
        with self._cond:
            if future:
                self._futures -= 1
            else:
                self._calls -= 1
            if self._futures <= 0 and self._calls <= 0:
                self._cond.notify_all()

    def counts(self) -> tuple[int, int]:
        """(torch futures whose callback has not run, blocking calls still running)."""
        with self._cond:
            return self._futures, self._calls

    def drain(self, limit: float = EXIT_DRAIN_S) -> bool:
        """Wait up to ``limit`` s until nothing is in flight; whether nothing is. When it
        had to wait, a moment more (``_SETTLE_S``): the thread that completed the last one
        lets go of the operation right after (gloo frees its ``Work``, and with it tensors
        whose Python objects it keeps: one more GIL request)."""
        with self._cond:
            if self._futures <= 0 and self._calls <= 0:
                return True
            done = self._cond.wait_for(
                lambda: self._futures <= 0 and self._calls <= 0, timeout=max(0.0, limit)
            )
        if done:
            time.sleep(_SETTLE_S)
        return done


IN_FLIGHT = InFlight()


def in_flight() -> tuple[int, int]:
    """(torch futures bridged here whose completion callback has not run, blocking calls of
    :func:`run_blocking` still running): what the program's exit waits for (briefly)."""
    return IN_FLIGHT.counts()


class _Kept:
    """The works ``track`` counted, each kept until a later ``track`` has seen it complete
    twice (the second design note): gloo's thread never drops the last reference."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[Any] = []  # still running, or complete since the last look
        self._seen: list[Any] = []  # complete at the last look: let go at the next

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._works, self._seen = [], []

    def add(self, work: Any) -> None:
        """Keep ``work``; let go of those found complete the time before."""
        with self._lock:
            done = [w for w in self._works if _completed(w)]
            gone = {id(w) for w in done}
            self._works = [w for w in self._works if id(w) not in gone]
            self._seen = done  # (those seen complete the time before: let go)
            self._works.append(work)

    def kept(self) -> int:
        """How many works are kept."""
        with self._lock:
            return len(self._works) + len(self._seen)

    def for_good(self) -> None:
        """At exit: keep what is kept until the process ends (never freed)."""
        with self._lock:
            _FOREVER.append((self._works, self._seen))
        # One reference more than anything holds: the list outlives the interpreter's
        # teardown (CPython: an object's id is its address).
        ctypes.pythonapi.Py_IncRef(ctypes.c_void_p(id(_FOREVER)))


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # (a work of another kind: kept until the exit)
        return False


_FOREVER: list[Any] = []
KEPT = _Kept()


def track(work: Any) -> None:
    """Count a posted collective as in flight until it completes, though nothing awaits it
    (a failed step's agreement, posted for the peers): the program's exit waits for it, and
    it is kept alive until well after it completed (see the module's design notes). gloo
    point-to-point ``Work`` has no future and is not counted: its waits run on threads that
    are (``run_blocking``)."""
    try:
        fut = work.get_future()
    except (RuntimeError, NotImplementedError):
        return
    if fut.done():
        return
    KEPT.add(work)
    IN_FLIGHT.add(future=True)
    fut.add_done_callback(_Count())


class _Count:
    """A completion callback that only counts: in flight until the future lets go of it."""

    __slots__ = ()

    def __call__(self, f: torch.futures.Future[Any]) -> None:
        pass

    def __del__(self) -> None:
        IN_FLIGHT.done(future=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=IN_FLIGHT._after_fork)
    os.register_at_fork(after_in_child=KEPT._after_fork)
exit_risks: list[Callable[[], bool]] = []
"""Other parts' answers to "is a thread of mine still blocked in torch's C++?" at exit (the
channel's threads left behind: ``channels._strays``)."""


def _exit() -> None:
    """The program exits (``atexit``, last): wait for what is in flight (``EXIT_DRAIN_S``).
    What still is after that waits for a peer that does not come (a hung or stopped rank
    keeps a collective pending); the peer's exit or kill later fails it, and its callback
    then runs while the interpreter finalizes or after (SIGABRT, or SIGSEGV in the C exit
    handlers). When the program ends with an uncaught exception (its status is 1 then), it
    ends here with that status instead, its output flushed: the error was printed, and the
    status stays the program's own."""
    done = IN_FLIGHT.drain()
    KEPT.for_good()
    if done and not any(risk() for risk in exit_risks):
        return
    last = getattr(sys, "last_value", None)  # the uncaught exception that ends the program
    if last is None or isinstance(last, SystemExit):
        return  # its status is not known here: leave the exit as it is
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


# Registered at this module's import (by ``_bridges``', before any stage's hooks): ``atexit``
# runs it last, after the stages still open were closed (``distributed._lifetime``).
atexit.register(_exit)
