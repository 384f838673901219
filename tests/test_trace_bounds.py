"""Trace files and the CLI, hardened: every finiteness and range rule of ``load_trace``,
nesting and size bounds, bounded PNGs, and JSON errors on stdout with ``--json``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import rrfp_async as rr
from rrfp_async.cli import main
from rrfp_async.observability import TraceData
from rrfp_async.observability._trace_data import Span


@pytest.fixture(scope="module")
def good() -> dict[str, Any]:
    return rr.simulate(stages=2, microbatches=2, policy="strict", record=True).chrome_trace()


def _with(good: dict[str, Any], ph: str, *, last: bool = False, **change: Any) -> str:
    """The trace with one event of phase ``ph`` changed: the first (the first span of rank 0,
    so that an earlier start overlaps nothing) or the ``last`` (the last span of the last
    rank, so that a longer one overlaps nothing): only the rule under test is broken."""
    evs = list(good["traceEvents"])
    at = [i for i, e in enumerate(evs) if e.get("ph") == ph][-1 if last else 0]
    evs[at] = {**evs[at], **change}
    return json.dumps({**good, "traceEvents": evs})


def _cases(good: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        "dur Infinity": (
            _with(good, "X", last=True, dur=1.5).replace('"dur": 1.5', '"dur": Infinity'),
            "Infinity is not a number",
        ),
        "ts -Infinity": (
            _with(good, "X", ts=0.5).replace('"ts": 0.5', '"ts": -Infinity'),
            "Infinity is not a number",
        ),
        "negative ts": (_with(good, "X", ts=-5.0), "ts -5.0 is not a finite number >= 0"),
        "negative ts of a decision": (_with(good, "i", ts=-1), "ts -1 is not a finite"),
        "negative ts of a flow": (_with(good, "f", ts=-1.5), "ts -1.5 is not a finite"),
        "bool ts": (_with(good, "X", ts=False), "ts False is not a finite"),
        "dur overflows ts": (
            _with(good, "X", last=True, ts=1e308, dur=1e308),
            "ts \\+ dur overflows",
        ),
        "negative pid": (_with(good, "X", pid=-1), "pid -1 is not an integer >= 0"),
        "deep nesting": ("[" * 100_000 + "]" * 100_000, "nests JSON arrays/objects"),
        "nesting beyond the bound": (
            json.dumps({**good, "otherData": {"rrfp": {"x": json.loads("[" * 40 + "]" * 40)}}}),
            "deeper than 32 levels",
        ),
    }


def test_load_trace_enforces_every_documented_rule(tmp_path: Path, good: dict[str, Any]) -> None:
    """Before: Infinity durations and negative times were accepted, deep nesting was a
    RecursionError traceback."""
    for name, (text, msg) in _cases(good).items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_text(text)
        with pytest.raises(rr.errors.TraceError, match=msg):
            rr.observability.load_trace(f)


def test_load_trace_size_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rrfp_async.observability import _chrome

    f = tmp_path / "big.json"
    f.write_text(json.dumps({"traceEvents": [{"ph": "M"}] * 50}))
    monkeypatch.setattr(_chrome, "MAX_TRACE_BYTES", 100)
    with pytest.raises(rr.errors.TraceError, match="MAX_TRACE_BYTES"):
        rr.observability.load_trace(f)
    monkeypatch.setattr(_chrome, "MAX_TRACE_BYTES", 1 << 30)
    monkeypatch.setattr(_chrome, "MAX_TRACE_EVENTS", 10)
    with pytest.raises(rr.errors.TraceError, match="MAX_TRACE_EVENTS"):
        rr.observability.load_trace(f)


def test_trace_json_errors_are_json_on_stdout(tmp_path: Path, good: dict[str, Any]) -> None:
    """Before: with --json an error left stdout empty (and Infinity printed invalid JSON)."""
    runner = CliRunner()
    for name, (text, _msg) in _cases(good).items():
        f = tmp_path / f"{name.replace(' ', '_')}.json"
        f.write_text(text)
        res = runner.invoke(main, ["trace", str(f), "--json"])
        assert res.exit_code == 1, (name, res.output)
        err = json.loads(res.stdout)["error"]
        assert err["type"] == "TraceError" and f.name in err["message"]
    cases = [
        (["trace", str(tmp_path / "missing.json"), "--json"], 2, "BadParameter"),
        (["simulate", "-p", "2", "-m", "4", "--policy", "nope", "--json"], 2, "BadParameter"),
        (["simulate", "-p", "2", "-m", "4", "--json", "--memory-factor", "1e308"], 1, "HintError"),
        (["simulate", "-p", "2", "-m", "4", "--json", "--latency", "1e308"], 1, "PlanError"),
    ]
    for args, code, typ in cases:
        res = runner.invoke(main, args)
        assert res.exit_code == code, (args, res.output)
        assert json.loads(res.stdout)["error"]["type"] == typ, args
        assert "Traceback" not in res.output


def test_png_with_an_unknown_extension_is_a_clear_error(
    tmp_path: Path, good: dict[str, Any]
) -> None:
    """Before: a matplotlib traceback."""
    f = rr.observability.write_trace(tmp_path / "t.json", good)
    res = CliRunner().invoke(main, ["trace", str(f), "--png", str(tmp_path / "out.xyz")])
    assert res.exit_code == 1 and "Error: cannot write an image" in res.output
    assert ".xyz is no image format" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["trace", str(f), "--json", "--png", str(tmp_path / "o.xyz")])
    assert json.loads(res.stdout)["error"]["type"] == "PlanError"
    with pytest.raises(rr.PlanError, match="no image format"):
        rr.observability.render_png([("t", good)], tmp_path / "noext")


def test_png_of_many_lanes_is_bounded(tmp_path: Path) -> None:
    """Before: one row (0.45 inch) per rank and one draw call per bar: a trace of thousands
    of ranks ran for minutes and gigabytes."""
    import matplotlib.image

    data = TraceData()
    lanes = 400
    for lane in range(lanes):
        for mb in range(3):
            data.spans.append(Span(lane, 0, f"{lane}F{mb}", mb * 1e-3, mb * 1e-3 + 5e-4))
    trace = rr.observability.chrome_trace(data)
    t = time.perf_counter()
    out = rr.observability.render_png([("many", trace)], tmp_path / "many.png")
    assert time.perf_counter() - t < 60
    height = matplotlib.image.imread(out).shape[0]
    assert height < 110 * (2 + 0.45 * 64 + 1)  # at most MAX_PNG_LANES rows
