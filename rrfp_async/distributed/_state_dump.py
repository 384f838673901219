"""A live view of a stuck job: on ``SIGUSR1`` every open ``DistributedStage`` of the
process writes its state, and a step timeout writes it too.

The state is the stage's own dump (``StageLoop.dump``: the step, the task running, the
ready and admitted sets, what each waiting task waits for, naming the message and the rank
it comes from, and the last events of the flight recorder), headed by the rank, the reason
and the time. It goes to the log (a warning on the ``rrfp_async`` logger) and, when the
stage has a ``trace_dir``, to ``state-rank{r}.txt`` there (written atomically, replaced by
each dump), where ``rrfp-async trace DIR`` prints every rank's beside the merged trace.

Design: a signal handler runs on the main thread between two bytecodes, while the stage's
event loop may be running on another thread (the synchronous face) or be the main thread
itself; reading the stage's state from the handler could see it half updated. So the
handler only schedules the dump on each stage's own loop (``call_soon_threadsafe``), which
runs it between two of its callbacks, where the state is consistent; a loop stuck in a
blocking call dumps when it returns (the step watchdog's dump covers that case). The
handler is installed once per process, from the main thread, when the first stage opens
(``signal.signal`` works there only), and chains to the handler it replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

__all__ = ["DUMP_SIGNAL", "STATE_FILE", "install", "register", "unregister", "write_state"]

_log = logging.getLogger("rrfp_async")

DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)
"""The signal that asks every open stage of a process for its state (None on Windows)."""

STATE_FILE = "state-rank{rank}.txt"


class _Dumps(Protocol):
    """What a stage gives the dump (``DistributedStage``)."""

    @property
    def trace_dir(self) -> Path | None: ...

    def _who(self) -> str: ...

    def _state_text(self) -> str: ...

    @property
    def _dump_loop(self) -> asyncio.AbstractEventLoop | None: ...

    @property
    def _dump_rank(self) -> int: ...


_open: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_previous: Any = None
_installed = False


def write_state(stage: _Dumps, reason: str) -> Path | None:
    """Log ``stage``'s state and write it to its trace directory; the file's path (None
    without a ``trace_dir``, or when the write failed: logged, never raised)."""
    text = (
        f"{stage._who()}: state ({reason}) at {time.strftime('%Y-%m-%d %H:%M:%S')}"
        f" (pid {os.getpid()})\n{stage._state_text()}\n"
    )
    _log.warning("%s", text.rstrip())
    if stage.trace_dir is None:
        return None
    path = Path(stage.trace_dir) / STATE_FILE.format(rank=stage._dump_rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("%s: could not write its state to %s: %r", stage._who(), path, e)
        return None
    return path


def _handler(signum: int, frame: Any) -> None:
    for stage in list(_open):
        loop = stage._dump_loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(write_state, stage, "SIGUSR1")
    prev = _previous
    if callable(prev):
        prev(signum, frame)


def install() -> bool:
    """Install the ``SIGUSR1`` handler, once per process; only the main thread can (False
    from another thread, or where the platform has no ``SIGUSR1``)."""
    global _installed, _previous
    if DUMP_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return _installed
    with _lock:
        if not _installed:
            _previous = signal.signal(DUMP_SIGNAL, _handler)
            _installed = True
    return True


def register(stage: Any) -> None:
    """``stage`` is open: a signal dumps it."""
    _open.add(stage)


def unregister(stage: Any) -> None:
    """``stage`` closed."""
    _open.discard(stage)
