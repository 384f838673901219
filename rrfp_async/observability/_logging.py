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

Containment (ARCHITECTURE invariant 8: logging never breaks a step). A log sink can fail
(a full disk: ``OSError(ENOSPC)``, a closed pipe). ``configure_logging`` wraps its stream so
that the first failure is reported once on stderr and the stream is then disabled;
``LogObserver`` does the same for whatever its logger raises (a logger of the
application's). Training goes on without those log lines.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Literal, ParamSpec, TextIO, TypeVar

import structlog
from structlog.contextvars import bind_contextvars, unbind_contextvars

from .._tasks import Task
from ..loop import StageLoop, StepStats
from . import _events as ev

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


class SafeStream:
    """A text stream whose first failing write or flush is reported once on stderr and
    disables it: later lines are dropped (a full disk must not fail training steps).

    Args:
        stream: The stream to write to.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.broken: BaseException | None = None

    def _failed(self, e: Exception) -> None:
        self.broken = e
        report_log_failure(f"the log stream {self.stream!r}", e)

    def write(self, text: str) -> int:
        """Write ``text`` (dropped once the stream failed); returns ``len(text)``."""
        if self.broken is None:
            try:
                self.stream.write(text)
            except Exception as e:
                self._failed(e)
        return len(text)

    def flush(self) -> None:
        """Flush the stream (nothing once it failed)."""
        if self.broken is None:
            try:
                self.stream.flush()
            except Exception as e:
                self._failed(e)


def get_logger() -> Any:
    """The library's structlog logger (configured by the application, or by
    ``configure_logging``)."""
    return structlog.get_logger("rrfp_async")


def configure_logging(
    *, format: LogFormat = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """Configure structlog for step-traced logs (an application-level choice).

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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(SafeStream(stream or sys.stderr)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def _enabled(log: Any, level: int) -> bool:
    check = getattr(log, "is_enabled_for", None)
    if check is None:
        bound = log.bind()  # resolve a lazy proxy to the configured wrapper
        check = getattr(bound, "is_enabled_for", None)
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
        logger: A structlog logger (default: ``get_logger()``).
        rank: The global rank to log as ``rank`` (default: the stage's pipeline rank).

    Attributes:
        broken: What the logger raised, once it did (the observer is then inactive: the
            failure is reported once on stderr and the steps go on without it).
    """

    def __init__(self, logger: Any = None, *, rank: int | None = None) -> None:
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
