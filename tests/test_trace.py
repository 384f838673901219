"""Traces: Chrome / Perfetto JSON of simulated steps, summaries, PNG timelines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import rrfp_async as rr
from rrfp_async.observability import (
    Arrival,
    Decision,
    Ready,
    Send,
    Span,
    StepRecord,
    TraceData,
    load_trace,
    render_png,
    summarize,
    validate_chrome_trace,
    write_trace,
)
from rrfp_async.observability._trace_data import from_chrome


def _check_trace_matches(res: rr.sim.SimResult) -> dict:
    tr = res.chrome_trace()
    assert validate_chrome_trace(tr) == []
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    executed = [e for ex in res.executed for e in ex]
    # Exactly one compute span per executed task...
    assert sorted(e["name"] for e in spans) == sorted(str(e.task) for e in executed)
    assert len({(e["pid"], e["name"]) for e in spans}) == len(spans)
    # ... on its rank's lane, in the executed order, with the executed times.
    for rank, ex in enumerate(res.executed):
        lane = sorted((e for e in spans if e["pid"] == rank), key=lambda e: e["ts"])
        assert [e["name"] for e in lane] == [str(x.task) for x in ex]
        for e, x in zip(lane, ex, strict=True):
            assert e["cat"] == x.task.kind
            assert e["ts"] == pytest.approx((x.start) * 1e6, abs=0.01)
            assert e["dur"] == pytest.approx((x.end - x.start) * 1e6, abs=0.01)
    return tr


def test_simulated_trace_schema_and_spans() -> None:
    res = rr.simulate(
        stages=4,
        microbatches=8,
        workload="multimodal",
        jitter=0.3,
        memory_factor=2.0,
        policy="readiness_first",
        record=True,
    )
    tr = _check_trace_matches(res)
    meta = tr["otherData"]["rrfp"]
    assert meta["clock"] == "virtual" and meta["policy"] == "readiness_first"
    flows = [e for e in tr["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * 3 * 8 * 2  # 3 cross-rank edges x 8 mbs x (F, B), both ends
    decisions = [e for e in tr["traceEvents"] if e["ph"] == "i"]
    assert len(decisions) == 4 * 16
    assert sum(e["args"]["deviation"] for e in decisions) == sum(res.deviations)


def test_split_backward_and_chunks_trace() -> None:
    res = rr.simulate(
        stages=2, chunks=2, microbatches=4, hint="interleaved", split_backward=True, record=True
    )
    tr = _check_trace_matches(res)
    assert {e["cat"] for e in tr["traceEvents"] if e["ph"] == "X"} == {"F", "I", "W"}


def test_summary_matches_the_result() -> None:
    res = rr.simulate(stages=3, microbatches=6, workload="text", jitter=0.2, record=True)
    assert res.trace is not None
    s = summarize(res.trace)
    assert s["makespan"] == pytest.approx(res.makespan)
    for r, st in enumerate(res.stats):
        assert s["ranks"][r]["busy"] == pytest.approx(st.busy)
        assert s["ranks"][r]["peak_inflight"] == st.peak_inflight
    # The same summary from the JSON form.
    s2 = summarize(res.chrome_trace())
    assert s2["makespan"] == pytest.approx(s["makespan"], rel=1e-6)
    assert s2["deviations"] == s["deviations"]


def test_validator_reports_problems() -> None:
    bad = {
        "traceEvents": [
            {"ph": "X", "name": "0F0", "cat": "F", "ts": 0, "dur": 10, "pid": 0, "tid": 0},
            {"ph": "X", "name": "0F1", "cat": "F", "ts": 5, "dur": 10, "pid": 0, "tid": 0},
            {"ph": "X", "name": "oops", "cat": "Z", "ts": 30, "dur": 1, "pid": 0, "tid": 0},
            {"ph": "s", "id": 1, "ts": 3, "pid": 0},
            {"ph": "Q"},
        ]
    }
    problems = validate_chrome_trace(bad)
    assert any("overlap" in p for p in problems)
    assert any("not a task kind" in p for p in problems)
    assert any("flow 1 has only" in p for p in problems)
    assert any("unknown phase" in p for p in problems)


def test_png_renders(tmp_path: Path) -> None:
    a = rr.simulate(
        stages=3, microbatches=6, workload="multimodal", jitter=0.3, record=True, policy="strict"
    )
    b = rr.simulate(
        stages=3,
        microbatches=6,
        workload="multimodal",
        jitter=0.3,
        record=True,
        policy="readiness_first",
        memory_factor=2.0,
    )
    assert a.trace is not None and b.trace is not None
    out = render_png(
        [("strict", a.trace), ("readiness_first", b.chrome_trace())],
        tmp_path / "t.png",
        title="simulated",
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_write_load_roundtrip(tmp_path: Path) -> None:
    res = rr.simulate(stages=2, microbatches=2, record=True)
    p = write_trace(tmp_path / "sub" / "t.json", res.chrome_trace())
    assert load_trace(p)["otherData"]["rrfp"]["hint"] == "breadth_first_weighted"
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a Trace Event Format"):
        load_trace(tmp_path / "x.json")


def test_trace_needs_record() -> None:
    with pytest.raises(ValueError, match="record=True"):
        rr.simulate(stages=2, microbatches=2).chrome_trace()


def test_tracedata_merge_and_filter() -> None:
    a = TraceData(spans=[Span(lane=0, step=0, task="0F0", start=0.0, end=1.0)])
    b = TraceData(spans=[Span(lane=1, step=1, task="1F0", start=1.0, end=2.0)])
    m = TraceData.merge([a, b])
    assert len(m.spans) == 2 and m.only_step(1).spans == [Span(1, 1, "1F0", 1.0, 2.0)]


def test_rows_are_named_and_come_back_from_json() -> None:
    res = rr.simulate(stages=2, microbatches=2, record=True)
    data = res.trace
    assert data is not None
    kinds = {
        "spans": Span,
        "sends": Send,
        "arrivals": Arrival,
        "ready": Ready,
        "decisions": Decision,
        "steps": StepRecord,
    }
    for name, kind in kinds.items():
        rows = getattr(data, name)
        assert rows and all(type(r) is kind for r in rows), name
    # The JSON form is plain lists; built back, the rows are the same named tuples.
    loaded = json.loads(json.dumps({n: getattr(data, n) for n in kinds}))
    assert loaded["spans"][0] == list(data.spans[0])
    back = TraceData(**loaded)
    assert back == data and all(type(r) is Decision for r in back.decisions)
    assert back.only_step(0).spans[0].task == data.spans[0].task
    # So are the step records of a Chrome trace written to disk and read back.
    tr = json.loads(json.dumps(res.chrome_trace()))
    again = from_chrome(tr)
    assert again.steps == data.steps and type(again.steps[0]) is StepRecord
    assert [s.task for s in again.spans] == [
        s.task for s in sorted(data.spans, key=lambda s: (s.lane, s.start))
    ]


def _bad_traces(good: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """name -> (file text, expected message) for each kind of broken trace file."""

    def xs(**change: Any) -> str:
        evs = [{**e, **change} if e.get("ph") == "X" else e for e in good["traceEvents"]]
        return json.dumps({**good, "traceEvents": evs})

    meta = good["otherData"]["rrfp"]
    return {
        "not json": ("xx{", "is not a JSON trace"),
        "no events": (json.dumps({"a": 1}), "no traceEvents list"),
        "events not objects": (json.dumps({"traceEvents": [1, 2]}), "must be a JSON object"),
        "nan duration": (xs(dur=float("nan")), "NaN is not a number a trace may hold"),
        "negative duration": (xs(dur=-1.0), "bad ts/dur"),
        "name not a task": (xs(name=5), "is not a task"),
        "pid not an int": (xs(pid=[1]), "is not an integer"),
        "otherData not an object": (json.dumps({**good, "otherData": 3}), "otherData.rrfp"),
        "step records not rows": (
            json.dumps({**good, "otherData": {"rrfp": {**meta, "steps": 5}}}),
            "not a valid trace",
        ),
    }


def test_load_trace_refuses_broken_files_with_a_trace_error(tmp_path: Path) -> None:
    good = rr.simulate(stages=2, microbatches=2, policy="strict", record=True).chrome_trace()
    ok = rr.observability.write_trace(tmp_path / "good.json", good)
    assert rr.observability.load_trace(ok)["traceEvents"]
    for name, (text, msg) in _bad_traces(good).items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_text(text)
        with pytest.raises(rr.errors.TraceError, match=msg) as ei:
            rr.observability.load_trace(f)
        assert f.name in str(ei.value), name


def test_trace_command_prints_broken_files_as_errors(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rrfp_async.cli import main

    good = rr.simulate(stages=2, microbatches=2, policy="strict", record=True).chrome_trace()
    for name, (text, msg) in _bad_traces(good).items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_text(text)
        out = CliRunner().invoke(main, ["trace", str(f)])
        assert out.exit_code == 1, (name, out.output)
        assert "Error:" in out.output and msg in out.output, (name, out.output)
        assert "Traceback" not in out.output and "makespan nan" not in out.output


def _legend_and_bars(*traces: tuple[str, Any]) -> tuple[list[str], list[Any], list[Any]]:
    """The figure ``render_png`` would save: legend texts, legend patches, bar collections."""
    import matplotlib.pyplot as plt

    from rrfp_async.observability._png import _timeline_figure

    fig = _timeline_figure(list(traces))
    try:
        (leg,) = fig.legends
        texts = [t.get_text() for t in leg.get_texts()]
        texts.insert(0, leg.get_title().get_text())
        bars = [c for ax in fig.axes for c in ax.collections]
        return texts, list(leg.legend_handles), bars
    finally:
        plt.close(fig)


def test_png_legend_lists_the_kinds_drawn_and_names_microbatches() -> None:
    res = rr.simulate(stages=2, microbatches=3, record=True)
    assert res.trace is not None
    texts, handles, bars = _legend_and_bars(("one chunk", res.trace))
    assert texts == ["numbers on the bars: microbatch", "F forward", "B backward"]  # no I, W
    assert all(h.get_hatch() is None for h in handles)
    assert {b.get_hatch() for b in bars} == {None}
    # Microbatch numbers are written on the bars.
    import matplotlib.pyplot as plt

    from rrfp_async.observability._png import _timeline_figure

    fig = _timeline_figure([("x", res.trace)])
    nums = sorted(t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)
    assert nums == sorted([str(mb) for mb in range(3)] * 2 * 2)  # F, B on 2 stages
    split = rr.simulate(stages=2, microbatches=2, split_backward=True, record=True)
    assert split.trace is not None
    texts, _, _ = _legend_and_bars(("split", split.trace))
    assert texts[1:] == ["F forward", "I input grad", "W weight grad"]


def test_png_tells_two_chunks_of_a_rank_apart() -> None:
    from matplotlib.colors import to_rgba

    from rrfp_async.observability._png import KIND_COLORS

    res = rr.simulate(stages=2, chunks=2, microbatches=4, hint="interleaved", record=True)
    assert res.trace is not None
    texts, handles, bars = _legend_and_bars(("two chunks", res.trace))
    assert texts[1:] == ["F chunk 0", "F chunk 1", "B chunk 0", "B chunk 1"]
    by_label = dict(zip(texts[1:], handles, strict=True))
    assert by_label["F chunk 0"].get_hatch() is None
    assert by_label["F chunk 1"].get_hatch() == "//"
    f0, f1 = (tuple(by_label[f"F chunk {c}"].get_facecolor()) for c in (0, 1))
    assert f0 == to_rgba(KIND_COLORS["F"]) and f1 != f0
    assert sum(f1[:3]) > sum(f0[:3])  # lighter
    # Every rank draws its second chunk (stage r + 2) hatched and lighter, in the legend's
    # style: one collection per rank x kind x chunk.
    styles = {(b.get_hatch(), tuple(b.get_facecolor()[0])) for b in bars}
    assert styles == {(h.get_hatch(), tuple(h.get_facecolor())) for h in handles}
    assert len(bars) == 2 * 2 * 2


def test_a_failed_write_keeps_the_previous_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the trace: the write raises, the previous file is kept whole and no
    temporary file is left (before: a torn file that is not JSON replaced the good one)."""
    import errno

    path = tmp_path / "t.json"
    good = rr.simulate(stages=2, microbatches=2, record=True).chrome_trace()
    rr.observability.write_trace(path, good)
    before = path.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the module the trace writer syncs with
    with pytest.raises(OSError, match="No space left"):
        rr.observability.write_trace(
            path, rr.simulate(stages=2, microbatches=4, record=True).chrome_trace()
        )
    assert path.read_bytes() == before and rr.observability.load_trace(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_a_trace_is_read_from_a_pipe(tmp_path: Path) -> None:
    """``rrfp-async trace <(cmd)`` / ``/dev/fd/N``: a pipe has no size to stat (refused
    before as no such file)."""
    import json
    import os
    import threading

    from click.testing import CliRunner

    from rrfp_async.cli import main

    text = json.dumps(rr.simulate(stages=2, microbatches=2, record=True).chrome_trace())
    for reader in ("load", "cli"):
        r, w = os.pipe()

        def feed(w: int = w) -> None:
            with os.fdopen(w, "w") as f:
                f.write(text)

        t = threading.Thread(target=feed)
        t.start()
        try:
            if reader == "load":
                tr = rr.observability.load_trace(f"/dev/fd/{r}")
                assert tr["traceEvents"]
            else:
                res = CliRunner().invoke(main, ["trace", f"/dev/fd/{r}"])
                assert res.exit_code == 0, res.output
                assert "bubble" in res.output
        finally:
            t.join(10)
            os.close(r)
