"""The ``rrfp-async`` command line (click for parsing, rich for tables): the group.

The layout, one module per role, imports running down this list:

* ``_main``: the ``rrfp-async`` group; its own commands are added here, the plug-ins'
  commands are found through entry points (below);
* ``_cmd_simulate``, ``_cmd_trace``: one command each (the runtime's);
* ``_options``: the options the commands share (``--policy``, ``--memory-factor``,
  ``--jitter``, ``--seed``, logging, ...), each defined once;
* ``_output``: the console, tables, and the one place errors become ``Error: <message>``
  (:class:`~._output.CleanErrorsGroup`, the class of every group).

Command plug-ins: a distribution adds commands to the group by naming click commands in
the entry-point group ``rrfp_async.commands`` (:data:`COMMANDS_GROUP`). The lab's ``bench``
and ``demo`` arrive that way (``pyproject.toml``): the runtime names no lab module, and a
plug-in is imported only when its command runs or the group's help lists it, so ``--help``
still loads no torch.

Commands are plain ``click.command`` objects added to the group below rather than decorated
with ``@main.command``, so that no command module imports this one (no import cycle).
"""

from __future__ import annotations

import functools
import sys
from importlib.metadata import EntryPoint, entry_points

import click

from ._cmd_simulate import simulate_cmd
from ._cmd_trace import trace_cmd
from ._options import log_options
from ._output import CleanErrorsGroup

__all__ = ["COMMANDS_GROUP", "main", "plugin_commands"]

#: The entry-point group whose entries (``name = "module:command"``) add click commands to
#: ``rrfp-async``.
COMMANDS_GROUP = "rrfp_async.commands"


@functools.cache
def plugin_commands() -> dict[str, tuple[EntryPoint, ...]]:
    """The installed command plug-ins by command name (read once per process; a name that
    two distributions register is kept twice, and refused when it is run)."""
    found: dict[str, tuple[EntryPoint, ...]] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        found[ep.name] = (*found.get(ep.name, ()), ep)
    return found


def _where(ep: EntryPoint) -> str:
    dist = f", from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
    return f"{ep.value}{dist}"


def _refused(name: str, why: str) -> click.Command:
    """A stand-in for a plug-in that cannot run: listed in ``--help`` with the reason, and
    running it (with any arguments, ``--help`` too) is that error; the other commands work."""
    message = f"the command {name!r} {why}"

    def fail() -> None:
        raise click.ClickException(message)

    return click.Command(
        name,
        callback=fail,
        help=message,
        short_help=f"(cannot run: {why})",
        add_help_option=False,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )


class _CommandsGroup(CleanErrorsGroup):
    """The group: its own commands, then the plug-ins' (:data:`COMMANDS_GROUP`), each
    imported when it is asked for. An own command's name wins over a plug-in's; a plug-in
    that cannot run is refused by name when it is run (see :func:`_refused`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *plugin_commands()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        own = super().get_command(ctx, cmd_name)
        if own is not None:
            return own
        eps = plugin_commands().get(cmd_name)
        if eps is None:
            return None
        if len(eps) > 1:
            return _refused(
                cmd_name,
                f"is registered by {len(eps)} plug-ins ({'; '.join(_where(ep) for ep in eps)};"
                f" entry-point group {COMMANDS_GROUP!r}): uninstall all but one",
            )
        (ep,) = eps
        try:
            loaded = ep.load()
        except Exception as e:
            return _refused(cmd_name, f"({_where(ep)}) failed to load: {type(e).__name__}: {e}")
        if not isinstance(loaded, click.Command):
            return _refused(
                cmd_name, f"({_where(ep)}) is a {type(loaded).__name__}, not a click command"
            )
        return loaded

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            if plugin_commands():
                raise
            # No plug-in at all: the package's commands beyond simulate and trace (bench,
            # demo) come from its entry points, which only an install registers.
            raise click.UsageError(
                f"{e.message.rstrip('.')}. Plug-in commands come from installed entry points"
                f" ({COMMANDS_GROUP!r}) and none is installed here: install the package"
                " (`pip install -e .` in a checkout, or `./dev setup`) to get them",
                ctx,
            ) from e


@click.group(cls=_CommandsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rrfp-async")
@log_options
def main() -> None:
    """Readiness-first pipeline-parallel training steps on asyncio."""


for _command in (simulate_cmd, trace_cmd):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
