"""The command line's plug-ins (``rrfp_async.cli.COMMANDS_GROUP`` entry points): the lab's
commands arrive that way, and a plug-in that cannot run is refused by name while every other
command keeps working."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import click
import pytest
from click.testing import CliRunner

from rrfp_async.cli import COMMANDS_GROUP, _main, main


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=COMMANDS_GROUP)


@click.command("hello")
def hello() -> None:
    """Say hello."""
    click.echo("hello from a plug-in")


NOT_A_COMMAND = 42


def test_the_lab_commands_are_installed_plug_ins() -> None:
    found = {name: [ep.value for ep in eps] for name, eps in _main.plugin_commands().items()}
    assert found["bench"] == ["rrfp_lab.cli:bench"], found
    assert found["demo"] == ["rrfp_lab.cli:demo_cmd"], found
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0, res.output
    for name in ("bench", "demo", "simulate", "trace"):
        assert f"  {name} " in res.output, res.output


def test_a_plug_in_runs_and_bad_ones_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = __name__
    plugins = {
        "hello": (_ep("hello", f"{here}:hello"),),
        "gone": (_ep("gone", "no_such_module_xyz:cmd"),),
        "number": (_ep("number", f"{here}:NOT_A_COMMAND"),),
        "twice": (_ep("twice", f"{here}:hello"), _ep("twice", f"{here}:hello")),
        "simulate": (_ep("simulate", f"{here}:hello"),),  # an own command's name wins
    }
    monkeypatch.setattr(_main, "plugin_commands", lambda: plugins)
    run = CliRunner().invoke
    assert run(main, ["hello"]).output == "hello from a plug-in\n"
    # The group's help lists every one, the broken ones with why (and does not fail).
    listing = run(main, ["--help"])
    assert listing.exit_code == 0, listing.output
    assert "hello " in listing.output and "gone " in listing.output
    assert "cannot run" in listing.output
    for args, why in (
        (
            ["gone"],
            "the command 'gone' (no_such_module_xyz:cmd) failed to load:"
            " ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
        (["gone", "--help", "-x"], "failed to load: ModuleNotFoundError"),
        (["number"], f"the command 'number' ({here}:NOT_A_COMMAND) is a int, not a click command"),
        (["twice"], "the command 'twice' is registered by 2 plug-ins"),
    ):
        res = run(main, args)
        assert res.exit_code == 1, (args, res.output)
        assert res.output.startswith("Error: ") and why in res.output, (args, res.output)
    assert "Simulate one step" in run(main, ["simulate", "--help"]).output
    assert run(main, ["hello"]).exit_code == 0  # the others still work


def test_without_plug_ins_a_missing_command_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_main, "plugin_commands", lambda: {})
    res = CliRunner().invoke(main, ["demo"])
    assert res.exit_code == 2, res.output
    assert "No such command 'demo'. Plug-in commands come from installed entry points" in (
        res.output
    ), res.output
    assert "pip install -e ." in res.output
    # With plug-ins installed, an unknown command is click's plain usage error.
    monkeypatch.setattr(_main, "plugin_commands", lambda: {"hello": (_ep("hello", "x:y"),)})
    res = CliRunner().invoke(main, ["nope"])
    assert res.exit_code == 2 and "No such command 'nope'." in res.output
    assert "entry points" not in res.output
