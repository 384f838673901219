"""The rrfp-async command line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rrfp_async.cli._main import main


def test_simulate_prints_the_comparison() -> None:
    res = CliRunner().invoke(
        main, ["simulate", "--stages", "8", "--microbatches", "32", "--workload", "multimodal"]
    )
    assert res.exit_code == 0, res.output
    assert "strict" in res.output and "readiness_first" in res.output
    assert "makespan ratio" in res.output and "efficiency" in res.output


def test_simulate_json() -> None:
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "-p",
            "2",
            "-m",
            "4",
            "--json",
            "--policy",
            "strict",
            "--policy",
            "lateness_aware",
            "--memory-factor",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out["results"]) == {"strict", "lateness_aware"}
    assert out["speedup"]["strict"] == 1.0
    assert out["config"]["time"].startswith("virtual")


def test_simulate_errors_are_clean() -> None:
    res = CliRunner().invoke(main, ["simulate", "-p", "2", "-m", "2", "-v", "2", "--hint", "1f1b"])
    assert res.exit_code != 0
    assert "needs one chunk per rank" in res.output
    res = CliRunner().invoke(main, ["simulate", "-p", "2", "-m", "2", "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy" in res.output


def test_simulate_writes_traces_and_png_then_trace_summarises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tr = tmp_path / "t.json"
    png = tmp_path / "t.png"
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "-p",
            "3",
            "-m",
            "6",
            "--workload",
            "multimodal",
            "--jitter",
            "0.3",
            "--trace",
            str(tr),
            "--png",
            str(png),
        ],
    )
    assert res.exit_code == 0, res.output
    strict, rf = tmp_path / "t.strict.json", tmp_path / "t.readiness_first.json"
    assert strict.exists() and rf.exists() and png.exists()
    out_png = tmp_path / "again.png"
    res = CliRunner().invoke(main, ["trace", str(strict), "--png", str(out_png)])
    assert res.exit_code == 0, res.output
    assert "bubble ratio" in res.output and "simulated" in res.output and out_png.exists()
    res = CliRunner().invoke(main, ["trace", str(rf), "--json"])
    out = json.loads(res.output)
    assert out["meta"]["policy"] == "readiness_first" and len(out["summary"]["ranks"]) == 3


def test_trace_command_refuses_non_traces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = CliRunner().invoke(main, ["trace", str(bad)])
    assert res.exit_code != 0 and "not a Trace Event Format" in res.output


def test_log_options_on_every_command() -> None:
    res = CliRunner().invoke(
        main,
        [
            "--log-format",
            "json",
            "simulate",
            "-p",
            "2",
            "-m",
            "1",
            "--log-level",
            "debug",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    for cmd in (
        ["simulate"],
        ["trace"],
        ["demo"],
        ["bench", "pipeline"],
        ["bench", "simulator"],
        ["bench", "bridges"],
        ["bench", "logging"],
    ):
        res = CliRunner().invoke(main, [*cmd, "--help"])
        assert "--log-format" in res.output and "--log-level" in res.output, cmd


def test_bench_peer_simulated_and_bad_input() -> None:
    args = ["bench", "peer", "--simulated", "-p", "2", "-m", "4", "--steps", "2"]
    res = CliRunner().invoke(main, [*args, "--us-per-token", "2", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["simulated"]
    assert {r["us_per_token"] for r in rows} == {2.0}
    assert any(r["configuration"] == "1f1b strict 1x" and r["vs_strict_1f1b"] == 1.0 for r in rows)
    bad = CliRunner().invoke(main, ["bench", "peer", "--torch-schedule", "ScheduleNope"])
    assert bad.exit_code != 0 and "unknown torch schedule" in bad.output
