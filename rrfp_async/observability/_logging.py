"""Step-traced logs with structlog: one event per state transition of a stage.

``rank``, ``stage`` and ``step`` are bound through ``structlog.contextvars`` when a step
starts, ``task`` while a task runs; asyncio tasks inherit them, so log lines of user code
running inside a stage's step carry them too. Event names are the constants of
``rrfp_async.observability._events``.

Cost: the stage calls an observer only while it is *active*; ``LogObserver.active`` is
false when the logger filters out INFO, so disabled logging costs one check per step.
Per-transition events are DEBUG; step start/end are INFO.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, Literal, TextIO

import structlog
from structlog.contextvars import bind_contextvars, unbind_contextvars

from .._tasks import Task
from ..loop._stage import StageLoop, StepStats
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
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def _enabled(log: Any, level: int) -> bool:
    check = getattr(log, "is_enabled_for", None)
    if check is None:
        bound = log.bind()  # resolve a lazy proxy to the configured wrapper
        check = getattr(bound, "is_enabled_for", None)
    return True if check is None else bool(check(level))


class LogObserver:
    """A ``StageObserver`` that writes one structlog event per transition.

    Args:
        logger: A structlog logger (default: ``get_logger()``).
        rank: The global rank to log as ``rank`` (default: the stage's pipeline rank).
    """

    def __init__(self, logger: Any = None, *, rank: int | None = None) -> None:
        self.log = logger if logger is not None else get_logger()
        self.rank = rank
        self._debug = False

    @property
    def active(self) -> bool:
        """Whether anything would be written (INFO enabled); re-read every step."""
        self._debug = _enabled(self.log, logging.DEBUG)
        return self._debug or _enabled(self.log, logging.INFO)

    def step_start(self, stage: StageLoop) -> None:
        bind_contextvars(
            rank=stage.rank if self.rank is None else self.rank, stage=stage.rank, step=stage.step
        )
        self.log.info(
            ev.STEP_START,
            hint=stage.schedule.hint_name,
            policy=stage.policy_name,
            tasks=len(stage.schedule.hint[stage.rank]),
            max_inflight=stage.schedule.bounds[stage.rank],
        )

    def message(self, stage: StageLoop, task: Task, src: int) -> None:
        if self._debug:
            self.log.debug(ev.MESSAGE, task=str(task), src=src)

    def ready(self, stage: StageLoop, task: Task) -> None:
        if self._debug:
            self.log.debug(ev.TASK_READY, task=str(task))

    def decision(self, stage: StageLoop, task: Task, ready: Sequence[Task], idle: float) -> None:
        if self._debug:
            view = stage._view
            hinted = view.next_hinted
            self.log.debug(
                ev.DECISION,
                task=str(task),
                hinted=str(hinted),
                deviation=task != hinted,
                ready={str(t): view.hint_rank(t) for t in ready},
                policy=stage.policy_name,
                idle=idle,
                inflight=view.inflight,
            )

    def task_start(self, stage: StageLoop, task: Task) -> None:
        bind_contextvars(task=str(task))
        if self._debug:
            self.log.debug(ev.TASK_START, task=str(task))

    def task_end(self, stage: StageLoop, task: Task, start: float, end: float) -> None:
        if self._debug:
            self.log.debug(ev.TASK_END, task=str(task), duration=end - start)
        unbind_contextvars("task")

    def stall(self, stage: StageLoop, reason: str) -> None:
        if self._debug:
            self.log.debug(ev.STALL, reason=reason)

    def step_end(self, stage: StageLoop, stats: StepStats) -> None:
        self.log.info(
            ev.STEP_END,
            elapsed=stats.elapsed,
            busy=stats.busy,
            idle=stats.idle,
            peak_inflight=stats.peak_inflight,
            deviations=stats.deviations,
        )
        unbind_contextvars("rank", "stage", "step", "task")

    def tp_decision(self, stage: StageLoop, task: Task, seq: int, sent: bool) -> None:
        if self._debug:
            self.log.debug(
                ev.TP_DECISION_SENT if sent else ev.TP_DECISION_RECEIVED, task=str(task), seq=seq
            )

    def failed(self, stage: StageLoop, exc: BaseException, dump: str) -> None:
        log_stage_dump(stage, exc, dump)


def log_stage_dump(stage: StageLoop, exc: BaseException, text: str) -> None:
    """Log a failed step's state (event ``stage_dump``, ERROR) with the rank bound."""
    get_logger().error(
        ev.STAGE_DUMP,
        rank=stage.rank,
        step=stage.step,
        error=f"{type(exc).__name__}: {exc}",
        dump=text,
    )
