"""The rrfp-async command line."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from rrfp_async._errors import PlanError
from rrfp_async.cli._main import main
from rrfp_async.cli._output import CleanErrorsGroup


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


def test_bench_simulator_scaling_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from rrfp_async.bench import _local

    small = functools.partial(_local.simulator_scaling, sizes=((2, 4), (4, 8)))
    monkeypatch.setattr(_local, "simulator_scaling", small)
    args = ["bench", "simulator", "-p", "2", "-m", "4", "--repeats", "1", "--no-policies-table"]
    res = CliRunner().invoke(main, [*args, "--scaling-repeats", "1"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "simulator scaling" in res.output
    rows = re.findall(r"(\d+) x (\d+) +│ +(\d+) +│.*│ +([0-9.]+)x", res.output)
    assert [(r[0], r[1], r[2]) for r in rows] == [("2", "4", "16"), ("4", "8", "64")]
    assert rows[0][3] == "1.00"
    res = CliRunner().invoke(main, [*args, "--no-scaling"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "simulator scaling" not in res.output


def test_bench_peer_simulated_and_bad_input() -> None:
    args = ["bench", "peer", "--simulated", "-p", "2", "-m", "4", "--steps", "2"]
    res = CliRunner().invoke(main, [*args, "--us-per-token", "2", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["simulated"]
    assert {r["us_per_token"] for r in rows} == {2.0}
    assert any(r["configuration"] == "1f1b strict 1x" and r["vs_strict_1f1b"] == 1.0 for r in rows)
    bad = CliRunner().invoke(main, ["bench", "peer", "--torch-schedule", "ScheduleNope"])
    assert bad.exit_code != 0 and "unknown torch schedule" in bad.output


def test_every_command_is_on_the_group() -> None:
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0, res.output
    for cmd in ("simulate", "trace", "demo", "bench"):
        assert f"\n  {cmd} " in res.output, cmd
    res = CliRunner().invoke(main, ["bench", "--help"])
    for cmd in ("simulator", "pipeline", "peer", "bridges", "logging", "overhead", "paper"):
        assert f"\n  {cmd} " in res.output, cmd


def test_the_group_reports_package_and_os_errors_cleanly_and_nothing_else() -> None:
    errors: dict[str, Exception] = {
        "rrfp": PlanError("rank 0 step 1: bad plan"),
        "os": FileNotFoundError("no f"),
        "bug": RuntimeError("a bug"),
    }
    group = CleanErrorsGroup("g")

    @group.command("boom")
    @click.argument("what")
    def boom(what: str) -> None:
        raise errors[what]

    res = CliRunner().invoke(group, ["boom", "rrfp"])
    assert (res.exit_code, res.output) == (1, "Error: rank 0 step 1: bad plan\n")
    res = CliRunner().invoke(group, ["boom", "os"])
    assert (res.exit_code, res.output) == (1, "Error: no f\n")
    res = CliRunner().invoke(group, ["boom", "bug"])
    assert isinstance(res.exception, RuntimeError)  # a bug keeps its traceback


def test_an_unwritable_output_is_a_clean_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["simulate", "-p", "2", "-m", "2", "--trace", str(blocker / "t.json")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and res.output.startswith("Error: "), res.output


def test_the_command_line_loads_no_benchmark_until_one_runs() -> None:
    code = (
        "import sys, rrfp_async.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('rrfp_async.bench')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(120)
def test_bench_soak_reports_flat_and_refuses_bad_policy() -> None:
    out = CliRunner().invoke(main, ["bench", "soak", "--steps", "20", "--fail-every", "5"])
    assert out.exit_code == 0, out.output
    assert "verdict: flat" in out.output and "live tasks [1]" in out.output
    bad = CliRunner().invoke(main, ["bench", "soak", "--steps", "5", "--policy", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output


@pytest.mark.parametrize(
    ("args", "code", "msg"),
    [
        (["--memory-factor", "inf"], 1, "memory_factor must be finite"),
        (["--memory-factor", "nan"], 1, "memory_factor must be a number"),
        (["--jitter", "50"], 1, "jitter must be a finite number in [0, 3.0]"),
        (["-p", "1000000", "-m", "1000000"], 1, "exceeds the limit"),
        (["--hint", "nope"], 1, "unknown hint 'nope'"),
        (["--policy", "nope"], 2, "unknown policy 'nope'"),
        (["--trace", "/proc/none/t.json"], 1, "No such file or directory"),
        (["--png", "/proc/none/t.png"], 1, "No such file or directory"),
    ],
)
def test_simulate_bad_input_is_an_error_line_not_a_traceback(
    args: list[str], code: int, msg: str
) -> None:
    out = CliRunner().invoke(main, ["simulate", "-p", "2", "-m", "4", *args])
    assert out.exit_code == code, out.output
    assert "Error:" in out.output and msg in out.output, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
