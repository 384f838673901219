"""The rrfp-async command line."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from typing import Any

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
    from rrfp_lab import _local_bench as _local

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


def test_bench_pipeline_prints_the_paired_speedup_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # The table the demo prints too (cli/_output.speedup_table), from fixed step times.
    from rrfp_async.observability._paired import paired_ratio
    from rrfp_lab import _local_bench as _local

    def fake(**kw: Any) -> dict[str, Any]:
        steps = {"strict": [0.2, 0.2, 0.2], "readiness_first": [0.1, 0.16, 0.25]}
        return {
            "wall_s": 1.0,
            "policies": {
                n: {
                    "median_s": sorted(t)[1],
                    "vs_first": paired_ratio(steps["strict"], t),
                    "deviations": 0,
                    "peak_inflight": 2,
                    "compute_s": 0.1,
                    "emulated_s": 0.2,
                }
                for n, t in steps.items()
            },
        }

    monkeypatch.setattr(_local, "pipeline_step_times", fake)
    res = CliRunner().invoke(
        main, ["bench", "pipeline", "-m", "8", "--steps", "3"], terminal_width=200
    )
    assert res.exit_code == 0, res.output
    rows = {
        m.group(1): m.groups()[1:]
        for m in re.finditer(
            r"│ (\w+) +│ +([0-9.]+) │ +([0-9.]+) │ +([0-9.]+)x │ *([0-9.–]*) │ (.*?) +│", res.output
        )
    }
    # step ms, samples/s (8 microbatches / median step), speedup median, min-max, verdict
    assert rows["strict"] == ("200.0", "40.0", "1.000", "", "baseline")
    assert rows["readiness_first"][:4] == ("160.0", "50.0", "1.250", "0.80–2.00")
    assert rows["readiness_first"][4].startswith("too few")  # 3 steps: no verdict claimed
    assert "the pairing removes" in res.output


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
    for cmd in (
        "simulator",
        "pipeline",
        "peer",
        "megatron",
        "bridges",
        "logging",
        "overhead",
        "paper",
    ):
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
    """The runtime's command line imports no lab module; its help lists the lab's commands
    (plug-ins: their click modules load) and loads no benchmark body, nor torch."""
    code = (
        "import sys, rrfp_async.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('rrfp_lab')))\n"
        "from click.testing import CliRunner\n"
        "out = CliRunner().invoke(rrfp_async.cli.main, ['--help']).output\n"
        "print(sorted(m for m in sys.modules if m.startswith('rrfp_lab.')"
        " and not m.startswith('rrfp_lab.cli')), 'torch' in sys.modules)\n"
        "print([c for c in ('bench', 'demo', 'simulate', 'trace') if f'  {c} ' in out])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "[]",
        "[] False",
        "['bench', 'demo', 'simulate', 'trace']",
    ], out.stdout


@pytest.mark.slow
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


def _fake_peer(seen: list[Any]) -> Any:
    """A stand-in for ``peer_benchmark``: reports each step as rank 0 would, returns rows."""
    from rrfp_lab._peer_config import PeerRun

    def run(cfg: Any, *, on_progress: Any = None) -> dict[str, Any]:
        seen.append(cfg)
        for s in range(cfg.warmup_steps + cfg.steps):
            if on_progress is not None:
                on_progress(s)

        def row(system: str, name: str, steps: tuple[float, ...], note: str = "") -> Any:
            torch_row = system == "torch"
            speedup = sorted(a / b for a, b in zip((0.1,) * len(steps), steps, strict=True))
            return PeerRun(
                system=system,
                schedule=name if torch_row else None,
                hint=None if torch_row else name,
                policy=None if torch_row else "readiness_first",
                memory_factor=None if torch_row else 2.0,
                step_s=sorted(steps)[len(steps) // 2],
                speedup_vs_torch_1f1b=speedup[len(speedup) // 2],
                efficiency=0.5,
                peak_inflight=2,
                steps_s=steps,
                note=note,
                # Measured bytes: torch's on padded inputs, its order on the real lengths.
                peak_bytes=5 << 20 if torch_row else 4 << 20,
                bytes_vs_torch_1f1b=1.0 if torch_row else 0.8,
                real_bytes=4 << 20 if torch_row else None,
                bytes_vs_torch_1f1b_real=1.0,
            ).to_dict()

        return {
            "config": cfg,
            "runs": [
                # Six paired steps: enough for the sign test to call 6 of 6 a difference.
                row("torch", "Schedule1F1B", (0.1,) * 6),
                row("torch", "Schedule1F1B", (0.2,) * 6, "padded cost"),
                row("rrfp_async", "breadth_first_weighted", (0.09, 0.11) * 3),
                row("drop-in", "breadth_first_weighted", (0.05, 0.06) * 3, "0.90x native"),
            ],
            "loss_max_diff": 0.0,
            "comm_share": 0.1,
        }

    return run


def test_bench_peer_shows_progress_on_stderr_and_takes_torch_short_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rrfp_lab._peer as peer

    seen: list[Any] = []
    monkeypatch.setattr(peer, "peer_benchmark", _fake_peer(seen))
    args = ["bench", "peer", "-p", "2", "--steps", "2", "--warmup", "1", "--us-per-token", "2"]
    res = CliRunner().invoke(
        main,
        [*args, "--torch-schedule", "1f1b", "--torch-schedule", "GPipe"],
        env={"COLUMNS": "80"},
    )
    assert res.exit_code == 0, res.output
    # torch's short names (any case) map to the schedule classes the benchmark runs.
    assert seen[0].torch_schedules == ("Schedule1F1B", "ScheduleGPipe")
    assert seen[0].padded_cost == ("Schedule1F1B",)
    # Not a terminal: one plain progress line per update, on stderr, in order.
    assert res.stderr.splitlines() == [
        f"[{n}/3] 2 µs/token: {what} ({t} s)"
        for n, what, t in zip(
            range(4),
            [
                "starting 2 processes",
                "step 1/3 done (warm-up)",
                "step 2/3 done (every configuration)",
                "step 3/3 done (every configuration)",
            ],
            [line.rsplit("(", 1)[1].split()[0] for line in res.stderr.splitlines()],
            strict=True,
        )
    ]
    # The table: on stdout, 80 columns, whole names, each ratio with its spread; the row
    # whose spread covers 1.0 says so.
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in res.stdout, res.stdout
    assert sum("readiness_first" in line for line in lines) == 2, res.stdout
    assert "0.91–1.11" in res.stdout and "1.67–2.00" in res.stdout, res.stdout
    assert res.stdout.count("within noise") == 1, res.stdout
    # The bytes columns: the peak (torch's on the real lengths too) and its ratio to 1F1B's.
    assert "5.00" in res.stdout and "(4.00)" in res.stdout, res.stdout
    assert "0.80x" in res.stdout and "(1.00x)" in res.stdout, res.stdout
    # --json: no progress at all, JSON on stdout.
    seen.clear()
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert len(json.loads(res.stdout)["runs"]) == 4


def test_bench_peer_refuses_an_unknown_schedule_listing_the_valid_ones() -> None:
    res = CliRunner().invoke(main, ["bench", "peer", "--torch-schedule", "PipelineScheduleSingle"])
    assert res.exit_code == 2, res.output
    assert "'--torch-schedule'" in res.output and "unknown torch schedule" in res.output
    for name in ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        assert name in res.output, name


def test_demo_refuses_a_policy_named_twice() -> None:
    # Its figures are per policy name: a duplicate would show two baselines (found by hand:
    # 1.003x "baseline" twice). Refused before any process starts.
    res = CliRunner().invoke(main, ["demo", "--policy", "strict", "--policy", "strict"])
    assert res.exit_code != 0
    assert "'strict' named twice" in res.output and "null test" in res.output, res.output
