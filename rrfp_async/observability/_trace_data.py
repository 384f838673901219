"""The trace data model: one named-tuple row type per kind of record, and ``TraceData``.

A *lane* is a rank: the pipeline rank in a simulation, the global rank in a multi-process
run. Times are seconds on the stage clock (virtual under the simulator). Tasks are kept in
their text form (``2F3``) so that the rows are plain JSON values.

Rows are named tuples so that every reader names the field it wants (``span.start``, not
``span[3]``) while a row still pickles, merges and serialises as a plain JSON list. Rows that
come back as lists (JSON, or hand-written records) are turned back into their named tuples
when a ``TraceData`` is built.

``from_chrome`` reads a Chrome trace back into a ``TraceData``. It lives here, with the data,
rather than with the export in ``_chrome``: the summary and the PNG accept either form and
the export embeds the summary, so the imports run one way, records <- summary <- chrome.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "Arrival",
    "Decision",
    "Failure",
    "Ready",
    "Send",
    "Span",
    "StepRecord",
    "TraceData",
    "from_chrome",
]


class Span(NamedTuple):
    """One executed task: its lane, step, text form and start / end times."""

    lane: int
    step: int
    task: str
    start: float
    end: float


class Send(NamedTuple):
    """A message sent from ``lane`` to ``dst`` for the consumer ``task``, at ``time``."""

    lane: int
    step: int
    task: str
    dst: int
    time: float


class Arrival(NamedTuple):
    """A message for the consumer ``task`` received on ``lane`` from ``src``, at ``time``."""

    lane: int
    step: int
    task: str
    src: int
    time: float


class Ready(NamedTuple):
    """The time all of ``task``'s inputs were present on ``lane``."""

    lane: int
    step: int
    task: str
    time: float


class Decision(NamedTuple):
    """A dispatch decision: the ``chosen`` task, the ``hinted`` one, the ready set with each
    task's hint rank, and the seconds the lane had been ``idle``."""

    lane: int
    step: int
    time: float
    chosen: str
    hinted: str
    ready: dict[str, int]
    idle: float


class StepRecord(NamedTuple):
    """A lane's statistics of a finished step (a JSON-able dict of ``StepStats`` fields)."""

    lane: int
    step: int
    stats: dict[str, Any]


class Failure(NamedTuple):
    """A step that failed on ``lane``: when (``time``), why (the exception's type name
    ``error`` and its ``message``), and the tasks it had ``running`` when it failed (started,
    never ended: task -> start time). Written into the failed step's trace file, so that the
    part of the step a rank saw survives it (``failed-rank{r}.json``)."""

    lane: int
    step: int
    time: float
    error: str
    message: str
    running: dict[str, float]


_Row = TypeVar("_Row", Span, Send, Arrival, Ready, Decision, StepRecord, Failure)


def _rows(kind: type[_Row], rows: Iterable[Sequence[Any]]) -> list[_Row]:
    return [r if isinstance(r, kind) else kind(*r) for r in rows]


@dataclass
class TraceData:
    """Plain, picklable trace records (seconds on the stage clock).

    Rows given as plain sequences (e.g. loaded from JSON) are turned into their named tuples.

    Attributes:
        spans: A ``Span`` per executed task.
        sends: A ``Send`` per message sent.
        arrivals: An ``Arrival`` per message received.
        ready: A ``Ready`` per task, when its inputs were all present.
        decisions: A ``Decision`` per dispatch decision.
        steps: A ``StepRecord`` per finished step of a lane.
        failures: A ``Failure`` per step that failed on a lane.
    """

    spans: list[Span] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    arrivals: list[Arrival] = field(default_factory=list)
    ready: list[Ready] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.spans = _rows(Span, self.spans)
        self.sends = _rows(Send, self.sends)
        self.arrivals = _rows(Arrival, self.arrivals)
        self.ready = _rows(Ready, self.ready)
        self.decisions = _rows(Decision, self.decisions)
        self.steps = _rows(StepRecord, self.steps)
        self.failures = _rows(Failure, self.failures)

    def extend(self, other: TraceData) -> None:
        """Append another recording (e.g. another process's)."""
        self.spans.extend(other.spans)
        self.sends.extend(other.sends)
        self.arrivals.extend(other.arrivals)
        self.ready.extend(other.ready)
        self.decisions.extend(other.decisions)
        self.steps.extend(other.steps)
        self.failures.extend(other.failures)

    @classmethod
    def merge(cls, parts: Iterable[TraceData]) -> TraceData:
        """One recording from several (one per process)."""
        out = cls()
        for p in parts:
            out.extend(p)
        return out

    def only_step(self, step: int) -> TraceData:
        """The records of one step."""
        return TraceData(
            [r for r in self.spans if r.step == step],
            [r for r in self.sends if r.step == step],
            [r for r in self.arrivals if r.step == step],
            [r for r in self.ready if r.step == step],
            [r for r in self.decisions if r.step == step],
            [r for r in self.steps if r.step == step],
            [r for r in self.failures if r.step == step],
        )


def from_chrome(trace: Mapping[str, Any]) -> TraceData:
    """The records of a Chrome trace made by ``chrome_trace``: spans, decisions, step
    records, ready times, failures, and the messages whose flow events carry their identity
    (``args`` ``step``, ``task``, ``from``, ``to``; traces written before they did have
    none, and their messages are not read back). Times are seconds from the trace's start.
    A failed step's unfinished tasks are read from its ``Failure`` row, not as spans.
    """
    data = TraceData()
    for e in trace["traceEvents"]:
        ph = e.get("ph")
        if ph in ("s", "f"):
            a = e.get("args") or {}
            if "task" not in a:  # no identity: an older trace
                continue
            if ph == "s":  # the export put the start 1 ns before the send (see _chrome)
                t = (e["ts"] + 0.001) / 1e6
                data.sends.append(Send(a["from"], a["step"], a["task"], a["to"], t))
            else:
                data.arrivals.append(
                    Arrival(a["to"], a["step"], a["task"], a["from"], e["ts"] / 1e6)
                )
            continue
        if e.get("ph") == "X":
            if (e.get("args") or {}).get("unfinished"):  # a failed step's: in its Failure
                continue
            start = e["ts"] / 1e6
            data.spans.append(
                Span(
                    lane=e["pid"],
                    step=e.get("args", {}).get("step", 0),
                    task=e["name"],
                    start=start,
                    end=start + e["dur"] / 1e6,
                )
            )
        elif e.get("ph") == "i" and e.get("name") == "decision":
            a = e.get("args", {})
            data.decisions.append(
                Decision(
                    lane=e["pid"],
                    step=a.get("step", 0),
                    time=e["ts"] / 1e6,
                    chosen=a.get("chosen"),
                    hinted=a.get("hinted"),
                    ready=a.get("ready", {}),
                    idle=a.get("idle", 0.0),
                )
            )
    rr = trace.get("otherData", {}).get("rrfp", {})
    data.steps = _rows(StepRecord, rr.get("steps", []))
    data.ready = _rows(Ready, rr.get("ready", []))
    data.failures = _rows(Failure, rr.get("failures", []))
    return data
