"""Observability: event names, the structlog observer, the trace recorder and its exports.

Observers receive the :class:`~rrfp_async.loop.StageLoop` they watch and read it only through
its public surface (``rank``, ``step``, ``now()``, ``view``, ``schedule``); they sit above the
loop and the loop never imports them.
"""

from ._logging import LogFormat, LogObserver, configure_logging
from ._trace import (
    MultiObserver,
    TraceData,
    TraceRecorder,
    chrome_trace,
    load_trace,
    render_png,
    summarize,
    validate_chrome_trace,
    write_trace,
)

__all__ = [
    "LogFormat",
    "LogObserver",
    "MultiObserver",
    "TraceData",
    "TraceRecorder",
    "chrome_trace",
    "configure_logging",
    "load_trace",
    "render_png",
    "summarize",
    "validate_chrome_trace",
    "write_trace",
]
