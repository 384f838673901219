"""Step-traced logs with structlog: one event per state transition of a stage.

``rank``, ``stage`` and ``step`` are bound through ``structlog.contextvars`` when a step
starts, ``task`` while a task runs; asyncio tasks inherit them, so log lines of user code
running inside a stage's step carry them too. Event names are the constants of
``rrfp_async.observability._events``.

The observer's own events do not rely on that binding for where they happened: they pass
``rank``, ``stage``, ``step`` and ``clock`` explicitly (see ``LogObserver``), because in a
one-process pipeline a message is delivered, and its consumer becomes ready, inside the
*sending* stage's coroutine, whose context holds the sender's ``rank`` and ``stage``.
Explicit keys win over bound ones (``merge_contextvars`` only fills in missing keys).

Cost: the stage calls an observer only while it is *active*; ``LogObserver.active`` is
false when the logger filters out INFO, so disabled logging costs one check per step.
Per-transition events are DEBUG; step start/end are INFO.

Where the events go (a library's manners). Until someone configures structlog, the
library's logger is a ``structlog.stdlib.BoundLogger`` on the standard library logger
``logging.getLogger("rrfp_async")``: the application's handlers, levels and filters apply
(with none configured, Python's last-resort handler prints warnings and above to stderr,
and a ``LogObserver`` stays inactive, so debug events cost nothing and print nothing). A
record's message renders as ``event key=value ...``; its ``msg`` is the event dict itself
(a ``dict`` whose ``str`` is that text), so a ``structlog.stdlib.ProcessorFormatter`` on
the application's handler renders the same fields as structured output. An application
that configures structlog itself gets the library's events through its configuration
(``structlog.get_logger("rrfp_async")``), and ``configure_logging`` is the one-call setup
of the CLI and scripts: structlog straight to a stream, JSON or console.

One record, one write. Several processes often share one stderr (a spawned job, torchrun
under a pipe); a record written in pieces (``print`` writes the text and then the newline)
can be glued to or cut by another process's record. ``configure_logging``'s writer
(``LineWriter``) renders the whole line, newline included, and hands it to the operating
system in one ``os.write`` on the stream's file descriptor (after flushing what the stream
buffered before), or, for a stream without one, in one ``write`` and a ``flush`` under a
lock. A single ``write(2)`` is never interleaved with another process's on a regular file;
on a pipe POSIX guarantees it for up to ``PIPE_BUF`` bytes (4096 on Linux), which every
per-transition event fits in (a long ``stage_dump`` may exceed it).

Containment (ARCHITECTURE invariant 8: logging never breaks a step). A log sink can fail
(a full disk: ``OSError(ENOSPC)``, a closed pipe). ``configure_logging``'s writer reports
the first failure once on stderr and is then disabled; ``LogObserver`` does the same for
whatever its logger raises (a logger of the application's). Training goes on without
those log lines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TextIO, TypeVar

import structlog
from structlog.contextvars import bind_contextvars, unbind_contextvars

from .._tasks import Task
from . import _events as ev

if TYPE_CHECKING:
    from ..loop import StageLoop, StepStats

__all__ = ["LogFormat", "LogObserver", "configure_logging", "get_logger", "log_stage_dump"]

LogFormat = Literal["json", "console"]
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


_P = ParamSpec("_P")
_R = TypeVar("_R")


def report_log_failure(what: str, exc: BaseException) -> None:
    """Say once, on stderr, that ``what`` failed with ``exc`` and is disabled from now on
    (the caller disables it). A stderr that fails too is left alone."""
    with contextlib.suppress(Exception):  # nowhere left to report to
        print(
            f"rrfp_async: warning: {what} raised {type(exc).__name__}: {exc}; it is disabled"
            " from now on (log lines are dropped, training goes on)",
            file=sys.stderr,
            flush=True,
        )


class LineWriter:
    """A structlog logger that writes each rendered record as one whole line, in one write.

    With a file descriptor (``stream.fileno()``), the line (newline included, encoded as
    the stream encodes) goes out in one ``os.write`` after the stream is flushed (so what
    the process printed before comes first); otherwise ``stream.write(line)`` and
    ``stream.flush()`` run under a lock. The first failing write is reported once on
    stderr and disables the writer: later lines are dropped (a full disk must not fail
    training steps).

    Args:
        stream: The stream to write to.

    Attributes:
        broken: What the stream raised, once it did.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.broken: BaseException | None = None
        self._lock = threading.Lock()
        # A text stream has an encoding; a StringIO-like or a test double may not.
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            self._fd: int | None = stream.fileno()
        except Exception:  # io.StringIO, a wrapper without a descriptor
            self._fd = None

    def _failed(self, e: Exception) -> None:
        self.broken = e
        report_log_failure(f"the log stream {self.stream!r}", e)

    def msg(self, message: str) -> None:
        """Write ``message`` and a newline as one record (dropped once the stream failed)."""
        if self.broken is not None:
            return
        line = message + "\n"
        with self._lock:
            try:
                if self._fd is None:
                    self.stream.write(line)
                    self.stream.flush()
                    return
                data = memoryview(line.encode(self._encoding, "backslashreplace"))
                self.stream.flush()
                while data:  # a blocking write is whole; a signal may cut it short
                    data = data[os.write(self._fd, data) :]
            except Exception as e:
                self._failed(e)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _render_for_stdlib(
    logger: Any, method_name: str, event_dict: structlog.typing.EventDict
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The last processor of the default (standard library) logger: the record's ``msg``
    is the event dict, which prints as ``event key=value ...`` with any formatter and is
    what a ``structlog.stdlib.ProcessorFormatter`` unpacks (``wrap_for_formatter``)."""
    return (_Event(event_dict),), {"extra": {"_logger": logger, "_name": method_name}}


class _Event(dict[str, Any]):
    """An event dict whose text is ``event key=value ...`` (a log record's message)."""

    def __str__(self) -> str:
        rest = " ".join(f"{k}={v!r}" for k, v in self.items() if k != "event")
        event = str(self.get("event", ""))
        return f"{event} {rest}" if rest else event


_STDLIB_LOGGER: Any = None


def _stdlib_logger() -> Any:
    global _STDLIB_LOGGER
    if _STDLIB_LOGGER is None:
        _STDLIB_LOGGER = structlog.stdlib.BoundLogger(
            logging.getLogger("rrfp_async"),
            [
                structlog.stdlib.filter_by_level,
                structlog.contextvars.merge_contextvars,
                _render_for_stdlib,
            ],
            {},
        )
    return _STDLIB_LOGGER


def get_logger() -> Any:
    """The library's structlog logger.

    Returns:
        ``structlog.get_logger("rrfp_async")`` once structlog is configured (by the
        application, or by ``configure_logging``); before that, a
        ``structlog.stdlib.BoundLogger`` on the standard library logger ``"rrfp_async"``,
        so that the application's ``logging`` handlers and levels apply.
    """
    if structlog.is_configured():
        return structlog.get_logger("rrfp_async")
    return _stdlib_logger()


def configure_logging(
    *, format: LogFormat = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """Configure structlog for step-traced logs (an application-level choice: the CLI's
    ``--log-format`` / ``--log-level``). Without it, the library logs through the standard
    library's ``logging`` (logger ``"rrfp_async"``).

    Every record is one line written whole with one write (see ``LineWriter``), so several
    processes can share one stream (``stderr`` of a spawned job) without gluing lines.

    Args:
        format: ``"json"`` (one JSON object per line) or ``"console"`` (coloured columns).
        level: ``debug`` (every transition), ``info`` (steps), ``warning``, ``error``.
        stream: Where to write (default stderr).

    Raises:
        ValueError: Unknown format or level.
    """
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ValueError(f"unknown log level {level!r}; choose from {sorted(_LEVELS)}")
    renderer: Any
    if format == "json":
        renderer = structlog.processors.JSONRenderer()
    elif format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        raise ValueError(f"unknown log format {format!r}; choose 'json' or 'console'")
    writer = LineWriter(stream or sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=lambda *args: writer,
        cache_logger_on_first_use=False,
    )


def _enabled(log: Any, level: int) -> bool:
    # structlog's filtering bound loggers spell it is_enabled_for, stdlib loggers isEnabledFor.
    check = getattr(log, "is_enabled_for", None) or getattr(log, "isEnabledFor", None)
    if check is None:
        bound = log.bind()  # resolve a lazy proxy to the configured wrapper
        check = getattr(bound, "is_enabled_for", None) or getattr(bound, "isEnabledFor", None)
    return True if check is None else bool(check(level))


def _contained(
    method: Callable[Concatenate[LogObserver, _P], None],
) -> Callable[Concatenate[LogObserver, _P], None]:
    """Run an observer method; if its logger raises, report it once and go quiet."""

    @functools.wraps(method)
    def run(self: LogObserver, *args: _P.args, **kwargs: _P.kwargs) -> None:
        if self.broken is not None:
            return
        try:
            method(self, *args, **kwargs)
        except Exception as e:
            self.broken = e
            self._debug = False
            report_log_failure(f"LogObserver's logger {self.log!r}", e)

    return run  # type: ignore[return-value]


class LogObserver:
    """A ``StageObserver`` that writes one structlog event per transition.

    Every event it writes names where and when it happened, from the stage it is called
    for (not from the bound context, which in a one-process pipeline can be another
    stage's):

    * ``rank``: the global rank (the ``rank`` argument, default the pipeline rank);
    * ``stage``: the pipeline rank of the stage;
    * ``step``: the step being run;
    * ``clock``: the stage's loop clock, ``stage.now()``, in seconds: virtual seconds under
      the simulator's ``VirtualEventLoop`` (so a line can be placed on the simulated
      timeline and on its trace), the monotonic clock otherwise. The renderer's
      ``timestamp`` stays wall-clock time.

    Args:
        logger: A structlog logger (default: ``get_logger()``, looked up again at every
            step, so that logging configured after the observer was made applies: the
            standard library's ``"rrfp_async"`` logger until structlog is configured).
        rank: The global rank to log as ``rank`` (default: the stage's pipeline rank).

    Attributes:
        broken: What the logger raised, once it did (the observer is then inactive: the
            failure is reported once on stderr and the steps go on without it).
    """

    def __init__(self, logger: Any = None, *, rank: int | None = None) -> None:
        self._own = logger is None
        self.log = logger if logger is not None else get_logger()
        self.rank = rank
        self._debug = False
        self.broken: BaseException | None = None

    @property
    def active(self) -> bool:
        """Whether anything would be written (INFO enabled); re-read every step."""
        if self.broken is not None:
            return False
        try:
            if self._own:
                self.log = get_logger()
            self._debug = _enabled(self.log, logging.DEBUG)
            return self._debug or _enabled(self.log, logging.INFO)
        except Exception as e:
            self.broken = e
            report_log_failure(f"LogObserver's logger {self.log!r}", e)
            return False

    def _where(self, stage: StageLoop) -> dict[str, Any]:
        """The rank, stage, step and loop clock of an event on ``stage``."""
        return {
            "rank": stage.rank if self.rank is None else self.rank,
            "stage": stage.rank,
            "step": stage.step,
            "clock": stage.now(),
        }

    @_contained
    def step_start(self, stage: StageLoop) -> None:
        where = self._where(stage)
        bind_contextvars(rank=where["rank"], stage=where["stage"], step=where["step"])
        self.log.info(
            ev.STEP_START,
            **where,
            hint=stage.schedule.hint_name,
            policy=stage.policy_name,
            tasks=len(stage.schedule.hint[stage.rank]),
            max_inflight=stage.schedule.bounds[stage.rank],
        )

    @_contained
    def message(self, stage: StageLoop, task: Task, src: int) -> None:
        if self._debug:
            self.log.debug(ev.MESSAGE, **self._where(stage), task=str(task), src=src)

    @_contained
    def ready(self, stage: StageLoop, task: Task) -> None:
        if self._debug:
            self.log.debug(ev.TASK_READY, **self._where(stage), task=str(task))

    @_contained
    def decision(self, stage: StageLoop, task: Task, ready: Sequence[Task], idle: float) -> None:
        if self._debug:
            view = stage.view
            hinted = view.next_hinted
            self.log.debug(
                ev.DECISION,
                **self._where(stage),
                task=str(task),
                hinted=str(hinted),
                deviation=task != hinted,
                ready={str(t): view.hint_rank(t) for t in ready},
                policy=stage.policy_name,
                idle=idle,
                inflight=view.inflight,
            )

    @_contained
    def task_start(self, stage: StageLoop, task: Task) -> None:
        bind_contextvars(task=str(task))
        if self._debug:
            self.log.debug(ev.TASK_START, **self._where(stage), task=str(task))

    @_contained
    def task_end(self, stage: StageLoop, task: Task, start: float, end: float) -> None:
        if self._debug:
            self.log.debug(ev.TASK_END, **self._where(stage), task=str(task), duration=end - start)
        unbind_contextvars("task")

    @_contained
    def stall(self, stage: StageLoop, reason: str) -> None:
        if self._debug:
            self.log.debug(ev.STALL, **self._where(stage), reason=reason)

    @_contained
    def step_end(self, stage: StageLoop, stats: StepStats) -> None:
        self.log.info(
            ev.STEP_END,
            **self._where(stage),
            elapsed=stats.elapsed,
            busy=stats.busy,
            idle=stats.idle,
            peak_inflight=stats.peak_inflight,
            deviations=stats.deviations,
            tp_deduced=stats.tp_deduced,
        )
        unbind_contextvars("rank", "stage", "step", "task")

    @_contained
    def tp_decision(self, stage: StageLoop, task: Task, seq: int, sent: bool) -> None:
        if self._debug:
            self.log.debug(
                ev.TP_DECISION_SENT if sent else ev.TP_DECISION_RECEIVED,
                **self._where(stage),
                task=str(task),
                seq=seq,
            )

    @_contained
    def failed(self, stage: StageLoop, exc: BaseException, dump: str) -> None:
        log_stage_dump(stage, exc, dump, rank=self.rank)


def log_stage_dump(
    stage: StageLoop, exc: BaseException, text: str, *, rank: int | None = None
) -> None:
    """Log a failed step's state (event ``stage_dump``, ERROR).

    Args:
        stage: The stage that failed.
        exc: Its error.
        text: Its state (``StageLoop.dump()``).
        rank: The global rank to log as ``rank`` (default: the stage's pipeline rank).
    """
    get_logger().error(
        ev.STAGE_DUMP,
        rank=stage.rank if rank is None else rank,
        stage=stage.rank,
        step=stage.step,
        clock=stage.now(),
        error=f"{type(exc).__name__}: {exc}",
        dump=text,
    )
