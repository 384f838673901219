"""The rrfp-async command line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rrfp_async._cli import main


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
            "greedy",
            "--memory-factor",
            "2",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert set(out["results"]) == {"strict", "greedy"}
    assert out["speedup"]["strict"] == 1.0
    assert out["config"]["time"].startswith("virtual")


def test_simulate_errors_are_clean() -> None:
    res = CliRunner().invoke(main, ["simulate", "-p", "2", "-m", "2", "-v", "2", "--hint", "1f1b"])
    assert res.exit_code != 0
    assert "needs one chunk per rank" in res.output
    res = CliRunner().invoke(main, ["simulate", "-p", "2", "-m", "2", "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy" in res.output
