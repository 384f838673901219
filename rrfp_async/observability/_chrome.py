"""Chrome-trace / Perfetto JSON: export, schema check, files.

``chrome_trace`` turns a ``TraceData`` into the Trace Event Format that chrome://tracing and
ui.perfetto.dev read:

* one process lane per rank (``pid`` = rank), named ``rank N``;
* one complete event (``ph: "X"``) per executed task, ``cat`` = its kind (F/B/I/W), ``name``
  = its text form (``2F3``), ``args`` = stage, kind, microbatch, step;
* one flow (``ph: "s"`` at the producer's end, ``ph: "f"`` at the consumer's next slice) per
  message between ranks, ``cat: "message"``; both halves carry the message's identity in
  ``args`` (``step``, ``task`` = the consumer, ``from`` and ``to`` = the two ranks), so the
  halves recorded by two processes join again when their files are merged
  (``merge_traces``), whatever ``id`` each file gave them;
* one instant event (``ph: "i"``, ``name: "decision"``) per dispatch decision, with the
  ready set and hint ranks, the hinted task and whether it deviated;
* for a step that failed on a rank (``Failure``): an instant event ``name: "step failed"``
  (``cat: "failure"``, the error in ``args``) at the moment it failed, and a complete event
  per task it had running then, from its start to that moment, ``args.unfinished: true``
  (drawn for the eye; ``from_chrome`` reads them from the failure row, not as spans);
* ``otherData.rrfp``: the clock ("virtual" or "real"), whether GPU time was emulated, the
  policy, the hint, per-rank step statistics (``StepRecord`` rows as JSON lists), the ready
  times (``Ready`` rows, seconds from ``t0``), the failures (``Failure`` rows, times seconds
  from ``t0``: the field that marks a failed step's file), the lanes (ranks) the file holds,
  the ranks of the pipeline it is part of (``pipeline``, when known: the files a merge
  expects), ``t0`` (the stage clock's reading at ``ts`` 0) and, for a real clock,
  ``clock_origin`` (see ``clock_origin``: how this host's stage clock maps to wall-clock
  time), and the summary.

Times are microseconds from the earliest event of the trace. ``from_chrome`` (in
``_trace_data``) reads such a trace back. ``write_trace`` writes ``otherData`` first and one
event per line, so that a file cut short (a copy that stopped) keeps its header and every
event before the cut: ``read_torn`` (``_torn``) reads it that far.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, get_args

from .._errors import TraceError
from .._tasks import Kind, Task
from ._failures import failure_events, failure_rows_problem
from ._summary import summarize
from ._torn import TornRead, decode_torn, read_torn
from ._trace_data import TraceData

__all__ = [
    "MAX_TRACE_BYTES",
    "MAX_TRACE_DEPTH",
    "MAX_TRACE_EVENTS",
    "chrome_trace",
    "clock_origin",
    "load_trace",
    "validate_chrome_trace",
    "write_trace",
]

_KINDS = frozenset(get_args(Kind))

MAX_TRACE_BYTES = 1 << 30
"""Largest trace file ``load_trace`` reads (1 GiB; a 16 x 128 step's trace is ~2 MB)."""

MAX_TRACE_EVENTS = 10_000_000
"""Most events of a trace ``load_trace`` accepts."""

MAX_TRACE_DEPTH = 32
"""Deepest nesting of JSON arrays and objects in a trace (``chrome_trace`` writes 5)."""


def _time(x: object) -> bool:
    """A time or duration of a trace event: a finite number >= 0 (not a bool)."""
    return (
        isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x < math.inf
    )  # NaN fails both comparisons


def _rank(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a trace may hold (times are finite)")


def _too_deep(obj: object, limit: int) -> bool:
    """Whether arrays/objects nest deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, dict | list))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, dict | list))
    return False


def _finite(obj: object) -> bool:
    """Every number in a JSON-like value is finite."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, float) and not math.isfinite(o):
            return False
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
    return True


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host name alone tells hosts apart
        return ""


def clock_origin() -> dict[str, Any]:
    """How this host's stage clock maps to wall-clock time, sampled now.

    A real stage clock is ``time.monotonic``: one clock for every process of a host (so the
    files of one host line up exactly), but its zero is arbitrary, so files of different
    hosts need the wall clock. Returns ``{"host", "boot", "monotonic", "wall"}``: the host
    name, its boot id (Linux; ``""`` elsewhere: a reboot restarts the monotonic clock), and
    a ``time.monotonic()`` / ``time.time()`` pair read together (the monotonic reading is
    the mean of one before and one after the wall-clock read, so the pair is off by at most
    half their gap, a microsecond or so). ``chrome_trace`` records it for a real clock;
    ``merge_traces`` uses it.
    """
    m0 = time.monotonic()
    wall = time.time()
    m1 = time.monotonic()
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "monotonic": (m0 + m1) / 2,
        "wall": wall,
    }


def chrome_trace(
    data: TraceData,
    *,
    clock: str = "real",
    emulated: bool = False,
    policy: str = "",
    hint: str = "",
    title: str = "",
    origin: Mapping[str, Any] | None = None,
    pipeline: Iterable[int] | None = None,
) -> dict[str, Any]:
    """The Trace Event Format JSON (a dict) of ``data``; see the module docstring.

    Export a real run's recording on the host that recorded it (the stage clock is that
    host's ``time.monotonic``): the file then says how its times map to wall-clock time, and
    per-rank files of a multi-host job merge onto one clock (``merge_traces``).

    Args:
        data: The records.
        clock: ``"virtual"`` (simulated) or ``"real"``.
        emulated: Whether GPU time was emulated (CPU compute + sleeps from a cost model).
        policy: The policy's name.
        hint: The hint's name.
        title: A free-text description.
        origin: For a real clock, the stage clock's mapping to wall-clock time
            (``clock_origin()``, sampled now when None); ignored for a virtual clock.
        pipeline: The ranks (lanes) whose files complete this one (a rank's file of a
            multi-process run: its pipeline's ranks), written as ``pipeline``; a merge of
            files that miss one of them names it.
    """
    times = [s.start for s in data.spans] + [a.time for a in data.arrivals]
    times += [d.time for d in data.decisions] + [s.time for s in data.sends]
    times += [f.time for f in data.failures]
    times += [t for f in data.failures for t in f.running.values()]
    t0 = min(times) if times else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    lanes = sorted(
        {s.lane for s in data.spans}
        | {s.lane for s in data.steps}
        | {f.lane for f in data.failures}
    )
    events: list[dict[str, Any]] = []
    for r in lanes:
        events.append(
            {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}}
        )
    for span in sorted(data.spans, key=lambda s: (s.lane, s.start)):
        t = Task.parse(span.task)
        events.append(
            {
                "name": span.task,
                "cat": t.kind,
                "ph": "X",
                "ts": us(span.start),
                "dur": round((span.end - span.start) * 1e6, 3),
                "pid": span.lane,
                "tid": 0,
                "args": {"stage": t.stage, "kind": t.kind, "mb": t.mb, "step": span.step},
            }
        )
    # A flow's two ends share an id: the message's (step, consumer, src lane, dst lane).
    flow_ids: dict[tuple[int, str, int, int], int] = {}
    for send in data.sends:
        key = (send.step, send.task, send.lane, send.dst)
        fid = flow_ids.setdefault(key, len(flow_ids) + 1)
        events.append(
            {
                "name": f"-> {send.task}",
                "cat": "message",
                "ph": "s",
                "id": fid,
                "ts": max(0.0, us(send.time) - 0.001),
                "pid": send.lane,
                "tid": 0,
                "args": {"step": send.step, "task": send.task, "from": send.lane, "to": send.dst},
            }
        )
    for arr in data.arrivals:
        fid = flow_ids.setdefault((arr.step, arr.task, arr.src, arr.lane), len(flow_ids) + 1)
        events.append(
            {
                "name": f"-> {arr.task}",
                "cat": "message",
                "ph": "f",
                "id": fid,
                "ts": us(arr.time),
                "pid": arr.lane,
                "tid": 0,
                "args": {"step": arr.step, "task": arr.task, "from": arr.src, "to": arr.lane},
            }
        )
    for d in data.decisions:
        events.append(
            {
                "name": "decision",
                "cat": "decision",
                "ph": "i",
                "s": "t",
                "ts": us(d.time),
                "pid": d.lane,
                "tid": 0,
                "args": {
                    "step": d.step,
                    "chosen": d.chosen,
                    "hinted": d.hinted,
                    "deviation": d.chosen != d.hinted,
                    "ready": d.ready,
                    "idle": d.idle,
                },
            }
        )
    events.extend(failure_events(data.failures, us))
    more: dict[str, Any] = {}
    if pipeline is not None:
        more["pipeline"] = sorted(set(pipeline))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "rrfp": {
                "clock": clock,
                "emulated_gpu_time": emulated,
                "policy": policy,
                "hint": hint,
                "title": title,
                "t0": t0,
                **({"clock_origin": dict(origin or clock_origin())} if clock == "real" else {}),
                "lanes": sorted(
                    {
                        *lanes,
                        *(
                            r.lane
                            for rows in (data.sends, data.arrivals, data.decisions)
                            for r in rows
                        ),
                    }
                ),
                "steps": [list(rec) for rec in data.steps],
                "ready": [[r.lane, r.step, r.task, r.time - t0] for r in data.ready],
                "failures": [
                    [
                        f.lane,
                        f.step,
                        f.time - t0,
                        f.error,
                        f.message,
                        {t: start - t0 for t, start in f.running.items()},
                    ]
                    for f in data.failures
                ],
                **more,
                "summary": summarize(data),
            }
        },
    }


def write_trace(path: str | Path, trace: Mapping[str, Any]) -> Path:
    """Write a trace dict as JSON, atomically: into a temporary file beside ``path``, flushed
    to disk, then renamed over it. A write that fails (a full disk) raises and leaves the
    previous file as it was, never a torn one (ARCHITECTURE invariant 8). Returns the path.

    The layout (any JSON reader ignores it): ``otherData`` first, ``traceEvents`` last with
    one event per line, so that a copy cut short keeps the header and whole events up to the
    cut (``rrfp-async trace`` reads such a file that far, with a warning).

    Raises:
        OSError: The file cannot be written (the previous one, if any, is kept).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = _layout(trace)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def _layout(trace: Mapping[str, Any]) -> str:
    """``trace`` as JSON: ``otherData`` first, the events last, one per line."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return json.dumps(trace)
    keys = sorted((k for k in trace if k != "traceEvents"), key=lambda k: k != "otherData")
    head = "".join(f"{json.dumps(k)}: {json.dumps(trace[k])},\n" for k in keys)
    body = ",\n".join(json.dumps(e) for e in events)
    return "{" + head + '"traceEvents": [\n' + body + "\n]}\n"


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read and check a trace JSON written by ``write_trace`` (Trace Event Format).

    Raises:
        TraceError: The file is not JSON (``NaN`` and ``Infinity`` included), is larger
            than ``MAX_TRACE_BYTES``, nests deeper than ``MAX_TRACE_DEPTH``, has more than
            ``MAX_TRACE_EVENTS`` events, is not a trace (no ``traceEvents`` list), or its
            events are malformed (missing keys; times ``ts`` and durations ``dur`` that are
            not finite numbers >= 0, or whose sum overflows; ranks ``pid`` that are not
            integers >= 0; names that are not tasks), or its summary overflows; the
            message names the file and the first problems. A per-rank file of a
            multi-process run (its messages' other halves are in the other ranks' files) is
            refused with a message that names the ranks whose files it needs and how to
            merge them (``merge_traces``, ``rrfp-async trace rank0.json rank1.json ...``).
        OSError: The file cannot be read.
    """
    return _load(path, whole=True)


def _load(path: str | Path, *, whole: bool) -> dict[str, Any]:
    """``load_trace``; with ``whole=False``, a flow may miss its other half (a per-rank
    file, to be merged)."""
    return read_trace_file(path, whole=whole, torn_ok=False)[0]


def read_trace_file(
    path: str | Path, *, whole: bool, torn_ok: bool
) -> tuple[dict[str, Any], TornRead | None]:
    """``load_trace``'s reading and checks. With ``whole=False``, a flow may miss its other
    half (a per-rank file, to be merged); with ``torn_ok``, a file cut short (see ``_torn``)
    is read up to the cut: returns the trace and what the cut left (None: the file is
    whole). A torn file without its ``otherData`` (cut inside it, or written events first
    by an older version) is returned without it: the caller decides what it is worth."""
    # Read at most one byte past the bound (a pipe has no size to stat).
    with open(path, "rb") as f:
        raw = f.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(
            f"{path} has more than {MAX_TRACE_BYTES} bytes, more than a trace may have"
            " (MAX_TRACE_BYTES)"
        )
    torn: TornRead | None = None
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        torn = _torn(raw) if torn_ok else None
        if torn is None:
            raise TraceError(f"{path} is not a JSON trace: {e}") from e
        obj = dict(torn.trace)
        obj.setdefault("traceEvents", [])
    except RecursionError:
        raise TraceError(
            f"{path} nests JSON arrays/objects too deeply to be a trace (at most"
            f" {MAX_TRACE_DEPTH} levels)"
        ) from None
    return _checked(path, obj, whole=whole), torn


def _torn(raw: bytes) -> TornRead | None:
    """What a file cut short holds before the cut (None: not cut short, or unreadable)."""
    try:
        text, _ = decode_torn(raw)
        return read_torn(text, _no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


def _checked(path: str | Path, obj: Any, *, whole: bool) -> dict[str, Any]:
    """``obj`` read from ``path``, checked as ``load_trace`` says."""
    if _too_deep(obj, MAX_TRACE_DEPTH):
        raise TraceError(
            f"{path} nests JSON arrays/objects deeper than {MAX_TRACE_DEPTH} levels"
            " (MAX_TRACE_DEPTH); a trace is not that deep"
        )
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Trace Event Format file (no traceEvents list)")
    if len(obj["traceEvents"]) > MAX_TRACE_EVENTS:
        raise TraceError(
            f"{path} has {len(obj['traceEvents'])} events, more than a trace may have"
            f" (MAX_TRACE_EVENTS = {MAX_TRACE_EVENTS})"
        )
    if not all(isinstance(e, dict) for e in obj["traceEvents"]):
        raise TraceError(f"{path}: every entry of traceEvents must be a JSON object")
    other = obj.get("otherData", {})
    if not isinstance(other, dict) or not isinstance(other.get("rrfp", {}), dict):
        raise TraceError(f"{path}: otherData.rrfp must be a JSON object")
    meta = other.get("rrfp", {})
    pipeline = meta.get("pipeline", [])
    bad = failure_rows_problem(meta.get("failures", []))
    if not isinstance(pipeline, list) or not all(_rank(r) for r in pipeline):
        bad = f"otherData.rrfp.pipeline must be a list of ranks, got {pipeline!r:.80}"
    if bad:
        raise TraceError(f"{path} is not a valid trace: {bad}")
    problems = _problems(obj, flows=whole)
    if whole and problems and not _problems(obj, flows=False):
        part = _part_message(path, obj)
        if part:
            raise TraceError(part)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise TraceError(f"{path} is not a valid trace: " + "; ".join(problems[:5]) + more)
    try:  # what the schema check does not cover (step records, decision args) must read back
        summ = summarize(obj)
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError) as e:
        raise TraceError(f"{path} is not a valid trace: {type(e).__name__}: {e}") from e
    if not _finite(summ):
        raise TraceError(
            f"{path} is not a valid trace: its times add up beyond a float (the summary overflows)"
        )
    return obj


def _part_message(path: str | Path, trace: Mapping[str, Any]) -> str:
    """What to tell about a per-rank file whose flows miss their other halves, or ``""``
    when it is not one (a half whose other end is a rank of this very file, or a flow
    without the message's identity: a broken trace, not a part)."""
    lanes = {e["pid"] for e in trace["traceEvents"] if e.get("ph") in ("X", "s", "f", "i")}
    others: set[int] = set()
    halves = unpaired_flows(trace)
    for e in halves:
        a = e.get("args") or {}
        other = a.get("to") if e["ph"] == "s" else a.get("from")
        if not isinstance(other, int) or not _rank(other) or other in lanes:
            return ""
        others.add(other)
    if not others:
        return ""
    n = len(halves)
    here = ", ".join(map(str, sorted(lanes)))
    need = ", ".join(map(str, sorted(others)))
    folder = Path(path).parent
    one = len(others) == 1
    whose = "that rank's own trace file" if one else "those ranks' own trace files"
    files = ", ".join(f"rank{r}.json" for r in sorted(others))
    return (
        f"{path} is one rank's part of a multi-process trace: it holds rank {here}, and"
        f" {n} of its messages went to or came from rank {need}, whose halves are in"
        f" {whose} ({files} beside it, when written with trace_dir=). Merge every rank's file"
        f" into one timeline: rrfp-async trace {folder / 'rank*.json'} (a glob, a directory, or the"
        " files; -o merged.json writes the result), or rr.merge_traces(paths) in code"
    )


def unpaired_flows(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The flow events (``ph`` ``"s"`` / ``"f"``) of a trace whose id has only that half."""
    ends: dict[object, set[str]] = {}
    flows = [e for e in trace["traceEvents"] if e.get("ph") in ("s", "f")]
    for e in flows:
        ends.setdefault(e.get("id"), set()).add(e["ph"])
    return [e for e in flows if ends[e.get("id")] != {"s", "f"}]


def validate_chrome_trace(trace: Mapping[str, Any]) -> list[str]:
    """Schema check of a trace made by ``chrome_trace``; returns the problems (empty: ok).

    Checks the required keys and types of every event (times and durations finite numbers
    >= 0 whose sums stay finite, ranks integers >= 0), that compute spans of a rank do not
    overlap, and that every flow has both ends.
    """
    return _problems(trace, flows=True)


def _problems(trace: Mapping[str, Any], *, flows: bool) -> list[str]:
    """``validate_chrome_trace``; with ``flows=False``, a flow may lack its other half."""
    problems: list[str] = []
    evs = trace.get("traceEvents")
    if not isinstance(evs, list):
        return ["traceEvents is not a list"]
    need = {
        "X": ("name", "cat", "ts", "dur", "pid", "tid"),
        "M": ("name", "pid", "args"),
        "s": ("id", "ts", "pid"),
        "f": ("id", "ts", "pid"),
        "i": ("name", "ts", "pid", "s"),
    }
    lanes: dict[int, list[tuple[float, float, str]]] = {}
    ends: dict[int, set[str]] = {}
    for i, e in enumerate(evs):
        ph = e.get("ph")
        if ph not in need:
            problems.append(f"event {i}: unknown phase {ph!r}")
            continue
        for k in need[ph]:
            if k not in e:
                problems.append(f"event {i} ({ph}): missing {k}")
        if ph != "M" and "ts" in e and not _time(e["ts"]):
            problems.append(
                f"event {i} ({ph}): bad ts/dur: ts {e['ts']!r} is not a finite number >= 0"
            )
            continue
        if ph != "M" and "pid" in e and not _rank(e["pid"]):
            problems.append(f"event {i} ({ph}): pid {e['pid']!r} is not an integer >= 0")
            continue
        if ph == "X":
            if "ts" not in e:
                continue
            if not _time(e.get("dur")) or not _time(e["ts"] + e["dur"]):
                problems.append(
                    f"event {i}: bad ts/dur: dur {e.get('dur')!r} is not a finite number >= 0 (or"
                    " ts + dur overflows)"
                )
                continue
            if e.get("cat") not in _KINDS:
                problems.append(f"event {i}: cat {e.get('cat')!r} is not a task kind")
            try:
                Task.parse(e["name"])
            except (ValueError, TypeError, AttributeError):
                problems.append(f"event {i}: name {e['name']!r} is not a task")
                continue
            lanes.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph in ("s", "f"):
            if not isinstance(e.get("id"), int | str) or not isinstance(e.get("ts"), int | float):
                problems.append(f"event {i} ({ph}): id must be an integer or string, ts a number")
                continue
            a = e.get("args")
            if a is not None and not _identity(a):
                problems.append(
                    f"event {i} ({ph}): args must be the message's identity: step and from /"
                    " to integers >= 0, task a task"
                )
                continue
            ends.setdefault(e["id"], set()).add(ph)
        elif ph == "M" and not isinstance(e.get("args"), dict):
            problems.append(f"event {i} (M): args must be an object")
    for pid, spans in lanes.items():
        spans.sort()
        for (_, e0, n0), (s1, _, n1) in itertools.pairwise(spans):
            if s1 < e0 - 0.01:  # µs; ts and dur are rounded separately
                problems.append(f"rank {pid}: {n0} and {n1} overlap")
    for fid, halves in ends.items():
        if flows and halves != {"s", "f"}:
            problems.append(f"flow {fid} has only {sorted(halves)}")
    return problems


def _identity(args: object) -> bool:
    """A flow event's ``args``: nothing of the identity, or all of it, well typed."""
    if not isinstance(args, dict):
        return False
    if "task" not in args:
        return True  # written before flows carried their message's identity (or by hand)
    if not all(k in args and _rank(args[k]) for k in ("step", "from", "to")):
        return False
    try:
        Task.parse(args.get("task"))  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return False
    return True
