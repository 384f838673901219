"""A torchtitan user's config registry that trains on rrfp_async's readiness-first schedule.

torchtitan 0.3 selects a config by ``--module <module> --config <function>``; a module of
your own works as well as torchtitan's. This one takes torchtitan's llama3 configs and
changes two fields: the pipeline schedule's name and the override that brings rrfp_async in
(with its options). Run (8 GPUs, PP 4 x FSDP 2)::

    PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module torchtitan_config --config llama3_8b_readiness_first

The same without this file, on the command line::

    torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 4 \\
        --parallelism.pipeline_parallel_schedule InterleavedReadinessFirst \\
        --override.imports 'rrfp_async.torchtitan.readiness_first={"memory_factor": 1.5}'

Run plainly (``python examples/torchtitan_config.py``), it prints each config's pipeline
settings and the command that trains it. Needs ``pip install 'rrfp-async[torchtitan]'``
(without it the script says so in one line). tests/compat/test_torchtitan.py trains
``llama3_debugmodel_readiness_first`` against torchtitan's 1F1B.
"""

from __future__ import annotations

import importlib.util
import os
import sys

try:
    from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
    from torchtitan.trainer import Trainer
except ImportError:
    if __name__ != "__main__" or importlib.util.find_spec("torchtitan") is not None:
        raise  # imported by torchtitan, or a torchtitan without these: the real error
    sys.exit(f"{os.path.basename(__file__)} needs torchtitan: pip install 'rrfp-async[torchtitan]'")

READINESS_FIRST = "rrfp_async.torchtitan.readiness_first"


def llama3_8b_readiness_first() -> Trainer.Config:
    """Llama 3 8B, PP 4 with two stages per rank, readiness-first: the default hint
    (breadth-first weighted) under 1.5x 1F1B's activation bound."""
    config = llama3_8b()
    config.parallelism.pipeline_parallel_degree = 4
    config.parallelism.pipeline_parallel_schedule = "InterleavedReadinessFirst"
    config.override.imports = [(READINESS_FIRST, {"memory_factor": 1.5})]
    return config


def llama3_debugmodel_readiness_first() -> Trainer.Config:
    """torchtitan's debug model, PP 2 with one stage per rank, torch's 1F1B order as the
    hint (readiness-first: a stage runs what is ready when the hinted task is not)."""
    config = llama3_debugmodel()
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = "ReadinessFirst1F1B"
    config.override.imports = [READINESS_FIRST]
    return config


def main() -> None:
    """Print each config's pipeline settings and the command that trains it."""
    for build in (llama3_8b_readiness_first, llama3_debugmodel_readiness_first):
        config = build()
        pp = config.parallelism
        print(
            f"{build.__name__}: PP {pp.pipeline_parallel_degree},"
            f" schedule {pp.pipeline_parallel_schedule}, imports {config.override.imports}"
        )
    print(
        "train: PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train"
        " --module torchtitan_config --config llama3_8b_readiness_first"
    )


if __name__ == "__main__":
    main()
