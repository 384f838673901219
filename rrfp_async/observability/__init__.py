"""Observability: event names, the structlog observer, the trace recorder and its exports.

Observers receive the :class:`~rrfp_async.loop.StageLoop` they watch and read it only through
its public surface (``rank``, ``step``, ``now()``, ``view``, ``schedule``); they sit above the
loop and the loop never imports them.

The modules, one concept each (imports run down this list, never up):

* ``_events``: the names of the step-traced log events;
* ``_logging``: ``LogObserver`` (one structlog event per transition) and its configuration;
* ``_trace_data``: the trace data model, ``TraceData`` and its named-tuple rows (``Failure``:
  a step that failed on a rank);
* ``_recorder``: ``TraceRecorder`` (a ``TraceData`` from a running stage), ``MultiObserver``;
* ``_summary``: ``summarize`` (busy / idle, bubble ratio, deviations) of a trace;
* ``_stalls``: ``stalls`` (slow tasks, idle gaps, and the chain from each gap to its cause);
* ``_paired``: ``paired_ratio``, a speedup over paired steps with its spread and noise verdict;
* ``_torn``: a trace file cut short (a copy that stopped), read up to the cut;
* ``_failures``: a failed step's marks in a Chrome trace and the check of its rows;
* ``_chrome``: the Chrome-trace / Perfetto JSON export, its schema check and files;
* ``_merge``: ``merge_traces``, per-rank trace files of a multi-process run on one timeline
  (``partial``: what a job that died left), a directory's newest step;
* ``_png``: ``render_png`` timelines.
"""

from typing import TYPE_CHECKING

from .._lazy import exports

# Imported on first use: traces, summaries and PNGs need no torch (``rrfp-async trace``).
_EXPORTS: dict[str, str] = {
    "Arrival": "._trace_data",
    "Decision": "._trace_data",
    "Failure": "._trace_data",
    "LogFormat": "._logging",
    "LogObserver": "._logging",
    "MergedTrace": "._merge",
    "MultiObserver": "._recorder",
    "PairedRatio": "._paired",
    "Ready": "._trace_data",
    "Send": "._trace_data",
    "Span": "._trace_data",
    "StepRecord": "._trace_data",
    "TraceData": "._trace_data",
    "TraceRecorder": "._recorder",
    "chrome_trace": "._chrome",
    "clock_origin": "._chrome",
    "configure_logging": "._logging",
    "load_trace": "._chrome",
    "merge_trace_files": "._merge",
    "merge_traces": "._merge",
    "newest_trace_files": "._merge",
    "paired_ratio": "._paired",
    "rank_trace_path": "._merge",
    "render_png": "._png",
    "stalls": "._stalls",
    "summarize": "._summary",
    "trace_files": "._merge",
    "validate_chrome_trace": "._chrome",
    "write_trace": "._chrome",
}

if TYPE_CHECKING:
    from ._chrome import chrome_trace, clock_origin, load_trace, validate_chrome_trace, write_trace
    from ._logging import LogFormat, LogObserver, configure_logging
    from ._merge import (
        MergedTrace,
        merge_trace_files,
        merge_traces,
        newest_trace_files,
        rank_trace_path,
        trace_files,
    )
    from ._paired import PairedRatio, paired_ratio
    from ._png import render_png
    from ._recorder import MultiObserver, TraceRecorder
    from ._stalls import stalls
    from ._summary import summarize
    from ._trace_data import Arrival, Decision, Failure, Ready, Send, Span, StepRecord, TraceData

__getattr__, __dir__ = exports(__name__, _EXPORTS)

__all__ = [
    "Arrival",
    "Decision",
    "Failure",
    "LogFormat",
    "LogObserver",
    "MergedTrace",
    "MultiObserver",
    "PairedRatio",
    "Ready",
    "Send",
    "Span",
    "StepRecord",
    "TraceData",
    "TraceRecorder",
    "chrome_trace",
    "clock_origin",
    "configure_logging",
    "load_trace",
    "merge_trace_files",
    "merge_traces",
    "newest_trace_files",
    "paired_ratio",
    "rank_trace_path",
    "render_png",
    "stalls",
    "summarize",
    "trace_files",
    "validate_chrome_trace",
    "write_trace",
]
