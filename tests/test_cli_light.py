"""The command line starts at once: ``--help`` of every command imports no torch, and a plain
install (no matplotlib) keeps every table and file a command writes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

_HELP_PROBE = textwrap.dedent(
    """
    import json, sys
    import click
    from click.testing import CliRunner
    import rrfp_async
    from rrfp_async.cli import main

    def paths(cmd, prefix):
        yield prefix
        if isinstance(cmd, click.Group):  # (the lab's commands are plug-ins: asked for)
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                yield from paths(cmd.get_command(ctx, name), [*prefix, name])

    out = {}
    for p in paths(main, []):
        res = CliRunner().invoke(main, [*p, "--help"])
        out[" ".join(p) or "(group)"] = [res.exit_code, "torch" in sys.modules]
    print(json.dumps(out))
    """
)


def test_every_help_runs_without_importing_torch() -> None:
    """``import rrfp_async`` and every ``--help`` import no torch (torch costs 1.9 s quiet,
    11 s at load here): the package face and the CLI import a name's module on first use."""
    got = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr
    res = json.loads(got.stdout)
    assert {"(group)", "demo", "simulate", "trace", "bench", "bench peer"} <= set(res), res
    bad = {k: v for k, v in res.items() if v != [0, False]}
    assert not bad, f"exit code, torch imported: {bad}"


def test_import_rrfp_async_imports_no_torch() -> None:
    code = (
        "import sys, rrfp_async; rrfp_async.Task; rrfp_async.policies.HINTS;"
        " print('torch' in sys.modules)"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "False"


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a plain install: ``import matplotlib`` fails."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.mark.usefixtures("no_matplotlib")
def test_simulate_png_without_matplotlib_fails_before_writing(tmp_path: Path) -> None:
    from rrfp_async.cli._main import main

    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "-p",
            "2",
            "-m",
            "4",
            "--policy",
            "strict",
            "--trace",
            str(trace),
            "--png",
            str(png),
        ],
    )
    # --png asks for a file the command cannot write: exit 1 before anything is written (a
    # note and exit 0 is what a script takes for success), naming the option and the fix.
    assert res.exit_code == 1, res.output
    assert "--png needs matplotlib" in res.output
    assert "pip install 'rrfp-async[plot]'" in res.output
    assert "nothing was written" in res.output and "wrote" not in res.output
    assert not trace.exists() and not png.exists()
    assert "Traceback" not in res.output


@pytest.mark.usefixtures("no_matplotlib")
def test_trace_png_without_matplotlib_fails_before_writing(tmp_path: Path) -> None:
    from rrfp_async.cli._main import main

    trace = tmp_path / "t.json"
    assert (
        CliRunner()
        .invoke(
            main, ["simulate", "-p", "2", "-m", "4", "--policy", "strict", "--trace", str(trace)]
        )
        .exit_code
        == 0
    )
    res = CliRunner().invoke(main, ["trace", str(trace), "--png", str(tmp_path / "x.png")])
    assert res.exit_code == 1, res.output
    assert "--png needs matplotlib" in res.output and "pip install 'rrfp-async[plot]'" in res.output
    assert "wrote" not in res.output and not (tmp_path / "x.png").exists()
