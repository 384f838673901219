"""Per-rank trace files merged into one timeline: flows joined across files, one clock,
fresh flow ids, the missing files named (all on constructed traces: each rank's part of a
simulated step, written as the process of that rank would write it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import rrfp_async as rr
from rrfp_async.cli import main
from rrfp_async.observability import (
    Arrival,
    Decision,
    Ready,
    Send,
    Span,
    StepRecord,
    TraceData,
    chrome_trace,
    merge_trace_files,
    summarize,
    trace_files,
    validate_chrome_trace,
    write_trace,
)

pytestmark = pytest.mark.timeout(120)

HOST_A: dict[str, Any] = {
    "host": "a",
    "boot": "boot-a",
    "monotonic": 100.0,
    "wall": 1_700_000_000.0,
}


def _whole(stages: int = 3, mbs: int = 4) -> TraceData:
    res = rr.simulate(
        stages=stages,
        microbatches=mbs,
        workload="multimodal",
        jitter=0.3,
        memory_factor=2.0,
        policy="readiness_first",
        latency=1e-4,
        record=True,
    )
    assert res.trace is not None
    return res.trace


def _part(data: TraceData, lane: int, dt: float = 0.0) -> TraceData:
    """What rank ``lane``'s own recorder holds, its clock ``dt`` seconds ahead."""
    return TraceData(
        [
            Span(s.lane, s.step, s.task, s.start + dt, s.end + dt)
            for s in data.spans
            if s.lane == lane
        ],
        [Send(s.lane, s.step, s.task, s.dst, s.time + dt) for s in data.sends if s.lane == lane],
        [
            Arrival(a.lane, a.step, a.task, a.src, a.time + dt)
            for a in data.arrivals
            if a.lane == lane
        ],
        [Ready(r.lane, r.step, r.task, r.time + dt) for r in data.ready if r.lane == lane],
        [
            Decision(d.lane, d.step, d.time + dt, d.chosen, d.hinted, d.ready, d.idle)
            for d in data.decisions
            if d.lane == lane
        ],
        [r for r in data.steps if r.lane == lane],
    )


def _write_parts(
    data: TraceData,
    d: Path,
    origins: dict[int, dict[str, Any]] | None = None,
    shifts: dict[int, float] | None = None,
) -> list[Path]:
    lanes = sorted({s.lane for s in data.spans})
    out = []
    for lane in lanes:
        dt = (shifts or {}).get(lane, 0.0)
        tr = chrome_trace(
            _part(data, lane, dt),
            clock="real",
            policy="readiness_first",
            hint="bfw",
            origin=(origins or {}).get(lane, HOST_A),
        )
        out.append(write_trace(d / f"rank{lane}.json", tr))
    return out


def _flows(tr: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """(step, task, from, to) -> {"s": ts, "f": ts, "id": id} of a trace's flows."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in tr["traceEvents"]:
        if e["ph"] in ("s", "f"):
            a = e["args"]
            f = out.setdefault((a["step"], a["task"], a["from"], a["to"]), {})
            f[e["ph"]] = e["ts"]
            assert f.setdefault("id", e["id"]) == e["id"]  # both halves share one id
    return out


def test_per_rank_files_merge_into_the_whole_step(tmp_path: Path) -> None:
    whole = _whole()
    paths = _write_parts(whole, tmp_path)
    # Each part numbered its flows from 1: the ids collide across files.
    part_ids = [
        {e["id"] for e in json.loads(p.read_text())["traceEvents"] if e["ph"] in ("s", "f")}
        for p in paths
    ]
    assert part_ids[0] & part_ids[1]
    merged = merge_trace_files(paths)
    assert merged.alignment.startswith("one host (a)") and merged.causality_gap == 0.0
    assert merged.dropped == () and sorted(merged.ranks) == [0, 1, 2]
    tr = merged.chrome_trace()
    assert validate_chrome_trace(tr) == []
    ref = chrome_trace(whole, clock="virtual")
    got, want = _flows(tr), _flows(ref)
    # Every message of the step is one flow, both halves joined, at the recorded times.
    assert got.keys() == want.keys() and len(got) == 2 * 2 * 4
    assert len({f["id"] for f in got.values()}) == len(got)  # fresh ids, none shared
    for k, f in got.items():
        assert f["s"] == pytest.approx(want[k]["s"], abs=0.01)
        assert f["f"] == pytest.approx(want[k]["f"], abs=0.01)
    # Ready times travel too (the summary's "filled" needs them).
    assert sorted((r.lane, r.task) for r in merged.data.ready) == sorted(
        (r.lane, r.task) for r in whole.ready
    )
    # The summary is the whole step's.
    s, w = summarize(merged.data), summarize(whole)
    assert s["makespan"] == pytest.approx(w["makespan"], abs=1e-8)
    assert s["filled"] == pytest.approx(w["filled"], abs=1e-8) and w["filled"] > 0
    for lane, v in w["ranks"].items():
        assert s["ranks"][lane]["tasks"] == v["tasks"]
        assert s["ranks"][lane]["busy"] == pytest.approx(v["busy"], abs=1e-8)
    # The public face: TraceData back, the merged Chrome JSON written with out=.
    data = rr.observability.merge_traces(paths, out=tmp_path / "m" / "merged.json")
    assert sorted(s.task for s in data.spans) == sorted(s.task for s in whole.spans)
    loaded = rr.observability.load_trace(tmp_path / "m" / "merged.json")
    assert loaded["otherData"]["rrfp"]["merged"]["files"] == [str(p) for p in paths]


def test_files_of_two_hosts_meet_on_the_wall_clock(tmp_path: Path) -> None:
    whole = _whole()
    # Host b's monotonic clock started 5000 s later than host a's: its readings are 5000 s
    # smaller for the same instant, and its clock_origin says so.
    host_b = {"host": "b", "boot": "boot-b", "monotonic": 100.0 - 5000.0, "wall": HOST_A["wall"]}
    paths = _write_parts(whole, tmp_path, origins={1: host_b}, shifts={1: -5000.0})
    merged = merge_trace_files(paths)
    assert merged.alignment.startswith("2 hosts (a, b): the wall clock")
    assert merged.causality_gap == 0.0
    got, want = _flows(merged.chrome_trace()), _flows(chrome_trace(whole, clock="virtual"))
    for k, f in got.items():  # on one clock again: every flow where it was
        assert f["f"] - f["s"] == pytest.approx(want[k]["f"] - want[k]["s"], abs=0.01)
    s = summarize(merged.data)
    assert s["makespan"] == pytest.approx(summarize(whole)["makespan"], abs=1e-6)
    # A host whose wall clock is 2 s slow: messages to it seem to arrive before the tasks
    # that produced them started; the merge reports by how much (a lower bound on the
    # offset: 2 s less the shortest producer-start-to-arrival of a message to rank 1).
    slow = {**host_b, "wall": HOST_A["wall"] - 2.0}
    paths = _write_parts(whole, tmp_path / "skew", origins={1: slow}, shifts={1: -5000.0})
    start = {(s.step, s.task): s.start for s in whole.spans}
    shortest = min(  # producers: 0F(m) for 1F(m), 2B(m) for 1B(m)
        a.time - start[(a.step, f"{a.src}{a.task[1:]}")] for a in whole.arrivals if a.lane == 1
    )
    gap = merge_trace_files(paths).causality_gap
    assert gap == pytest.approx(2.0 - shortest, abs=1e-6)


def test_one_rank_file_alone_says_which_files_it_needs(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path)
    with pytest.raises(rr.errors.TraceError) as ei:
        rr.observability.load_trace(paths[1])
    msg = str(ei.value)
    assert "holds rank 1" in msg and "rank 0, 2" in msg, msg
    assert f"rrfp-async trace {tmp_path / 'rank*.json'}" in msg and "flow 1 has only" not in msg
    # The command shows it, names the rank it needs and says how to merge (issue 41: it
    # refused, exit code 1).
    out = CliRunner().invoke(main, ["trace", str(paths[0])])
    assert out.exit_code == 3 and "trace file of rank 1 is missing" in out.output, out.output
    assert f"'{tmp_path / 'rank*.json'}'" in out.output.replace("\n", "")
    # A part whose messages all stay inside it is a whole trace: it loads.
    one = TraceData([Span(0, 0, "0F0", 1.0, 2.0)], steps=[StepRecord(0, 0, {})])
    ok = write_trace(tmp_path / "solo" / "rank0.json", chrome_trace(one, origin=HOST_A))
    assert rr.observability.load_trace(ok)["traceEvents"]


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path)
    with pytest.raises(rr.errors.TraceError) as ei:
        merge_trace_files(paths[:2])
    msg = str(ei.value)
    assert msg.startswith("the trace file of rank 2 is missing: rank 1 (")
    assert str(paths[1]) in msg and str(paths[0]) not in msg
    with pytest.raises(rr.errors.TraceError, match="trace file of ranks 0, 2 is missing"):
        merge_trace_files(paths[1:2])


def test_refused_combinations(tmp_path: Path) -> None:
    whole = _whole()
    paths = _write_parts(whole, tmp_path)
    copy = tmp_path / "copy" / "rank0.json"
    copy.parent.mkdir()
    shutil.copy(paths[0], copy)
    with pytest.raises(
        rr.errors.TraceError, match=r"rank 0 is in both .*rank0.json and .*copy/rank0"
    ):
        merge_trace_files([*paths, copy])
    # Another run's rank 2 (another policy), or its steps (the next step).
    other = tmp_path / "other"
    other.mkdir()
    tr = json.loads(paths[2].read_text())
    tr["otherData"]["rrfp"]["policy"] = "strict"
    (other / "rank2.json").write_text(json.dumps(tr))
    with pytest.raises(rr.errors.TraceError, match="different runs: policy 'readiness_first' in"):
        merge_trace_files([*paths[:2], other / "rank2.json"])
    later = TraceData.merge(
        [
            TraceData(
                [s._replace(step=1) for s in p.spans],
                [s._replace(step=1) for s in p.sends],
                [a._replace(step=1) for a in p.arrivals],
            )
            for p in [_part(whole, 2)]
        ]
    )
    write_trace(other / "rank2.json", chrome_trace(later, origin=HOST_A, policy="readiness_first"))
    with pytest.raises(
        rr.errors.TraceError, match=r"different steps: rank 0 \(rank0.json\): steps \[0\]"
    ):
        merge_trace_files([*paths[:2], other / "rank2.json"])
    # A real-clock file without its clock origin, one without message identities.
    for key, msg in (("clock_origin", "has no clock_origin"), ("args", "identity")):
        tr = json.loads(paths[2].read_text())
        if key == "clock_origin":
            del tr["otherData"]["rrfp"]["clock_origin"]
        else:
            for e in tr["traceEvents"]:
                e.pop("args") if e["ph"] in ("s", "f") else None
        (other / "rank2.json").write_text(json.dumps(tr))
        with pytest.raises(rr.errors.TraceError, match=msg):
            merge_trace_files([*paths[:2], other / "rank2.json"])


def test_a_failed_steps_lost_messages_are_dropped_and_reported(tmp_path: Path) -> None:
    whole = _whole()
    lost = next(a for a in whole.arrivals if a.lane == 2)
    whole.arrivals.remove(lost)
    merged = merge_trace_files(_write_parts(whole, tmp_path))
    assert merged.dropped == (
        f"step 0: -> {lost.task} from rank 1 to rank 2 (sent, never received)",
    )
    tr = merged.chrome_trace()
    assert validate_chrome_trace(tr) == [] and len(_flows(tr)) == 2 * 2 * 4 - 1


def test_trace_files_takes_files_globs_and_directories(tmp_path: Path) -> None:
    d = tmp_path / "t"
    d.mkdir()
    for r in (10, 2, 0, 1):
        (d / f"rank{r}.json").write_text("{}")
    (d / "notes.json").write_text("{}")
    names = [p.name for p in trace_files([d])]
    assert names == ["rank0.json", "rank1.json", "rank2.json", "rank10.json"]
    assert [p.name for p in trace_files([str(d / "rank1*.json")])] == ["rank1.json", "rank10.json"]
    assert [p.name for p in trace_files([d / "rank2.json", d, d / "notes.json"])] == [
        "rank2.json",
        "rank0.json",
        "rank1.json",
        "rank10.json",
        "notes.json",
    ]
    (tmp_path / "runs" / "strict").mkdir(parents=True)
    (tmp_path / "runs" / "strict" / "rank0.json").write_text("{}")
    with pytest.raises(rr.errors.TraceError, match="subdirectories strict/ hold some"):
        trace_files([tmp_path / "runs"])
    with pytest.raises(rr.errors.TraceError, match="no trace file matches"):
        trace_files([str(tmp_path / "nope*.json")])
    with pytest.raises(rr.errors.TraceError, match="no such trace file"):
        trace_files([tmp_path / "nope.json"])


def test_trace_command_merges_and_writes_the_result(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path / "t")
    out = tmp_path / "merged.json"
    png = tmp_path / "merged.png"
    for args in (
        [str(tmp_path / "t")],
        [str(tmp_path / "t" / "rank*.json")],
        [str(p) for p in paths],
    ):
        res = CliRunner().invoke(main, ["trace", *args, "-o", str(out), "--png", str(png)])
        assert res.exit_code == 0, res.output
        assert "merged 3 files (ranks 0, 1, 2)" in res.output
        assert "one host (a)" in res.output and f"wrote {out}" in res.output
        assert validate_chrome_trace(rr.observability.load_trace(out)) == []
    res = CliRunner().invoke(main, ["trace", str(tmp_path / "t"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["files"] == [str(p) for p in paths]
    assert sorted(rep["summary"]["ranks"]) == ["0", "1", "2"]
    assert rep["merged"]["alignment"].startswith("one host") and rep["merged"]["dropped"] == []
    # The merged file is a whole trace: the command reads it back like any other.
    res = CliRunner().invoke(main, ["trace", str(out)])
    assert res.exit_code == 0 and "makespan" in res.output
    # A rank's file missing: named, the rest shown, exit code 3 (tests/test_trace_evidence.py).
    res = CliRunner().invoke(main, ["trace", str(paths[0]), str(paths[1])])
    assert res.exit_code == 3 and "trace file of rank 2 is missing" in res.output


def test_trace_command_prints_a_written_path_whole_at_any_width(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A narrow console (COLUMNS=40, as under a pytest-xdist worker's 80 with a long tmp
    # path) once folded the path onto two lines, and rich markup ate a "[...]" in it.
    monkeypatch.setenv("COLUMNS", "40")
    paths = _write_parts(_whole(), tmp_path / "t")
    out = tmp_path / "a[b]" / ("long-name-" * 6 + "merged.json")
    out.parent.mkdir()
    res = CliRunner().invoke(main, ["trace", str(paths[0].parent), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert f"wrote {out}\n" in res.output
