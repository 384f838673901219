"""rrfp_lab: the lab beside the runtime. What ``rrfp-async bench ...`` and ``demo`` measure,
and the example model's training harness; never imported by ``rrfp_async``.

The runtime (``rrfp_async``) is the library; this package holds what measures it and shows
it off, so the runtime reads as the runtime. It imports ``rrfp_async`` like any user, through
its faces (``tests/test_layers.py`` holds it to that), and reaches the command line as
plug-ins (``rrfp_lab.cli``: ``bench`` and ``demo``, registered in ``pyproject.toml``'s
``rrfp_async.commands`` entry points). Every benchmark prints ratios measured side by side
in one run; on a CPU, GPU time is emulated (real torch compute plus a sleep from a declared
cost model on a compute thread), and every report says so. ``BENCHMARKS.md`` gives each
command's current figures.

Public: the example model's training harness (what ``examples/train_image_text.py`` and
the demo run): ``TrainConfig``, ``train_worker``, ``TrainResult`` and ``image_text_cost``
(the example model's declared cost model). Until 0.2 they are also reachable, with a
``DeprecationWarning``, as ``rrfp_async.TrainConfig`` and so on.

Internal to the package family: the benchmark bodies, their configs and the targets each
command checks (``_INTERNAL``), for ``rrfp_lab.cli``. The face is lazy
(``rrfp_async._lazy``): ``from .. import soak`` inside a command imports ``_soak`` alone, so
one command pays only for its own benchmark. It caches nothing (``cache=False``): a command
reads each name from its module when it runs, as it did when it imported the module itself,
so a name a test replaces there is the one the command runs.
"""

from typing import TYPE_CHECKING

from rrfp_async._lazy import exports

_EXPORTS: dict[str, str] = {
    "TrainConfig": "._demo_train",
    "TrainResult": "._demo_train",
    "image_text_cost": "._demo_train",
    "train_worker": "._demo_train",
}

_INTERNAL: dict[str, str] = {
    "DECISION_TARGET_US": "._overhead",
    "HFConfig": "._hf",
    "MESSAGE_TARGET_RATIO": "._overhead",
    "MegatronBenchConfig": "._megatron",
    "PAPER_FIGURES": "._paper",
    "PeerConfig": "._peer_config",
    "SPLIT_TARGET_RATIO": "._overhead",
    "TP_MODEL_TOLERANCE": "._overhead",
    "TP_SHARE_TARGET": "._overhead",
    "TP_STEP_SHARE_TARGET": "._overhead",
    "TP_TARGET_RATIO": "._overhead",
    "bridge_overheads": "._bridge_overheads",
    "condition_configs": "._paper",
    "condition_scenarios": "._paper",
    "coordination_rows": "._paper",
    "coordination_table": "._paper",
    "decision_latency": "._overhead",
    "default_scenarios": "._paper",
    "format_soak": "._soak",
    "hf_benchmark": "._hf",
    "logging_overhead": "._local_bench",
    "megatron_benchmark": "._megatron",
    "message_cost": "._overhead",
    "module_host_time": "._peer_stage",
    "paper_table": "._paper",
    "peer_benchmark": "._peer",
    "peer_simulated": "._peer_sim",
    "pipeline_step_times": "._local_bench",
    "report_tables": "._paper",
    "resolve_torch_schedule": "._peer_config",
    "simulator_policy_table": "._local_bench",
    "simulator_scaling": "._local_bench",
    "simulator_wall_time": "._local_bench",
    "soak": "._soak",
    "split_backward_cost_isolated": "._overhead",
    "task_overhead_isolated": "._overhead",
    "to_markdown": "._paper",
    "tp_coordination": "._overhead",
    "tp_model": "._overhead",
}

if TYPE_CHECKING:
    from ._bridge_overheads import bridge_overheads as bridge_overheads
    from ._demo_train import TrainConfig as TrainConfig
    from ._demo_train import TrainResult as TrainResult
    from ._demo_train import image_text_cost as image_text_cost
    from ._demo_train import train_worker as train_worker
    from ._hf import HFConfig as HFConfig
    from ._hf import hf_benchmark as hf_benchmark
    from ._local_bench import logging_overhead as logging_overhead
    from ._local_bench import pipeline_step_times as pipeline_step_times
    from ._local_bench import simulator_policy_table as simulator_policy_table
    from ._local_bench import simulator_scaling as simulator_scaling
    from ._local_bench import simulator_wall_time as simulator_wall_time
    from ._megatron import MegatronBenchConfig as MegatronBenchConfig
    from ._megatron import megatron_benchmark as megatron_benchmark
    from ._overhead import DECISION_TARGET_US as DECISION_TARGET_US
    from ._overhead import MESSAGE_TARGET_RATIO as MESSAGE_TARGET_RATIO
    from ._overhead import SPLIT_TARGET_RATIO as SPLIT_TARGET_RATIO
    from ._overhead import TP_MODEL_TOLERANCE as TP_MODEL_TOLERANCE
    from ._overhead import TP_SHARE_TARGET as TP_SHARE_TARGET
    from ._overhead import TP_STEP_SHARE_TARGET as TP_STEP_SHARE_TARGET
    from ._overhead import TP_TARGET_RATIO as TP_TARGET_RATIO
    from ._overhead import decision_latency as decision_latency
    from ._overhead import message_cost as message_cost
    from ._overhead import split_backward_cost_isolated as split_backward_cost_isolated
    from ._overhead import task_overhead_isolated as task_overhead_isolated
    from ._overhead import tp_coordination as tp_coordination
    from ._overhead import tp_model as tp_model
    from ._paper import PAPER_FIGURES as PAPER_FIGURES
    from ._paper import condition_configs as condition_configs
    from ._paper import condition_scenarios as condition_scenarios
    from ._paper import coordination_rows as coordination_rows
    from ._paper import coordination_table as coordination_table
    from ._paper import default_scenarios as default_scenarios
    from ._paper import paper_table as paper_table
    from ._paper import report_tables as report_tables
    from ._paper import to_markdown as to_markdown
    from ._peer import peer_benchmark as peer_benchmark
    from ._peer_config import PeerConfig as PeerConfig
    from ._peer_config import resolve_torch_schedule as resolve_torch_schedule
    from ._peer_sim import peer_simulated as peer_simulated
    from ._peer_stage import module_host_time as module_host_time
    from ._soak import format_soak as format_soak
    from ._soak import soak as soak

__getattr__, __dir__ = exports(__name__, {**_EXPORTS, **_INTERNAL}, cache=False)

__all__ = ["TrainConfig", "TrainResult", "image_text_cost", "train_worker"]
