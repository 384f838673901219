"""The lab's commands of ``rrfp-async``: ``bench`` (a group, one subcommand per benchmark)
and ``demo``. They reach the command line as plug-ins (``pyproject.toml``'s
``[project.entry-points."rrfp_async.commands"]``), so the runtime's ``rrfp_async.cli``
names no lab module.

The layout, imports running down the list:

* ``_cmd_demo``: ``demo``; ``_cmd_bench``: the ``bench`` group and its small subcommands,
  with ``_cmd_bench_peer``, ``_cmd_bench_overhead``, ``_cmd_bench_megatron``,
  ``_cmd_bench_hf`` one (group of) subcommand(s) each;
* what each measures is in the lab's modules (``rrfp_lab``), imported inside each command so
  that ``--help`` loads no torch; the options and output they share are the runtime CLI's
  (``rrfp_async.cli``).
"""

from ._cmd_bench import bench
from ._cmd_demo import demo_cmd

__all__ = ["bench", "demo_cmd"]
