"""Each rank's heartbeat in the job's store: which ranks still run, asked when a step times out
or a collective breaks.

Design note: naming a rank that stopped
---------------------------------------
A SIGSTOPped (or wedged, or frozen) rank breaks no connection and sends nothing: its
neighbours wait for it until their watchdog fires and name it, but a rank two hops away
waits for a neighbour that is itself waiting, and a rank that waits in a collective (the
end-of-step agreement, ``new_group``) cannot tell which member did not come: gloo says
"timed out" or "Connection closed by peer", never a rank. What tells a stopped rank from a
waiting one is whether its process still runs at all.

So every rank of a job that builds stage groups beats in the job's store (the default
group's ``TCPStore``: torchrun's agent store, or the one rank 0 hosts): a daemon thread adds
1 to ``rrfp/pulse/<global rank>`` every ``PERIOD_S`` on a client connection of its own.
When a step times out or a collective breaks, the rank reads every rank's count, waits
``WINDOW_S`` (several periods) and reads again: the ranks whose count did not move are
*silent*: stopped, dead, or hung where even a Python thread cannot run. A rank that only
waits (for a message, in a collective) keeps beating, so it is never named. The reads use a
second connection with a short timeout: a store that does not answer (its host is the
stopped rank 0, without torchrun) gives no answer here, never a hang; the caller then says
what it knew before.

A rank that fails by itself where its peers cannot see it (its stage does not open: a
thread or a descriptor it could not have; its step fails before any message goes out) also
leaves a note on the same board (``rrfp/failed/<opening>/<global rank>/<step>``, ``open``
for the stage's opening): a peer whose collective then times out reads the notes of its
step, and names that rank and its error rather than "a rank is hung". ``<opening>`` counts
the stages this process opened (``opening()``): every rank of a job opens its stages
together, so the count is the same on all of them, and a later stage of the same job (its
steps numbered from 0 again) never reads an earlier stage's note.

Cost: one store round trip per rank every ``PERIOD_S`` (a store of
1,024 ranks takes about 2,000 adds a second), a thread that sleeps between them, and
``WINDOW_S`` added to the error of a timed-out step (the step failed already). The beat
stops at exit (an ``atexit`` hook joins the thread while Python still runs: a thread that
returns from a store call into a finalizing interpreter aborts the process, see
``_bridges``), when the default process group is destroyed (``_lifetime``'s wrapper of
``destroy_process_group``), and when a stage of another store or rank starts one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .._bridges import after_fork_in_child, run_blocking
from .._in_flight import exit_risks

__all__ = [
    "OPEN",
    "PERIOD_S",
    "WINDOW_S",
    "Pulse",
    "current",
    "default_store",
    "describe",
    "no_answer",
    "note",
    "notes",
    "opened",
    "opening",
    "silent_ranks",
    "silent_ranks_sync",
    "start",
    "stop",
]

PERIOD_S = 0.5
"""Seconds between a rank's beats."""

WINDOW_S = 2.0
"""Seconds between the two reads that find the silent ranks (four periods: a rank under
load still beats within it)."""

_TIMEOUT = datetime.timedelta(seconds=2)
"""A store call's timeout on the pulse's own connections."""

_GIVE_UP = 6
"""Store calls in a row that fail before a beat thread ends (about 30 s of a gone store)."""

_PREFIX = "rrfp/pulse/"
_FAILED = "rrfp/failed/"
OPEN = "open"
"""The step name of a failure to open a stage, on the board."""

_openings = 0
"""Stages this process opened (``opened``): the notes' generation."""

_TCPStore: Any = getattr(dist, "TCPStore", None)  # (not in torch.distributed's __all__)


def opened() -> int:
    """Count a stage's opening (every rank of the job counts its stages' openings alike);
    the notes left from here on are this opening's. Returns the new count."""
    global _openings
    with _lock:
        _openings += 1
        return _openings


def opening() -> int:
    """The count of the stage openings so far (the notes' generation; 0 before any)."""
    return _openings


def default_store() -> Any:
    """The default process group's store, or None (torch.distributed not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _tcp_store(store: Any) -> tuple[str, int] | None:
    """The (host, port) of the ``TCPStore`` under ``store`` (through ``PrefixStore``s)."""
    seen = 0
    while store is not None and seen < 8:
        if _TCPStore is not None and isinstance(store, _TCPStore):
            return str(store.host), int(store.port)
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


class Pulse:
    """One rank's heartbeat in a job's ``TCPStore``, and the question which ranks are silent.

    Args:
        host: The store's host.
        port: The store's port.
        rank: This process's global rank.
        world: The job's world size.
        period: Seconds between beats.
    """

    def __init__(
        self, host: str, port: int, rank: int, world: int, *, period: float = PERIOD_S
    ) -> None:
        self.host = host
        self.port = port
        self.rank = rank
        self.world = world
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: Any = None
        self._reader_lock = threading.Lock()

    def _client(self) -> Any:
        return _TCPStore(self.host, self.port, is_master=False, timeout=_TIMEOUT)

    def start(self) -> None:
        """Start beating (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="rrfp-pulse", daemon=True)
        self._thread.start()

    def stop(self, wait: float = 3.0) -> None:
        """Stop beating; wait up to ``wait`` s for the thread (it may be in a store call)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(wait)

    @property
    def beating(self) -> bool:
        """Whether the beat thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _beat(self) -> None:
        key = f"{_PREFIX}{self.rank}"
        store = None
        failures = 0
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._client()
                store.add(key, 1)
                failures = 0
            except Exception:  # the store is slow or gone: try again, less and less often
                store = None
                failures += 1
                if failures >= _GIVE_UP:  # gone for good (its job ended): nothing to tell
                    return
            self._stop.wait(min(self.period * 2**failures, 8.0))

    def counts(self) -> list[int] | None:
        """Every rank's beats so far (0: never beat), or None when the store does not answer
        (blocking: at most a few store timeouts)."""
        try:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = self._client()
                return [int(self._reader.add(f"{_PREFIX}{r}", 0)) for r in range(self.world)]
        except Exception:
            with self._reader_lock:
                self._reader = None
            return None

    def note(self, step: int | str, text: str) -> bool:
        """Leave this rank's failure at ``step`` (``OPEN``: its stage's opening) on the board,
        its first line, 500 characters at most; whether the store took it (blocking)."""
        first = text.strip().splitlines()[0][:500] if text.strip() else "failed"
        try:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = self._client()
                self._reader.set(f"{_FAILED}{opening()}/{self.rank}/{step}", first)
            return True
        except Exception:
            with self._reader_lock:
                self._reader = None
            return False

    def notes(self, steps: list[int | str]) -> dict[int, str] | None:
        """The notes other ranks left for ``steps``: global rank -> the first one found, in
        the order of ``steps``, left since this process's last stage opening; None when the
        store does not answer (blocking)."""
        gen = opening()
        try:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = self._client()
                out: dict[int, str] = {}
                for r in range(self.world):
                    if r == self.rank:
                        continue
                    for st in steps:
                        key = f"{_FAILED}{gen}/{r}/{st}"
                        if self._reader.check([key]):
                            out[r] = bytes(self._reader.get(key)).decode(errors="replace")
                            break
                return out
        except Exception:
            with self._reader_lock:
                self._reader = None
            return None

    def silent(self, window: float = WINDOW_S) -> list[int] | None:
        """The global ranks other than this one whose beat did not move in ``window`` s (see
        the design note); None when the store does not answer. Blocking: ``window`` s and
        two rounds of reads."""
        before = self.counts()
        if before is None:
            return None
        time.sleep(window)
        after = self.counts()
        if after is None:
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]


_lock = threading.Lock()
_current: Pulse | None = None
_all: list[Pulse] = []


def start(store: Any, rank: int, world: int) -> Pulse | None:
    """This process's pulse in ``store``'s job, started once (a pulse of another store or
    rank is stopped first); None when ``store`` is no ``TCPStore`` (a ``FileStore``, a
    single process) or the world has one rank."""
    global _current
    addr = _tcp_store(store) if world > 1 else None
    with _lock:
        old = _current
        if (
            old is not None
            and addr == (old.host, old.port)
            and (rank, world)
            == (
                old.rank,
                old.world,
            )
        ):
            return old
        _current = None
    if old is not None:
        old.stop(wait=0.0)  # (its thread ends at its next beat; the exit joins it)
    if addr is None:
        return None
    pulse = Pulse(addr[0], addr[1], rank, world)
    pulse.start()
    with _lock:
        _current = pulse
        _all.append(pulse)
    return pulse


def stop() -> None:
    """Stop this process's pulse (its default group is being destroyed)."""
    global _current
    with _lock:
        old, _current = _current, None
    if old is not None:
        old.stop(wait=0.0)


def current() -> Pulse | None:
    """This process's pulse, if one beats."""
    with _lock:
        return _current


async def silent_ranks(window: float = WINDOW_S) -> list[int] | None:
    """The silent ranks (``Pulse.silent``) of this process's pulse, from the event loop (the
    reads run on a thread of their own); None without a pulse or an answer."""
    pulse = current()
    if pulse is None:
        return None
    try:
        async with asyncio.timeout(window + 4 * _TIMEOUT.total_seconds()):
            return await run_blocking(pulse.silent, window, name="rrfp-pulse-read")
    except TimeoutError:
        return None


async def note(step: int | str, e: BaseException) -> None:
    """Leave this rank's failure (``type: first line``) on the board (see the design note),
    from the event loop; nothing without a pulse."""
    pulse = current()
    if pulse is None:
        return
    text = f"{type(e).__name__}: {str(e).strip()}"
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(3 * _TIMEOUT.total_seconds()):
            await run_blocking(pulse.note, step, text, name="rrfp-pulse-note")


async def notes(steps: list[int | str]) -> dict[int, str] | None:
    """The notes other ranks left for ``steps`` (``Pulse.notes``), from the event loop."""
    pulse = current()
    if pulse is None:
        return None
    try:
        async with asyncio.timeout(3 * _TIMEOUT.total_seconds()):
            return await run_blocking(pulse.notes, steps, name="rrfp-pulse-read")
    except TimeoutError:
        return None


async def no_answer() -> None:
    """What a question has when nobody can be asked (the callers gather it with the rest)."""
    return None


def silent_ranks_sync(window: float = WINDOW_S) -> list[int] | None:
    """``silent_ranks`` for code without an event loop (``build_groups``)."""
    pulse = current()
    return None if pulse is None else pulse.silent(window)


def describe(ranks: list[int], name: Callable[[int], str], *, broke: bool) -> str:
    """What the silent ``ranks`` are, for an error's first line: "rank 2 (global 2) stopped
    responding (...)", or, where a connection broke too (``broke``), "... was lost (...)"."""
    names = ", ".join(name(r) for r in ranks)
    verb = ("were" if len(ranks) > 1 else "was") if broke else ""
    if broke:
        return (
            f"{names} {verb} lost (its heartbeat in the job's store stopped and a connection"
            " broke: the process died or was killed)"
        )
    return (
        f"{names} stopped responding (its heartbeat in the job's store stopped for"
        f" {WINDOW_S:g} s: the process is stopped, dead, or hung where no Python thread runs)"
    )


_EXIT_JOIN_S = 2 * _TIMEOUT.total_seconds() + 1.0
"""How long the exit waits for the beat threads: a beat in a store call ends within two store
timeouts (a new connection, then the add)."""

_left: list[threading.Thread] = []
"""Beat threads still in a store call after the exit's wait (see ``_stop_all``)."""


def _stop_all() -> None:
    """At exit: stop every beat and wait for its thread while Python still runs (a thread
    that returns from a store call into a finalizing interpreter aborts the process, see
    ``_in_flight``); a thread still in its call after ``_EXIT_JOIN_S`` is an exit risk."""
    with _lock:
        pulses, _all[:] = list(_all), []
    for p in pulses:
        p._stop.set()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for p in pulses:
        t = p._thread
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                _left.append(t)


def _forget() -> None:  # a forked child inherits no thread
    global _current, _lock
    _current = None
    _all.clear()
    _left.clear()
    _lock = threading.Lock()


atexit.register(_stop_all)  # (runs before ``_in_flight``'s exit, registered earlier)
exit_risks.append(lambda: any(t.is_alive() for t in _left))
after_fork_in_child(_forget)
