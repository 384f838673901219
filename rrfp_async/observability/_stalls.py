"""Who waited for what: slow tasks, idle gaps and the chain from each gap to its cause.

From a trace (one process's, a simulation's, or per-rank files merged), for each step:

* **slow tasks**: a task that ran longer than ``slow_factor`` times the median of its kind
  (F, B, I, W) on its rank, and stands out of the run's own spread: past the median by more
  than ``spread`` times the kind's median absolute deviation on that rank (on a loaded
  machine every short task jitters; one that jitters like the others is not slow) and by
  more than ``min_share`` of its step's makespan;
* **waits**: an idle gap before a task (longer than ``min_wait`` times the rank's median task
  time), with what the task waited for: its input from another rank (named by the message:
  the producer task that sent it and its rank), or, when the input was there before the gap
  ended, a hold (the policy, the admission bound or the TP leader kept the ready task back);
* **the chain** from each wait to its root: the producer that sent late started late because
  its rank was busy with an earlier task (unless the policy ran that one only because the
  hinted task was not ready: then the hinted one waited for its input), or because it waited
  for its own input, and so on,
  until a slow task (the root) or a task that started on time (no root: the pipeline's own
  fill and drain, not an anomaly).

Every link is read from the trace's records (spans, sends, arrivals, readiness); nothing is
inferred from the plan, so it holds for any schedule and policy, under the simulator as in a
real run.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ._trace_data import Span, TraceData, from_chrome

__all__ = ["stalls"]

_KIND = re.compile(r"^\d+([A-Z])")
_EPS = 1e-9


def _kind(task: str) -> str:
    m = _KIND.match(task)
    return m.group(1) if m else "?"


def stalls(
    trace: TraceData | Mapping[str, Any],
    *,
    slow_factor: float = 2.0,
    min_wait: float = 0.5,
    min_share: float = 0.02,
    spread: float = 3.0,
) -> dict[str, Any]:
    """Slow tasks and the waits they (or nothing unusual) caused; see the module docstring.

    Args:
        trace: A recording or a Chrome trace (merged per-rank files too).
        slow_factor: A task is slow above this multiple of its kind's median on its rank.
        min_wait: An idle gap counts above this multiple of the rank's median task time.
        min_share: A slow task also exceeds its median by at least this share of its
            step's makespan (a short task's noise, several times its own length on a
            loaded host, is not what held the step up).
        spread: A slow task also exceeds its median by more than this multiple of its
            kind's median absolute deviation on its rank (the run's own spread; 0: off).

    Returns:
        ``{"slow": [...], "waits": [...]}``. A slow entry: ``rank, step, task, seconds,
        median, waited_by`` (the waits whose root it is, as ``"<rank>:<task>"``). A wait:
        ``rank, step, task, seconds`` (the gap before ``task``), ``reason``: ``"input"`` (it
        waited for a message: ``waited_for`` is the producer task, ``from_rank`` its rank)
        or ``"held"`` (its inputs were there before the gap ended: the policy, the
        admission bound or the TP leader held it back; ``waited_for`` None), ``root``
        (``"<rank>:<task>"`` of the slow task at the end of the chain, or None) and
        ``chain`` (the tasks from the wait to the root, as ``"<rank>:<task>"``).
    """
    data = trace if isinstance(trace, TraceData) else from_chrome(trace)
    if slow_factor <= 1.0 or min_wait < 0 or not 0 <= min_share < 1 or not spread >= 0:
        raise ValueError(
            "slow_factor must be > 1, min_wait >= 0, 0 <= min_share < 1 and spread >= 0; got"
            f" slow_factor={slow_factor}, min_wait={min_wait}, min_share={min_share},"
            f" spread={spread}"
        )
    by_kind: dict[tuple[int, str], list[float]] = defaultdict(list)
    by_lane: dict[int, list[float]] = defaultdict(list)
    for s in data.spans:
        by_kind[(s.lane, _kind(s.task))].append(s.end - s.start)
        by_lane[s.lane].append(s.end - s.start)
    med_kind = {k: statistics.median(v) for k, v in by_kind.items()}
    # The median absolute deviation: a spread that one slow task does not move.
    mad_kind = {k: statistics.median(abs(d - med_kind[k]) for d in v) for k, v in by_kind.items()}
    med_lane = {k: statistics.median(v) for k, v in by_lane.items()}

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for s in data.spans:
        first[s.step] = min(first.get(s.step, s.start), s.start)
        last[s.step] = max(last.get(s.step, s.end), s.end)

    def is_slow(s: Span) -> bool:
        key = (s.lane, _kind(s.task))
        m = med_kind[key]
        d = s.end - s.start
        floor = max(min_share * (last[s.step] - first[s.step]), spread * mad_kind[key])
        return d > slow_factor * m + _EPS and d - m > floor + _EPS

    lane_spans: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in data.spans:
        lane_spans[(s.lane, s.step)].append(s)
    prev_of: dict[tuple[int, int, str], Span | None] = {}
    step_start: dict[int, float] = {}
    for (lane, step), spans in lane_spans.items():
        spans.sort(key=lambda s: (s.start, s.end))
        prev: Span | None = None
        for s in spans:
            prev_of[(lane, step, s.task)] = prev
            prev = s
        step_start[step] = min(step_start.get(step, spans[0].start), spans[0].start)
    hinted_at = {(d.lane, d.step, d.chosen): d.hinted for d in data.decisions}
    ready_at: dict[tuple[int, int, str], float] = {}
    for r in data.ready:
        ready_at.setdefault((r.lane, r.step, r.task), r.time)
    last_arrival: dict[tuple[int, int, str], tuple[float, int]] = {}
    for a in data.arrivals:
        key = (a.lane, a.step, a.task)
        if key not in last_arrival or a.time > last_arrival[key][0]:
            last_arrival[key] = (a.time, a.src)
    send_time: dict[tuple[int, int, str, int], float] = {}
    for snd in data.sends:
        send_time.setdefault((snd.lane, snd.step, snd.task, snd.dst), snd.time)

    def producer(s: Span) -> tuple[Span | None, int | None]:
        """The span whose message was the last input of ``s`` to arrive, and its rank."""
        arr = last_arrival.get((s.lane, s.step, s.task))
        if arr is None:
            return None, None
        t_arr, src = arr
        t_send = send_time.get((src, s.step, s.task, s.lane), t_arr)
        best: Span | None = None
        for p in lane_spans.get((src, s.step), ()):
            if p.end <= t_send + _EPS and (best is None or p.end > best.end):
                best = p
        return best, src

    def cause(s: Span) -> Span | None:
        """What decided when ``s`` started: the task its rank ran just before (busy), or
        the producer of its last input (it waited for it); None when neither did."""
        prev = prev_of[(s.lane, s.step, s.task)]
        ready = ready_at.get((s.lane, s.step, s.task))
        if ready is None:
            arr = last_arrival.get((s.lane, s.step, s.task))
            ready = arr[0] if arr is not None else s.start
        if prev is not None and prev.end >= ready - _EPS and s.start - prev.end <= _tight(s):
            if hinted_at.get((s.lane, s.step, prev.task)) == s.task and ready > prev.start:
                # The policy ran ``prev`` because ``s``, the hinted task, was not ready yet:
                # ``s`` waited for its input (then for ``prev`` to end).
                return producer(s)[0] or prev
            return prev
        if ready > (prev.end if prev is not None else step_start[s.step]) + _EPS:
            return producer(s)[0]
        return None

    def _tight(s: Span) -> float:
        return min_wait * med_lane[s.lane]

    def name(s: Span) -> str:
        return f"{s.lane}:{s.task}"

    waits: list[dict[str, Any]] = []
    for (lane, step), spans in sorted(lane_spans.items()):
        for s in spans:
            prev = prev_of[(lane, step, s.task)]
            begin = prev.end if prev is not None else step_start[step]
            gap = s.start - begin
            if gap <= min_wait * med_lane[lane] + _EPS:
                continue
            ready = ready_at.get((lane, step, s.task))
            arr = last_arrival.get((lane, step, s.task))
            if ready is None:
                ready = arr[0] if arr is not None else begin
            if ready > begin + _EPS and arr is not None:
                reason = "input"
                prod, src = producer(s)
            else:
                reason = "held"  # ready before the gap ended: the policy, admission or TP
                prod, src = None, None
            chain = [name(s)]
            root: str | None = None
            cur = prod
            seen = set()
            while cur is not None and (cur.lane, cur.step, cur.task) not in seen:
                seen.add((cur.lane, cur.step, cur.task))
                chain.append(name(cur))
                if is_slow(cur):
                    root = name(cur)
                    break
                cur = cause(cur)
            waits.append(
                {
                    "rank": lane,
                    "step": step,
                    "task": s.task,
                    "seconds": gap,
                    "reason": reason,
                    "waited_for": prod.task if prod is not None else None,
                    "from_rank": src,
                    "root": root,
                    "chain": chain if root is not None else chain[:2],
                }
            )
    slow = []
    for s in sorted(data.spans, key=lambda s: (s.step, s.lane, s.start)):
        if is_slow(s):
            who = name(s)
            slow.append(
                {
                    "rank": s.lane,
                    "step": s.step,
                    "task": s.task,
                    "seconds": s.end - s.start,
                    "median": med_kind[(s.lane, _kind(s.task))],
                    "waited_by": [
                        f"{w['rank']}:{w['task']}"
                        for w in waits
                        if w["root"] == who and w["step"] == s.step
                    ],
                }
            )
    return {"slow": slow, "waits": waits}
