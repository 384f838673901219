"""A failed step in a Chrome trace: the events ``chrome_trace`` draws for it and the check
of the rows it writes (``Failure``, in ``otherData.rrfp.failures``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from .._tasks import Task
from ._trace_data import Failure

__all__ = ["failure_events", "failure_rows_problem"]


def failure_events(
    failures: Iterable[Failure], us: Callable[[float], float]
) -> list[dict[str, Any]]:
    """A failed step's marks in a Chrome trace (``us``: a stage-clock time in the trace's
    microseconds): the moment it failed, and its tasks that never ended."""
    events: list[dict[str, Any]] = []
    for f in failures:
        for task, start in sorted(f.running.items(), key=lambda kv: kv[1]):
            t = Task.parse(task)
            events.append(
                {
                    "name": task,
                    "cat": t.kind,
                    "ph": "X",
                    "ts": us(start),
                    "dur": max(0.0, round((f.time - start) * 1e6, 3)),
                    "pid": f.lane,
                    "tid": 0,
                    "args": {
                        "stage": t.stage,
                        "kind": t.kind,
                        "mb": t.mb,
                        "step": f.step,
                        "unfinished": True,
                    },
                }
            )
        events.append(
            {
                "name": "step failed",
                "cat": "failure",
                "ph": "i",
                "s": "p",
                "ts": us(f.time),
                "pid": f.lane,
                "tid": 0,
                "args": {"step": f.step, "error": f.error, "message": f.message},
            }
        )
    return events


def failure_rows_problem(rows: object) -> str:
    """What is wrong with a trace file's failure rows (``otherData.rrfp.failures``; ``""``:
    nothing): each is [rank, step, time, error, message, {task: start}], its times finite
    numbers (seconds from ``t0``), its tasks tasks. ``from_chrome`` builds ``Failure`` rows
    of them."""
    if not isinstance(rows, list):
        return "otherData.rrfp.failures must be a list"
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 6
        if ok:
            lane, step, t, error, message, running = row
            ok = (
                _rank(lane)
                and _rank(step)
                and _number(t)
                and isinstance(error, str)
                and isinstance(message, str)
                and isinstance(running, dict)
                and all(_number(v) and _is_task(k) for k, v in running.items())
            )
        if not ok:
            return (
                f"otherData.rrfp.failures[{i}] must be [rank, step, time, error, message,"
                f" {{task: start}}], got {row!r:.120}"
            )
    return ""


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_task(x: object) -> bool:
    try:
        Task.parse(x)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return False
    return True


def _rank(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
