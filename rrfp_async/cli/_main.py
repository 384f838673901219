"""The ``rrfp-async`` command line (click for parsing, rich for tables): the group.

The layout, one module per role, imports running down this list:

* ``_main``: the ``rrfp-async`` group, which every command is added to here;
* ``_cmd_simulate``, ``_cmd_trace``, ``_cmd_demo``: one command each;
* ``_cmd_bench`` (the ``bench`` group and its small subcommands), ``_cmd_bench_peer``,
  ``_cmd_bench_overhead``: the benchmarks' commands; what they measure is in ``rrfp_async.bench``,
  imported inside each command so that ``--help`` does not load torch;
* ``_options``: the options the commands share (``--policy``, ``--memory-factor``,
  ``--jitter``, ``--seed``, logging, ...), each defined once;
* ``_output``: the console, tables, and the one place errors become ``Error: <message>``
  (:class:`~._output.CleanErrorsGroup`, the class of every group).

Commands are plain ``click.command`` objects added to the group below rather than decorated
with ``@main.command``, so that no command module imports this one (no import cycle).
"""

from __future__ import annotations

import sys

import click

from ._cmd_bench import bench
from ._cmd_demo import demo_cmd
from ._cmd_simulate import simulate_cmd
from ._cmd_trace import trace_cmd
from ._options import log_options
from ._output import CleanErrorsGroup

__all__ = ["main"]


@click.group(cls=CleanErrorsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rrfp-async")
@log_options
def main() -> None:
    """Readiness-first pipeline-parallel training steps on asyncio."""


for _command in (simulate_cmd, bench, trace_cmd, demo_cmd):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
