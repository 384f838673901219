"""The evidence a job that died leaves (issue 41): a failed step's trace marked failed (its
error, its unfinished tasks), and ``rrfp-async trace`` / ``merge_trace_files(partial=True)``
on what is there: missing ranks named, files cut short read up to the cut, the rest shown,
exit code 3, never a traceback (constructed traces: each rank's part of a simulated step;
the multi-process case is ``tests/distributed/test_trace_dir.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import rrfp_async as rr
from rrfp_async.cli import main
from rrfp_async.cli._cmd_trace import PARTIAL_EXIT_CODE
from rrfp_async.observability import (
    Failure,
    Span,
    TraceData,
    TraceRecorder,
    chrome_trace,
    load_trace,
    merge_trace_files,
    newest_trace_files,
    summarize,
    validate_chrome_trace,
    write_trace,
)
from rrfp_async.observability._torn import read_torn
from rrfp_async.observability._trace_data import from_chrome
from tests.test_trace_merge import HOST_A, _part, _whole, _write_parts

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace command's lines name long paths: off a terminal the console is $COLUMNS
    wide, and this wide it wraps none of them (the checks read whole lines)."""
    monkeypatch.setenv("COLUMNS", "1000")


def _failed_part(data: TraceData, lane: int, step: int = 0) -> TraceData:
    """Rank ``lane``'s part of ``data``, failed after its second task with its third
    running (what ``StageTrace`` writes for a failed step)."""
    part = _part(data, lane)
    spans = sorted(part.spans, key=lambda s: s.start)
    done, running = spans[:2], spans[2]
    t_fail = running.start + 0.5 * (running.end - running.start)
    out = TraceData(
        done,
        [s for s in part.sends if s.time <= t_fail],
        [a for a in part.arrivals if a.time <= t_fail],
        [r for r in part.ready if r.time <= t_fail],
        [d for d in part.decisions if d.time <= t_fail],
    )
    out.failures.append(
        Failure(lane, step, t_fail, "PeerError", "lost rank 1", {running.task: running.start})
    )
    return out


def _cut(path: Path, at: int) -> bytes:
    """Cut ``path`` short at byte ``at`` (a copy that stopped); returns the old bytes."""
    raw = path.read_bytes()
    path.write_bytes(raw[:at])
    return raw


# ---------------------------------------------------------------- a failed step's file


def test_a_failed_steps_trace_is_marked_failed_and_reads_back(tmp_path: Path) -> None:
    part = _failed_part(_whole(), 0)
    (fail,) = part.failures
    (task,) = fail.running
    tr = chrome_trace(part, origin=HOST_A, pipeline=[2, 0, 1, 0])
    meta = tr["otherData"]["rrfp"]
    assert meta["pipeline"] == [0, 1, 2]
    row = meta["failures"][0]
    assert row[:2] == [0, 0] and row[3:5] == ["PeerError", "lost rank 1"]
    # The unfinished task is drawn up to the failure; the failure is a mark on its lane.
    (unfinished,) = [e for e in tr["traceEvents"] if e["args"].get("unfinished")]
    assert unfinished["name"] == task and unfinished["pid"] == 0
    assert unfinished["ts"] + unfinished["dur"] == pytest.approx((fail.time - meta["t0"]) * 1e6)
    (mark,) = [e for e in tr["traceEvents"] if e["name"] == "step failed"]
    assert mark["args"] == {"step": 0, "error": "PeerError", "message": "lost rank 1"}
    # A rank's part: only its messages' other halves (in the other ranks' files) are missing.
    assert all(p.startswith("flow ") for p in validate_chrome_trace(tr))
    # Read back: the failure row (times from t0), the unfinished task not a span.
    back = from_chrome(json.loads(json.dumps(tr)))
    assert [s.task for s in back.spans] == [s.task for s in part.spans]
    (again,) = back.failures
    assert again.error == "PeerError" and list(again.running) == [task]
    assert again.time == pytest.approx(fail.time - meta["t0"])
    assert summarize(tr)["ranks"][0]["tasks"] == 2
    # Broken failure rows are refused by name.
    f = tmp_path / "bad.json"
    for rows in ([[0, 0, "x", "E", "m", {}]], [[0, 0, 1.0, "E", "m", {"zz": 1.0}]], 5):
        bad = json.loads(json.dumps(chrome_trace(TraceData([Span(0, 0, "0F0", 0.0, 1.0)]))))
        bad["otherData"]["rrfp"]["failures"] = rows
        f.write_text(json.dumps(bad))
        with pytest.raises(rr.errors.TraceError, match=r"otherData\.rrfp\.failures"):
            load_trace(f)


class _Stage:
    """What a recorder reads of a stage (``rank``, ``step``, ``now()``)."""

    rank = 0
    step = 4
    t = 10.0
    schedule = rr.StepSchedule.build(
        rr.StepPlan(topology=rr.Topology(stages=1), microbatches=2), "1f1b"
    )

    def now(self) -> float:
        return self.t


def test_the_recorder_names_the_tasks_running_when_the_step_failed() -> None:
    rec = TraceRecorder({0: 7})
    st: Any = _Stage()
    rec.step_start(st)
    rec.task_start(st, rr.Task.parse("0F0"))
    st.t = 12.0
    rec.task_start(st, rr.Task.parse("0F1"))
    rec.task_end(st, rr.Task.parse("0F0"), 10.0, 12.0)
    row = rec.failure(7, 4, 13.5, RuntimeError("boom\nwith a dump " + "x" * 5000))
    assert row == rec.data.failures[0]
    assert row.lane == 7 and row.step == 4 and row.time == 13.5 and row.error == "RuntimeError"
    assert row.running == {"0F1": 12.0}
    assert row.message.startswith("boom\nwith a dump") and "more characters" in row.message
    assert rec.failure(7, 4, 14.0, RuntimeError("again")).running == {}  # taken once


# ---------------------------------------------------------------- files cut short


def test_read_torn_keeps_every_whole_event_before_any_cut(tmp_path: Path) -> None:
    tr = chrome_trace(_whole(), clock="virtual")
    text = write_trace(tmp_path / "t.json", tr).read_text()
    events = json.loads(text)["traceEvents"]
    assert text.startswith('{"otherData"') and text.count("\n") >= len(events)
    header_end = text.index('"traceEvents"')
    for at in range(1, len(text) - 3, 97):
        got = read_torn(text[:at])
        assert got is not None, at
        assert got.trace.get("traceEvents", []) == events[: got.events], at
        assert got.header == (at > header_end), at
        assert got.at <= at
    assert read_torn(text) is None  # whole
    bad = text.replace('"ph": "X"', '"ph": X', 1)  # a bad byte in the middle, not a cut
    assert read_torn(bad[: len(bad) // 2]) is None
    assert read_torn("xx{") is None


def test_a_torn_file_is_read_up_to_the_tear_with_a_warning(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path / "t")
    text = paths[1].read_text()
    n = len(json.loads(text)["traceEvents"])
    lines = text.split("\n")
    at = len("\n".join(lines[: len(lines) // 2])) + 20  # inside an event's line
    _cut(paths[1], at)
    # Whole reads refuse it, as before.
    with pytest.raises(rr.errors.TraceError, match="is not a JSON trace"):
        merge_trace_files(paths)
    with pytest.raises(rr.errors.TraceError, match="is not a JSON trace"):
        load_trace(paths[1])
    merged = merge_trace_files(paths, partial=True)
    assert not merged.complete and merged.missing == ()
    (note,) = merged.torn
    assert note.startswith(f"{paths[1]}: cut short after {at} bytes: read up to the cut (")
    kept = int(note.split("(")[1].split()[0])
    assert 0 < kept < n
    assert sorted(merged.ranks) == [0, 1, 2]
    assert merged.dropped  # the halves whose other end was after the cut
    assert validate_chrome_trace(merged.chrome_trace()) == []
    for args in ([str(tmp_path / "t")], [str(paths[1])]):
        res = CliRunner().invoke(main, ["trace", *args])
        assert res.exit_code == PARTIAL_EXIT_CODE == 3, res.output
        assert "Traceback" not in res.output
        assert "torn:" in res.output and "rank1.json" in res.output and "makespan" in res.output
    res = CliRunner().invoke(main, ["trace", str(tmp_path / "t"), "--json"])
    assert res.exit_code == 3
    rep = json.loads(res.stdout)  # warnings go to stderr: stdout stays JSON
    assert rep["complete"] is False and len(rep["merged"]["torn"]) == 1
    assert sorted(rep["summary"]["ranks"]) == ["0", "1", "2"]


def test_a_file_cut_in_its_header_is_left_out_and_its_rank_named(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path / "t")
    _cut(paths[2], 40)
    merged = merge_trace_files(paths, partial=True)
    assert sorted(merged.ranks) == [0, 1]
    assert merged.torn == (
        f"{paths[2]}: cut short after 40 bytes, inside its header (otherData): left out",
    )
    res = CliRunner().invoke(main, ["trace", str(tmp_path / "t")])
    assert res.exit_code == 3 and "inside its header" in res.output, res.output
    _cut(paths[2], 0)  # empty
    assert "inside its header" in merge_trace_files(paths, partial=True).torn[0]
    for p in paths:
        _cut(p, 0)
    res = CliRunner().invoke(main, ["trace", str(tmp_path / "t")])
    assert res.exit_code == 1 and "no trace file could be read" in res.output, res.output
    assert "Traceback" not in res.output


# ---------------------------------------------------------------- ranks missing


def test_a_missing_rank_is_named_and_the_rest_shown(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path / "t")
    paths[2].unlink()
    with pytest.raises(rr.errors.TraceError, match="trace file of rank 2 is missing"):
        merge_trace_files(paths[:2])  # strict, as before
    merged = merge_trace_files(paths[:2], partial=True)
    assert merged.missing == (2,) and sorted(merged.ranks) == [0, 1]
    assert any("rank 2's file is missing" in d for d in merged.dropped)
    assert merged.chrome_trace()["otherData"]["rrfp"]["merged"]["missing"] == [2]
    for args, named in (
        ([str(tmp_path / "t")], 2),
        ([str(p) for p in paths[:2]], 2),
        ([str(paths[0])], 1),  # one rank's file alone: the rank it talked to
    ):
        res = CliRunner().invoke(main, ["trace", *args])
        assert res.exit_code == 3, res.output
        assert f"trace file of rank {named} is missing" in res.output, res.output
        assert "Traceback" not in res.output and "bubble ratio" in res.output


def test_the_pipeline_names_a_rank_no_message_names(tmp_path: Path) -> None:
    """A rank that never exchanged a message of the step (it died before) is still named:
    each file lists its pipeline's ranks."""
    d = tmp_path / "t"
    for lane in (0, 1):
        part = _failed_part(_whole(), lane)
        part.sends.clear()
        part.arrivals.clear()
        tr = chrome_trace(part, origin=HOST_A, policy="p", pipeline=[0, 1, 2])
        write_trace(d / f"failed-rank{lane}.json", tr)
    merged = merge_trace_files([d / "failed-rank0.json", d / "failed-rank1.json"], partial=True)
    assert merged.missing == (2,) and merged.pipeline == (0, 1, 2)
    assert [f.lane for f in merged.data.failures] == [0, 1]
    res = CliRunner().invoke(main, ["trace", str(d)])
    assert res.exit_code == 3 and "trace file of rank 2 is missing" in res.output, res.output
    assert "rank 0: step 0 FAILED" in res.output and "running then:" in res.output


# ---------------------------------------------------------------- a directory's newest step


def _step_files(d: Path, step: int, *, failed: bool, lanes: tuple[int, ...] = (0, 1)) -> None:
    for lane in lanes:
        data = TraceData([Span(lane, step, f"{lane}F0", 1.0, 2.0)])
        if failed:
            data.failures.append(Failure(lane, step, 2.5, "PeerError", "x", {}))
        name = f"{'failed-' if failed else ''}rank{lane}.json"
        write_trace(d / name, chrome_trace(data, origin=HOST_A, policy="p"))


def test_a_directory_shows_its_newest_step(tmp_path: Path) -> None:
    died = tmp_path / "died"  # steps 0-2 ended well, step 3 failed: the job died
    died.mkdir()
    _step_files(died, 2, failed=False)
    _step_files(died, 3, failed=True)
    files, note = newest_trace_files(died)
    assert [p.name for p in files] == ["failed-rank0.json", "failed-rank1.json"]
    assert note.startswith("the failed step 3 (failed-rank*.json); the rank*.json beside")
    res = CliRunner().invoke(main, ["trace", str(died)])
    assert res.exit_code == 0, res.output  # every rank's file is there: complete
    assert "the failed step 3" in res.output and "rank 1: step 3 FAILED" in res.output
    went_on = tmp_path / "went_on"  # step 1 failed everywhere, steps 2-4 ended well
    went_on.mkdir()
    _step_files(went_on, 1, failed=True)
    _step_files(went_on, 4, failed=False)
    files, note = newest_trace_files(went_on)
    assert [p.name for p in files] == ["rank0.json", "rank1.json"]
    assert "hold step 1, which failed" in note
    only = tmp_path / "only"
    only.mkdir()
    _step_files(only, 0, failed=True)
    assert [p.name for p in newest_trace_files(only)[0]] == [
        "failed-rank0.json",
        "failed-rank1.json",
    ]
    assert newest_trace_files(only)[1] == ""
    with pytest.raises(rr.errors.TraceError, match="no per-rank trace files"):
        newest_trace_files(tmp_path)  # its subdirectories hold them, itself none


def test_a_partial_merge_stays_partial_when_read_back(tmp_path: Path) -> None:
    paths = _write_parts(_whole(), tmp_path / "t")
    out = tmp_path / "merged.json"
    res = CliRunner().invoke(main, ["trace", str(paths[0]), str(paths[1]), "-o", str(out)])
    assert res.exit_code == 3 and f"wrote {out}" in res.output, res.output
    assert load_trace(out)["otherData"]["rrfp"]["merged"]["missing"] == [2]
    res = CliRunner().invoke(main, ["trace", str(out)])
    assert res.exit_code == 3, res.output
    assert "this trace was merged without the trace file of rank 2" in res.output
    res = CliRunner().invoke(main, ["trace", str(out), "--json"])
    assert res.exit_code == 3 and json.loads(res.stdout)["complete"] is False
