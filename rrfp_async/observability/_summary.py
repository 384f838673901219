"""The summary of a trace: per-rank busy / idle time, bubble ratio, peak in-flight,
deviations and the idle time deviations filled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._trace_data import TraceData, from_chrome

__all__ = ["summarize"]


def summarize(trace: TraceData | Mapping[str, Any]) -> dict[str, Any]:
    """Per-rank busy / idle time, bubble ratio, peak in-flight, deviations, and the idle time
    deviations filled, from a recording or a Chrome trace.

    ``filled``: for each decision that ran something other than the hinted task, the part
    of that task's run during which the hinted task was not yet ready, i.e. time a fixed
    order would have spent idle under the same arrival times.
    """
    data = trace if isinstance(trace, TraceData) else from_chrome(trace)
    if not data.spans:
        return {"makespan": 0.0, "ranks": {}, "bubble_ratio": 0.0, "deviations": 0, "filled": 0.0}
    t0 = min(s.start for s in data.spans)
    t1 = max(s.end for s in data.spans)
    ready_at: dict[tuple[int, int, str], float] = {}
    for r in data.ready:
        ready_at.setdefault((r.lane, r.step, r.task), r.time)
    span_of = {(s.lane, s.step, s.task): s for s in data.spans}
    ranks: dict[int, dict[str, Any]] = {}
    for lane in sorted({s.lane for s in data.spans}):
        spans = [s for s in data.spans if s.lane == lane]
        busy = sum(s.end - s.start for s in spans)
        ranks[lane] = {
            "busy": busy,
            "idle": (t1 - t0) - busy,
            "bubble_ratio": 1.0 - busy / (t1 - t0) if t1 > t0 else 0.0,
            "tasks": len(spans),
            "deviations": 0,
            "filled": 0.0,
            "peak_inflight": 0,
        }
    for rec in data.steps:
        if rec.lane in ranks:
            rank = ranks[rec.lane]
            rank["peak_inflight"] = max(rank["peak_inflight"], rec.stats.get("peak_inflight", 0))
            rank["max_inflight"] = rec.stats.get("max_inflight")
    for d in data.decisions:
        if d.chosen == d.hinted or d.lane not in ranks:
            continue
        ranks[d.lane]["deviations"] += 1
        span = span_of.get((d.lane, d.step, d.chosen))
        if span is None:
            continue
        head_ready = ready_at.get((d.lane, d.step, d.hinted), span.end)
        ranks[d.lane]["filled"] += max(0.0, min(span.end, head_ready) - span.start)
    total = sum(v["busy"] + v["idle"] for v in ranks.values())
    return {
        "makespan": t1 - t0,
        "ranks": ranks,
        "bubble_ratio": sum(v["idle"] for v in ranks.values()) / total if total else 0.0,
        "deviations": sum(v["deviations"] for v in ranks.values()),
        "filled": sum(v["filled"] for v in ranks.values()),
        "peak_inflight": max(v["peak_inflight"] for v in ranks.values()),
    }
