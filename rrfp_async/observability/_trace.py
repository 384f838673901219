"""Traces of real and simulated steps: a recorder, Chrome-trace / Perfetto JSON, summaries,
PNG timelines.

``TraceRecorder`` is a ``StageObserver``: it keeps compute spans, message sends and arrivals,
ready times, decisions and per-step stats as plain lists (``TraceData``), which travel
between processes and merge. ``chrome_trace`` turns them into the Trace Event Format that
chrome://tracing and ui.perfetto.dev read:

* one process lane per rank (``pid`` = rank), named ``rank N``;
* one complete event (``ph: "X"``) per executed task, ``cat`` = its kind (F/B/I/W), ``name``
  = its text form (``2F3``), ``args`` = stage, kind, microbatch, step;
* one flow (``ph: "s"`` at the producer's end, ``ph: "f"`` at the consumer's next slice) per
  message between ranks, ``cat: "message"``;
* one instant event (``ph: "i"``, ``name: "decision"``) per dispatch decision, with the
  ready set and hint ranks, the hinted task and whether it deviated;
* ``otherData.rrfp``: the clock ("virtual" or "real"), whether GPU time was emulated, the
  policy, the hint, and per-rank step statistics.

Times are microseconds from the earliest event of the trace.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._tasks import Task
from ..loop._stage import StageLoop, StepStats

__all__ = [
    "MultiObserver",
    "TraceData",
    "TraceRecorder",
    "chrome_trace",
    "load_trace",
    "render_png",
    "summarize",
    "validate_chrome_trace",
    "write_trace",
]

KIND_COLORS = {"F": "#4C78A8", "B": "#54A24B", "I": "#F58518", "W": "#B279A2"}


@dataclass
class TraceData:
    """Plain, picklable trace records (seconds on the stage clock).

    A *lane* is a rank: the pipeline rank in a simulation, the global rank in a
    multi-process run.

    Attributes:
        spans: ``[rank, step, task text, start, end]`` per executed task.
        sends: ``[src lane, step, consumer task text, dst lane, time]`` per message sent.
        arrivals: ``[lane, step, consumer task text, src lane, time]`` per message received.
        ready: ``[rank, step, task text, time]`` when a task's inputs were all present.
        decisions: ``[rank, step, time, chosen, hinted, {ready task: hint rank}, idle]``.
        steps: ``[rank, step, stats dict]`` per finished step.
    """

    spans: list[list[Any]] = field(default_factory=list)
    sends: list[list[Any]] = field(default_factory=list)
    arrivals: list[list[Any]] = field(default_factory=list)
    ready: list[list[Any]] = field(default_factory=list)
    decisions: list[list[Any]] = field(default_factory=list)
    steps: list[list[Any]] = field(default_factory=list)

    def extend(self, other: TraceData) -> None:
        """Append another recording (e.g. another process's)."""
        for name in ("spans", "sends", "arrivals", "ready", "decisions", "steps"):
            getattr(self, name).extend(getattr(other, name))

    @classmethod
    def merge(cls, parts: Iterable[TraceData]) -> TraceData:
        """One recording from several (one per process)."""
        out = cls()
        for p in parts:
            out.extend(p)
        return out

    def only_step(self, step: int) -> TraceData:
        """The records of one step."""

        def keep(rows: list[list[Any]], i: int = 1) -> list[list[Any]]:
            return [r for r in rows if r[i] == step]

        return TraceData(
            keep(self.spans),
            keep(self.sends),
            keep(self.arrivals),
            keep(self.ready),
            keep(self.decisions),
            keep(self.steps),
        )


class TraceRecorder:
    """A ``StageObserver`` that records everything a trace shows (cheap appends).

    Args:
        peers: Pipeline rank -> lane (global rank) of this process's peers; default: lanes
            are pipeline ranks (one process per stage, or a simulation).
    """

    active = True

    def __init__(self, peers: Mapping[int, int] | None = None) -> None:
        self.peers = dict(peers) if peers is not None else None
        self.data = TraceData()

    def _lane(self, pp_rank: int) -> int:
        return pp_rank if self.peers is None else self.peers[pp_rank]

    def _r(self, stage: StageLoop) -> int:
        return self._lane(stage.rank)

    def step_start(self, stage: StageLoop) -> None:
        pass

    def message(self, stage: StageLoop, task: Task, src: int) -> None:
        self.data.arrivals.append(
            [self._r(stage), stage.step, str(task), self._lane(src), stage._now()]
        )

    def ready(self, stage: StageLoop, task: Task) -> None:
        self.data.ready.append([self._r(stage), stage.step, str(task), stage._now()])

    def decision(self, stage: StageLoop, task: Task, ready: Sequence[Task], idle: float) -> None:
        view = stage._view
        self.data.decisions.append(
            [
                self._r(stage),
                stage.step,
                stage._now(),
                str(task),
                str(view.next_hinted),
                {str(t): view.hint_rank(t) for t in ready},
                idle,
            ]
        )

    def task_start(self, stage: StageLoop, task: Task) -> None:
        pass

    def task_end(self, stage: StageLoop, task: Task, start: float, end: float) -> None:
        r = self._r(stage)
        self.data.spans.append([r, stage.step, str(task), start, end])
        prog = stage.schedule.program(stage.rank)
        remote = prog.data_remote[prog.pos[task]]
        if remote is not None:
            self.data.sends.append([r, stage.step, str(remote[1]), self._lane(remote[0]), end])

    def stall(self, stage: StageLoop, reason: str) -> None:
        pass

    def tp_decision(self, stage: StageLoop, task: Task, seq: int, sent: bool) -> None:
        pass

    def step_end(self, stage: StageLoop, stats: StepStats) -> None:
        self.data.steps.append(
            [
                self._r(stage),
                stats.step,
                {
                    "stage": stage.rank,
                    "policy": stats.policy,
                    "hint": stats.hint,
                    "started": stats.started,
                    "finished": stats.finished,
                    "busy": stats.busy,
                    "peak_inflight": stats.peak_inflight,
                    "max_inflight": stats.max_inflight,
                    "deviations": stats.deviations,
                    "decisions": stats.decisions,
                },
            ]
        )


class MultiObserver:
    """Fans every transition out to several observers (e.g. a logger and a recorder)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = [o for o in observers if o is not None]
        self._live: list[Any] = []

    @property
    def active(self) -> bool:
        """True when any observer is active (the inactive ones are skipped this step)."""
        self._live = [o for o in self.observers if getattr(o, "active", True)]
        return bool(self._live)

    def failed(self, stage: StageLoop, exc: BaseException, dump: str) -> None:
        """Every observer that has ``failed`` gets it, active or not."""
        for o in self.observers:
            fn = getattr(o, "failed", None)
            if fn is not None:
                fn(stage, exc, dump)

    def __getattr__(self, name: str) -> Any:
        def fan(*args: Any) -> None:
            for o in self._live:
                getattr(o, name)(*args)

        return fan


# ---------------------------------------------------------------------------------- export


def chrome_trace(
    data: TraceData,
    *,
    clock: str = "real",
    emulated: bool = False,
    policy: str = "",
    hint: str = "",
    title: str = "",
) -> dict[str, Any]:
    """The Trace Event Format JSON (a dict) of ``data``; see the module docstring.

    Args:
        data: The records.
        clock: ``"virtual"`` (simulated) or ``"real"``.
        emulated: Whether GPU time was emulated (CPU compute + sleeps from a cost model).
        policy: The policy's name.
        hint: The hint's name.
        title: A free-text description.
    """
    times = [s[3] for s in data.spans] + [a[4] for a in data.arrivals]
    times += [d[2] for d in data.decisions]
    t0 = min(times) if times else 0.0

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    ranks = sorted({s[0] for s in data.spans} | {s[0] for s in data.steps})
    events: list[dict[str, Any]] = []
    for r in ranks:
        events.append(
            {"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
        )
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}}
        )
    for r, step, task, start, end in sorted(data.spans, key=lambda s: (s[0], s[3])):
        t = Task.parse(task)
        events.append(
            {
                "name": task,
                "cat": t.kind,
                "ph": "X",
                "ts": us(start),
                "dur": round((end - start) * 1e6, 3),
                "pid": r,
                "tid": 0,
                "args": {"stage": t.stage, "kind": t.kind, "mb": t.mb, "step": step},
            }
        )
    flow_ids: dict[tuple[int, str, int, int], int] = {}
    for src, step, task, dst, t in data.sends:
        fid = flow_ids.setdefault((step, task, src, dst), len(flow_ids) + 1)
        events.append(
            {
                "name": f"-> {task}",
                "cat": "message",
                "ph": "s",
                "id": fid,
                "ts": us(t) - 0.001,
                "pid": src,
                "tid": 0,
            }
        )
    for r, step, task, src, t in data.arrivals:
        fid = flow_ids.setdefault((step, task, src, r), len(flow_ids) + 1)
        events.append(
            {
                "name": f"-> {task}",
                "cat": "message",
                "ph": "f",
                "id": fid,
                "ts": us(t),
                "pid": r,
                "tid": 0,
                "args": {"from": src},
            }
        )
    for r, step, t, chosen, hinted, ready, idle in data.decisions:
        events.append(
            {
                "name": "decision",
                "cat": "decision",
                "ph": "i",
                "s": "t",
                "ts": us(t),
                "pid": r,
                "tid": 0,
                "args": {
                    "step": step,
                    "chosen": chosen,
                    "hinted": hinted,
                    "deviation": chosen != hinted,
                    "ready": ready,
                    "idle": idle,
                },
            }
        )
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
                "steps": [[r, s, st] for r, s, st in data.steps],
                "summary": summarize(data),
            }
        },
    }


def write_trace(path: str | Path, trace: Mapping[str, Any]) -> Path:
    """Write a trace dict as JSON; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(trace))
    return p


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a trace JSON written by ``write_trace`` (or any Trace Event Format file).

    Raises:
        ValueError: Not a trace (no ``traceEvents`` list).
    """
    obj = json.loads(Path(path).read_text())
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Trace Event Format file (no traceEvents list)")
    return obj


def validate_chrome_trace(trace: Mapping[str, Any]) -> list[str]:
    """Schema check of a trace made by ``chrome_trace``; returns the problems (empty: ok).

    Checks the required keys and types of every event, that compute spans of a rank do not
    overlap, and that every flow has both ends.
    """
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
    flows: dict[int, set[str]] = {}
    for i, e in enumerate(evs):
        ph = e.get("ph")
        if ph not in need:
            problems.append(f"event {i}: unknown phase {ph!r}")
            continue
        for k in need[ph]:
            if k not in e:
                problems.append(f"event {i} ({ph}): missing {k}")
        if ph == "X":
            if not (
                isinstance(e.get("ts"), int | float)
                and isinstance(e.get("dur"), int | float)
                and e["dur"] >= 0
                and math.isfinite(e["ts"])
            ):
                problems.append(f"event {i}: bad ts/dur")
                continue
            if e.get("cat") not in KIND_COLORS:
                problems.append(f"event {i}: cat {e.get('cat')!r} is not a task kind")
            try:
                Task.parse(e["name"])
            except ValueError:
                problems.append(f"event {i}: name {e['name']!r} is not a task")
            lanes.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif ph in ("s", "f"):
            flows.setdefault(e["id"], set()).add(ph)
    for pid, spans in lanes.items():
        spans.sort()
        for (_, e0, n0), (s1, _, n1) in itertools.pairwise(spans):
            if s1 < e0 - 0.01:  # µs; ts and dur are rounded separately
                problems.append(f"rank {pid}: {n0} and {n1} overlap")
    for fid, ends in flows.items():
        if ends != {"s", "f"}:
            problems.append(f"flow {fid} has only {sorted(ends)}")
    return problems


# ---------------------------------------------------------------------------------- summary


def _from_chrome(trace: Mapping[str, Any]) -> TraceData:
    data = TraceData()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            start = e["ts"] / 1e6
            data.spans.append(
                [
                    e["pid"],
                    e.get("args", {}).get("step", 0),
                    e["name"],
                    start,
                    start + e["dur"] / 1e6,
                ]
            )
        elif e.get("ph") == "i" and e.get("name") == "decision":
            a = e.get("args", {})
            data.decisions.append(
                [
                    e["pid"],
                    a.get("step", 0),
                    e["ts"] / 1e6,
                    a.get("chosen"),
                    a.get("hinted"),
                    a.get("ready", {}),
                    a.get("idle", 0.0),
                ]
            )
    rr = trace.get("otherData", {}).get("rrfp", {})
    data.steps = [list(x) for x in rr.get("steps", [])]
    return data


def summarize(trace: TraceData | Mapping[str, Any]) -> dict[str, Any]:
    """Per-rank busy / idle time, bubble ratio, peak in-flight, deviations, and the idle time
    deviations filled, from a recording or a Chrome trace.

    ``filled``: for each decision that ran something other than the hinted task, the part
    of that task's run during which the hinted task was not yet ready, i.e. time a fixed
    order would have spent idle under the same arrival times.
    """
    data = trace if isinstance(trace, TraceData) else _from_chrome(trace)
    if not data.spans:
        return {"makespan": 0.0, "ranks": {}, "bubble_ratio": 0.0, "deviations": 0, "filled": 0.0}
    t0 = min(s[3] for s in data.spans)
    t1 = max(s[4] for s in data.spans)
    ready_at: dict[tuple[int, int, str], float] = {}
    for r, step, task, t in data.ready:
        ready_at.setdefault((r, step, task), t)
    span_of = {(s[0], s[1], s[2]): (s[3], s[4]) for s in data.spans}
    ranks: dict[int, dict[str, Any]] = {}
    for r in sorted({s[0] for s in data.spans}):
        spans = [s for s in data.spans if s[0] == r]
        busy = sum(s[4] - s[3] for s in spans)
        ranks[r] = {
            "busy": busy,
            "idle": (t1 - t0) - busy,
            "bubble_ratio": 1.0 - busy / (t1 - t0) if t1 > t0 else 0.0,
            "tasks": len(spans),
            "deviations": 0,
            "filled": 0.0,
            "peak_inflight": 0,
        }
    for r, _step, st in data.steps:
        if r in ranks:
            ranks[r]["peak_inflight"] = max(ranks[r]["peak_inflight"], st.get("peak_inflight", 0))
            ranks[r]["max_inflight"] = st.get("max_inflight")
    for r, step, _t, chosen, hinted, _ready, _idle in data.decisions:
        if chosen == hinted or r not in ranks:
            continue
        ranks[r]["deviations"] += 1
        span = span_of.get((r, step, chosen))
        if span is None:
            continue
        head_ready = ready_at.get((r, step, hinted), span[1])
        ranks[r]["filled"] += max(0.0, min(span[1], head_ready) - span[0])
    total = sum(v["busy"] + v["idle"] for v in ranks.values())
    return {
        "makespan": t1 - t0,
        "ranks": ranks,
        "bubble_ratio": sum(v["idle"] for v in ranks.values()) / total if total else 0.0,
        "deviations": sum(v["deviations"] for v in ranks.values()),
        "filled": sum(v["filled"] for v in ranks.values()),
        "peak_inflight": max(v["peak_inflight"] for v in ranks.values()),
    }


# ---------------------------------------------------------------------------------- PNG


def render_png(
    traces: Sequence[tuple[str, TraceData | Mapping[str, Any]]],
    path: str | Path,
    *,
    title: str = "",
    labels: bool = True,
) -> Path:
    """Draw timelines (one panel per trace, one row per rank, bars coloured by kind, gaps =
    bubbles) with real durations, and save a PNG.

    Args:
        traces: ``[(panel title, recording or Chrome trace), ...]``; panels share the x axis.
        path: Output file.
        title: Figure title (say whether time is virtual, real or emulated).
        labels: Write microbatch numbers on bars wide enough to hold them.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install rrfp-async[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is a dev / plot extra
        raise RuntimeError("render_png needs matplotlib: pip install 'rrfp-async[plot]'") from e
    datas = [(name, t if isinstance(t, TraceData) else _from_chrome(t)) for name, t in traces]
    n_ranks = max((len({s[0] for s in d.spans}) for _, d in datas), default=1)
    fig, axes = plt.subplots(
        len(datas),
        1,
        figsize=(14, 1.0 + 0.45 * n_ranks * len(datas) + 0.6),
        sharex=True,
        squeeze=False,
    )
    span_max = 0.0
    for ax, (name, d) in zip(axes[:, 0], datas, strict=True):
        if not d.spans:
            continue
        t0 = min(s[3] for s in d.spans)
        ranks = sorted({s[0] for s in d.spans})
        summ = summarize(d)
        for row, r in enumerate(ranks):
            for _, _step, task, start, end in (s for s in d.spans if s[0] == r):
                t = Task.parse(task)
                x, w = (start - t0) * 1e3, (end - start) * 1e3
                ax.broken_barh(
                    [(x, w)],
                    (row - 0.4, 0.8),
                    facecolors=KIND_COLORS[t.kind],
                    edgecolor="white",
                    linewidth=0.3,
                )
                span_max = max(span_max, x + w)
                if labels and w > 0:
                    ax.text(
                        x + w / 2,
                        row,
                        str(t.mb),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                        clip_on=True,
                    )
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_title(
            f"{name}: makespan {summ['makespan'] * 1e3:.1f} ms, bubble ratio"
            f" {summ['bubble_ratio']:.1%}, deviations {summ['deviations']}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("time (ms)")
    axes[-1, 0].set_xlim(0, span_max * 1.01 if span_max else 1)
    fig.legend(
        handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
