"""One timeline from many processes: merge per-rank Chrome traces (JSON only).

Under torchrun every process records its own ranks and writes its own file
(``rank{r}.json``, see ``rank_trace_path``). A message crosses two files: its sender's holds
the flow's start, its receiver's the end, and each file numbered its flows on its own. So
the merge joins the halves by the message's identity, which ``chrome_trace`` writes into
both halves' ``args``: (``step``, ``task`` = the consumer, ``from``, ``to``), and numbers
the joined flows afresh. Nothing is unpickled: every input is checked JSON
(``load_trace``'s rules, less the pairing of flows).

Design note: one clock
----------------------
A real stage clock is ``time.monotonic``. On Linux that is ``CLOCK_MONOTONIC``: one clock
for every process of a host until it reboots (containers too, unless one runs in a time
namespace of its own), so the files of one host (same name, same boot id) line up exactly
as recorded, with no correction and no error. Its zero is arbitrary,
though, so hosts (or boots) disagree; for them each file records ``clock_origin`` (a monotonic and a
wall-clock reading taken together when the file was written; see ``clock_origin``), and
the merge puts every file on the wall clock: ``t - origin.monotonic + origin.wall`` (in
practice onto the first file's host clock through it, which keeps sub-microsecond times). The
error is then the hosts' wall-clock offsets (NTP keeps a LAN within about a millisecond,
often far less; an unsynchronised host can be off by seconds) plus a microsecond or so of
sampling. The merge measures what it can: a message cannot arrive before the task that
produced it started, so the largest "arrival before the producer's start" over all joined
messages is a lower bound on the offset between two hosts, and the merge reports it
(``MergedTrace.causality_gap``; the CLI prints it). Not the send time: a flow starts where
the producing task ends *as the sender's event loop saw it*, and an output leaves from the
compute thread before the loop hears that the task ended (a message can arrive before its
producer's recorded end on one clock: BENCHMARKS.md#notes-from-the-runtimes-docstrings).
The bound does not try to
correct the offset: a correction guessed from messages would also hide real delays. A
real-clock file without a ``clock_origin`` (written by an older version) cannot be placed
on the others' clock and is refused.

Design note: what a job that died leaves
----------------------------------------
After a rank dies, its file of the failed step never comes, and a file copied off a node
may stop half-way. ``merge_trace_files(partial=True)`` merges what is there and says what
is not: a rank is *missing* when a file here holds half of a message to or from it, or names
it in its ``pipeline`` (every ``DistributedStage`` file lists its pipeline's ranks, so that
a rank that exchanged nothing yet is named too); its halves are dropped and listed. A file
*torn* by a cut is read up to the cut (``_torn``); one cut inside its header has no clock to
be placed on and is left out. Everything else a strict merge refuses (files of two runs,
two files of one rank) is still refused: a partial picture is shown, a wrong one never.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import TraceError
from .._tasks import Task
from ._chrome import chrome_trace, read_trace_file, validate_chrome_trace, write_trace
from ._trace_data import (
    Arrival,
    Decision,
    Failure,
    Ready,
    Send,
    Span,
    StepRecord,
    TraceData,
    from_chrome,
)

__all__ = [
    "MergedTrace",
    "merge_trace_files",
    "merge_traces",
    "newest_trace_files",
    "rank_trace_path",
    "trace_files",
]

_RANK_FILE = re.compile(r"rank(\d+)\.json$")


def rank_trace_path(directory: str | Path, rank: int, *, failed: bool = False) -> Path:
    """Where rank ``rank``'s trace goes in ``directory``: ``rank{rank}.json`` (its last
    step that ended well), or with ``failed`` ``failed-rank{rank}.json`` (its last step that
    failed: what it ran before it failed; merge those with ``failed-rank*.json``)."""
    return Path(directory) / (f"failed-rank{rank}.json" if failed else f"rank{rank}.json")


def _natural(p: Path) -> tuple[str, int, str]:
    m = _RANK_FILE.search(p.name)
    return (str(p.parent), int(m.group(1)) if m else -1, p.name)


def trace_files(specs: Iterable[str | Path]) -> list[Path]:
    """The trace files named by ``specs``: files, directories (their ``rank*.json``) and
    glob patterns (``out/rank*.json``, quoted so the shell leaves it), in rank order, each
    once.

    Raises:
        TraceError: A spec names nothing (no such file, a pattern that matches no file, a
            directory without ``rank*.json``; the message says which subdirectories hold
            some), or no spec is given.
    """
    out: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = sorted(p.glob("rank*.json"), key=_natural)
            if not found:
                subs = sorted({q.parent.relative_to(p).as_posix() for q in p.glob("*/rank*.json")})
                hint = (
                    f"; its subdirectories {', '.join(s + '/' for s in subs)} hold some (one"
                    " per policy, from TrainConfig(trace_dir=...)): name one"
                    if subs
                    else ""
                )
                raise TraceError(f"no per-rank trace files (rank*.json) in {p}{hint}")
            out.extend(found)
        elif p.exists():  # a file, or a pipe (``<(cmd)``, ``/dev/fd/N``, ``/dev/stdin``)
            out.append(p)
        elif glob.has_magic(str(spec)):
            found = sorted(
                (Path(q) for q in glob.glob(str(spec)) if Path(q).is_file()), key=_natural
            )
            if not found:
                raise TraceError(f"no trace file matches {str(spec)!r}")
            out.extend(found)
        else:
            raise TraceError(f"no such trace file or directory: {str(spec)!r}")
    if not out:
        raise TraceError("no trace files given: name the per-rank files, a glob or a directory")
    seen: set[Path] = set()
    unique = []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def newest_trace_files(directory: str | Path) -> tuple[list[Path], str]:
    """The files of the newest step a trace directory holds, and a note on the files passed
    over (``""``: none).

    A ``trace_dir`` holds each rank's last step that ended well (``rank{r}.json``) and,
    after a step failed, its last failed step (``failed-rank{r}.json``: what that rank saw
    of it, marked failed). The newer set is the one whose files hold the later step: the
    failed step of a job that died, the good steps of a job that failed a step and went on
    (a set none of whose files can be read counts as older).

    Raises:
        TraceError: The directory holds neither kind of file (see ``trace_files``).
    """
    d = Path(directory)
    good = sorted(d.glob("rank*.json"), key=_natural)
    failed = sorted(d.glob("failed-rank*.json"), key=_natural)
    if not failed:
        return trace_files([d]), ""
    if not good:
        return failed, ""
    g, f = _newest_step(good), _newest_step(failed)
    if f is not None and (g is None or f > g):
        held = f"step {g}" if g is not None else "no step that can be read"
        return failed, (
            f"the failed step {f} (failed-rank*.json); the rank*.json beside them hold {held},"
            f" the last that ended well: rrfp-async trace '{d / 'rank*.json'}'"
        )
    held = f"hold step {f}, which failed" if f is not None else "cannot be read"
    return good, (
        f"the last step that ended well (rank*.json); failed-rank*.json beside them {held}:"
        f" rrfp-async trace '{d / 'failed-rank*.json'}'"
    )


def _newest_step(files: Iterable[Path]) -> int | None:
    """The latest step any of ``files`` holds (None: none can be read)."""
    steps: set[int] = set()
    for p in files:
        try:
            tr, _ = read_trace_file(p, whole=False, torn_ok=True)
        except (TraceError, OSError):
            continue
        data = from_chrome(tr)
        for lane in _lanes(data):
            steps |= _steps_of(data, lane)
    return max(steps, default=None)


@dataclass(frozen=True)
class MergedTrace:
    """Per-rank trace files merged onto one clock.

    Attributes:
        data: The records of every file, times in seconds on the common clock (the stage
            clock of the first file's host: on one host, every file's own).
        files: The files, in the order read.
        ranks: Rank (lane) -> the file that held it.
        clock: ``"real"`` or ``"virtual"``.
        alignment: How the files' clocks were put on one (see the module's design note).
        causality_gap: Seconds by which the worst joined message arrived before the task
            that produced it started, on the common clock (0.0 when none did): a lower bound
            on the offset between two hosts' clocks (see the design note).
        dropped: Messages sent but never received (or received, never sent) between ranks
            whose files are all here: a failed step's; their half-flows are left out.
        emulated: Whether any file says its GPU time was emulated.
        policy: The policy of the run (every file's).
        hint: The hint of the run (every file's).
        missing: (``partial=True``) The ranks whose files are missing: named by the
            messages of the files here, or by their ``pipeline``; their messages' halves
            are left out (in ``dropped``).
        torn: (``partial=True``) A line per file cut short: how far it was read, or that it
            was left out (cut before its header).
        pipeline: The ranks the files name as their pipelines' (empty: files written
            without it).
    """

    data: TraceData
    files: tuple[Path, ...]
    ranks: dict[int, Path]
    clock: str
    alignment: str
    causality_gap: float = 0.0
    dropped: tuple[str, ...] = ()
    emulated: bool = False
    policy: str = ""
    hint: str = ""
    missing: tuple[int, ...] = ()
    torn: tuple[str, ...] = ()
    pipeline: tuple[int, ...] = ()
    _origin: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def complete(self) -> bool:
        """Whether every rank's file was here and whole (nothing ``missing`` or ``torn``)."""
        return not self.missing and not self.torn

    def chrome_trace(self) -> dict[str, Any]:
        """The merged Chrome / Perfetto trace (one lane per rank, flows joined and numbered
        afresh); ``otherData.rrfp.merged`` says which files, how the clocks were aligned,
        the causality gap and the dropped messages."""
        tr = chrome_trace(
            self.data,
            clock=self.clock,
            emulated=self.emulated,
            policy=self.policy,
            hint=self.hint,
            title=f"{len(self.files)} per-rank trace files merged",
            origin=self._origin or None,
            pipeline=self.pipeline or None,
        )
        tr["otherData"]["rrfp"]["merged"] = {
            "files": [str(p) for p in self.files],
            "alignment": self.alignment,
            "causality_gap": self.causality_gap,
            "dropped": list(self.dropped),
            "missing": list(self.missing),
            "torn": list(self.torn),
        }
        return tr


def merge_traces(paths: Iterable[str | Path], *, out: str | Path | None = None) -> TraceData:
    """One timeline from per-rank trace files (JSON; nothing is unpickled).

    Messages are joined across files by their identity (step, consumer task, sending and
    receiving rank); the clocks are aligned as ``MergedTrace.alignment`` says (one host:
    exact; several: the wall clock, see the ``_merge`` design note). ``merge_trace_files``
    returns the details (alignment, causality gap, dropped messages).

    Args:
        paths: Files, directories (their ``rank*.json``) or glob patterns.
        out: Also write the merged Chrome / Perfetto trace there.

    Returns:
        The merged records, times in seconds on the common clock, the first file's host's
        stage clock (``summarize`` it, render it with ``render_png``; ``out=`` or
        ``merge_trace_files(...).chrome_trace()`` exports it with its clock origin).

    Raises:
        TraceError: A file is not a trace; a rank's messages go to or come from a rank
            whose file is missing (the message names the ranks and the files); two files
            hold the same rank; the files hold different steps or come from different
            policies or clocks; a real-clock file has no ``clock_origin``.
    """
    merged = merge_trace_files(paths)
    if out is not None:
        write_trace(out, merged.chrome_trace())
    return merged.data


def _shift(data: TraceData, dt: float) -> TraceData:
    """``data`` with every time moved by ``dt`` seconds (step stats keep their own clock)."""
    return TraceData(
        [Span(s.lane, s.step, s.task, s.start + dt, s.end + dt) for s in data.spans],
        [Send(s.lane, s.step, s.task, s.dst, s.time + dt) for s in data.sends],
        [Arrival(a.lane, a.step, a.task, a.src, a.time + dt) for a in data.arrivals],
        [Ready(r.lane, r.step, r.task, r.time + dt) for r in data.ready],
        [
            Decision(d.lane, d.step, d.time + dt, d.chosen, d.hinted, d.ready, d.idle)
            for d in data.decisions
        ],
        [StepRecord(*r) for r in data.steps],
        [
            Failure(
                f.lane,
                f.step,
                f.time + dt,
                f.error,
                f.message,
                {t: start + dt for t, start in f.running.items()},
            )
            for f in data.failures
        ],
    )


def _lanes(data: TraceData) -> set[int]:
    rows: list[Iterable[Any]] = [data.spans, data.arrivals, data.decisions, data.ready, data.steps]
    rows.append(data.failures)
    return {r.lane for rs in rows for r in rs} | {s.lane for s in data.sends}


def _steps_of(data: TraceData, lane: int) -> set[int]:
    rows: list[Iterable[Any]] = [data.spans, data.sends, data.arrivals, data.decisions]
    rows.append(data.failures)
    return {r.step for rs in rows for r in rs if r.lane == lane}


def _fmt(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def merge_trace_files(paths: Iterable[str | Path], *, partial: bool = False) -> MergedTrace:
    """``merge_traces`` with the details: see ``MergedTrace`` and ``merge_traces``.

    Args:
        paths: Files, directories (their ``rank*.json``) or glob patterns.
        partial: Merge what is there (the evidence of a job that died): a rank whose file
            is missing is named in ``MergedTrace.missing`` instead of refused, and the
            halves of its messages are left out (``dropped``); a file cut short is read up
            to the cut (``torn``; one cut inside its header is left out). Every other
            refusal stands.

    Raises:
        TraceError: As ``merge_traces`` says (with ``partial``, not for missing or torn
            files, unless no file can be read at all).
    """
    files = trace_files([paths] if isinstance(paths, str | Path) else paths)
    parts: list[tuple[Path, dict[str, Any], TraceData]] = []
    torn: list[str] = []
    cut_ranks: set[int] = set()  # the ranks, by file name, of the files cut short
    for p in files:
        tr, cut = read_trace_file(p, whole=False, torn_ok=partial)
        if cut is not None:
            m = _RANK_FILE.search(p.name)
            if m:
                cut_ranks.add(int(m.group(1)))
            if not cut.header:
                torn.append(
                    f"{p}: cut short after {cut.length} bytes, inside its header"
                    " (otherData): left out"
                )
                continue
            torn.append(
                f"{p}: cut short after {cut.length} bytes: read up to the cut ({cut.events}"
                " whole events)"
            )
        flows = [e for e in tr["traceEvents"] if e.get("ph") in ("s", "f")]
        if any("task" not in (e.get("args") or {}) for e in flows):
            raise TraceError(
                f"{p}: its message flows do not carry the message's identity (written by an"
                " older rrfp_async): it cannot be merged with other files; record it again"
            )
        parts.append((p, tr, from_chrome(tr)))
    if not parts:
        raise TraceError("no trace file could be read: " + "; ".join(torn))
    metas = [(p, tr.get("otherData", {}).get("rrfp", {})) for p, tr, _ in parts]
    for key in ("clock", "policy"):
        seen = {str(m.get(key, "")) for _, m in metas}
        if len(seen) > 1:
            which = "; ".join(f"{m.get(key, '')!r} in {p}" for p, m in metas)
            raise TraceError(f"the files come from different runs: {key} {which}")
    clock = str(metas[0][1].get("clock", "real"))
    shifts, alignment, origin = _align(metas, clock)
    ranks: dict[int, Path] = {}
    pieces = []
    for (p, _, data), (_, meta), dt in zip(parts, metas, shifts, strict=True):
        t0 = meta.get("t0", 0.0)
        if not isinstance(t0, int | float) or isinstance(t0, bool):
            raise TraceError(f"{p}: otherData.rrfp.t0 must be a number, got {t0!r}")
        for lane in _lanes(data):
            if lane in ranks:
                raise TraceError(
                    f"rank {lane} is in both {ranks[lane]} and {p}: give each rank's file once"
                    " (a merged file and a part of it, or files of two runs?)"
                )
            ranks[lane] = p
        pieces.append(_shift(data, t0 + dt))
    data = TraceData.merge(pieces)
    _check_steps(data, ranks, partial=partial)
    data, dropped, gap, talked = _join(data, ranks, partial=partial)
    pipeline = sorted({r for _, m in metas for r in m.get("pipeline", [])})
    missing = (set(talked) | set(pipeline)) - set(ranks) - cut_ranks if partial else set()
    merged = MergedTrace(
        data=data,
        files=tuple(files),
        ranks=dict(sorted(ranks.items())),
        clock=clock,
        alignment=alignment,
        causality_gap=gap,
        dropped=tuple(dropped),
        emulated=any(bool(m.get("emulated_gpu_time")) for _, m in metas),
        policy=str(metas[0][1].get("policy", "")),
        hint=" / ".join(dict.fromkeys(str(m.get("hint", "")) for _, m in metas)),
        missing=tuple(sorted(missing)),
        torn=tuple(torn),
        pipeline=tuple(pipeline),
        _origin=origin,
    )
    problems = validate_chrome_trace(merged.chrome_trace())
    if problems:  # pragma: no cover - every input was checked; a bug of the merge
        raise TraceError("the merged trace is not valid: " + "; ".join(problems[:5]))
    return merged


def _align(
    metas: list[tuple[Path, Mapping[str, Any]]], clock: str
) -> tuple[list[float], str, dict[str, Any]]:
    """Per file, the seconds to add to its stage-clock times; how; and the merged trace's
    clock origin (see the design note)."""
    if clock != "real":
        return [0.0] * len(metas), f"{clock} clock: the files' own times, as recorded", {}
    origins = []
    for p, m in metas:
        o = m.get("clock_origin")
        if not (
            isinstance(o, dict)
            and all(
                isinstance(o.get(k), int | float) and not isinstance(o.get(k), bool)
                for k in ("monotonic", "wall")
            )
        ):
            raise TraceError(
                f"{p} has no clock_origin (written by an older rrfp_async, or edited): its"
                " times cannot be placed on the other files' clock; record it again"
            )
        origins.append(o)
    hosts = {(str(o.get("host", "")), str(o.get("boot", ""))) for o in origins}
    if len(hosts) == 1:
        host = next(iter(hosts))[0]
        return (
            [0.0] * len(metas),
            f"one host ({host}): its monotonic clock, shared by every process; exact",
            dict(origins[0]),
        )
    names = sorted({h for h, _ in hosts})  # one name twice: two boots (or containers)
    # Onto the first file's host clock, through the wall clock: (wall - wall_ref) first, so
    # that no time passes through a float of wall-clock size (1.7e9 s: 0.24 us steps).
    ref = origins[0]
    return (
        [(o["wall"] - ref["wall"]) - (o["monotonic"] - ref["monotonic"]) for o in origins],
        f"{len(hosts)} hosts ({', '.join(names)}): the wall clock (time.time() when each file"
        " was written); off by the hosts' clock offsets (NTP: about a millisecond on a LAN,"
        " often less)",
        dict(ref),
    )


def _check_steps(data: TraceData, ranks: Mapping[int, Path], *, partial: bool) -> None:
    """Every rank's file must hold the same steps (flows of other steps cannot join); with
    ``partial``, a rank whose file holds no step at all (cut short) is let be."""
    steps = {lane: _steps_of(data, lane) for lane in ranks}
    if partial:
        steps = {lane: s for lane, s in steps.items() if s}
    if len({frozenset(s) for s in steps.values()}) > 1:
        which = "; ".join(
            f"rank {lane} ({ranks[lane].name}): steps {sorted(s) or 'none'}"
            for lane, s in sorted(steps.items())
        )
        raise TraceError(
            f"the files hold different steps: {which}. Merge files of the same traced steps"
            " (a rank whose step failed or hung may have written an earlier step)"
        )


def _join(
    data: TraceData, ranks: Mapping[int, Path], *, partial: bool
) -> tuple[TraceData, list[str], float, list[int]]:
    """Match every send with its arrival; name the missing files (refused, or with
    ``partial`` returned, their halves dropped); drop (and report) halves whose other end
    is in a file here but never happened; measure the causality gap."""
    sends = {(s.step, s.task, s.lane, s.dst): s for s in data.sends}
    arrivals = {(a.step, a.task, a.src, a.lane): a for a in data.arrivals}
    missing: dict[int, set[int]] = {}  # absent rank -> the ranks that talked to it
    dropped: list[str] = []
    for key in sends.keys() ^ arrivals.keys():
        step, task, src, dst = key
        other = dst if key in sends else src
        if other not in ranks:
            missing.setdefault(other, set()).add(src if key in sends else dst)
            what = f"rank {other}'s file is missing"
        else:
            what = "sent, never received" if key in sends else "received, never sent"
        dropped.append(f"step {step}: -> {task} from rank {src} to rank {dst} ({what})")
    if missing and not partial:
        need = _fmt(missing)
        talk = sorted({r for rs in missing.values() for r in rs})
        files = ", ".join(sorted({str(ranks[r]) for r in talk}))
        raise TraceError(
            f"the trace file of {need} is missing: {_fmt(talk)} ({files}) exchanged"
            f" messages with {need}, whose halves are in {need}'s own file. Add it (or name"
            " the directory, or a glob such as out/rank*.json, that holds every rank's file)"
        )
    both = sends.keys() & arrivals.keys()
    starts = {(s.lane, s.step, s.task): s.start for s in data.spans}
    gap = 0.0
    for key in both:
        step, task, src, _ = key
        t = Task.parse(task)  # its producer: the previous stage's F, the next stage's B / I
        producer = str(t._replace(stage=t.stage - 1 if t.kind == "F" else t.stage + 1))
        start = starts.get((src, step, producer))
        if start is not None:
            gap = max(gap, start - arrivals[key].time)
    kept = TraceData(
        data.spans,
        [s for k, s in sends.items() if k in both],
        [a for k, a in arrivals.items() if k in both],
        data.ready,
        data.decisions,
        data.steps,
        data.failures,
    )
    return kept, sorted(dropped), gap, sorted(missing)
