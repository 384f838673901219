"""torchtitan's pipeline schedule by configuration value, readiness-first: two flags.

::

    torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 4 \\
        --override.imports rrfp_async.torchtitan.readiness_first \\
        --parallelism.pipeline_parallel_schedule ReadinessFirst

Importing this module (torchtitan does it for ``--override.imports``) teaches torchtitan the
schedule names of ``schedule_names()``; ``readiness_first``'s keyword arguments configure
them (``'rrfp_async.torchtitan.readiness_first={"policy": "strict", "hint": "1F1B"}'``).
See ``rrfp_async.integrations._torchtitan`` for what is patched and why, and
docs/compatibility.md for the how-to. torchtitan is an optional dependency; importing this
module without it raises ``ExtraMissingError`` (an ``ImportError``).
"""

from .integrations._torchtitan import (
    OPTIONS,
    install,
    readiness_first,
    schedule_class,
    schedule_names,
    schedule_options,
)

install()

__all__ = [
    "OPTIONS",
    "install",
    "readiness_first",
    "schedule_class",
    "schedule_names",
    "schedule_options",
]
