"""rrfp_async: readiness-first pipeline-parallel training steps, driven by asyncio.

The friendly public API, pulled together from the private modules and the layers:

* the schedule IR: ``Task``, ``Topology``, ``StepPlan``;
* costs and workloads: ``Microbatch``, ``CostModel``, ``Durations``, ``make_workload``;
* deciding (``rrfp_async.policies``): hints, ``StepSchedule``, policies;
* running (``rrfp_async.loop``): ``StageLoop``, ``LocalPipeline``, ``run``, the bridges;
* distributed: ``ProcessLayout``, ``build_groups``, ``DistributedStage``,
  ``TorchStageExecutor``, ``EmulatedCost``, ``spawn``; splitting a model into stage
  modules with the parameters they share: ``split_model``, ``from_stage_modules``,
  ``from_pipe``, ``StageSplit``, ``StageModule``;
* the training harness (what ``examples/train_image_text.py`` runs): ``TrainConfig``,
  ``train_worker``, ``TrainResult``, ``image_text_cost`` (the example model's cost model);
* simulating: ``simulate``, ``compare``, ``SimResult``;
* reporting a measured speedup honestly: ``paired_ratio``, ``PairedRatio``;
* the tasks' random streams (dropout independent of the dispatch order) and their
  single-process reference: ``task_rng``, ``task_seed``;
* errors: ``RRFPError`` and its subclasses.
"""

from ._admission import AdmissionLedger, hint_peak
from ._costs import CostModel, Durations, Microbatch, StageProfile
from ._errors import (
    ChannelError,
    ClosedError,
    DeadlockError,
    DivergenceError,
    HintError,
    ObserverError,
    PeerError,
    PeerStepError,
    PlanError,
    PolicyError,
    ProtocolError,
    RRFPError,
    SpawnError,
    StepTimeoutError,
    TraceError,
)
from ._pytree import Args
from ._rng import task_rng, task_seed
from ._tasks import Kind, Placement, StepPlan, Task, Topology, format_tasks, parse_tasks
from ._workloads import WORKLOADS, Workload, make_workload
from .distributed._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
from .distributed._spawn import free_port, spawn
from .distributed._split import (
    StageModule,
    StageSplit,
    from_pipe,
    from_stage_modules,
    split_model,
)
from .distributed._stage import DistributedStage
from .distributed._torch_executor import EmulatedCost, TorchStageExecutor
from .distributed._train import TrainConfig, TrainResult, image_text_cost, train_worker
from .loop import ExecutedTask, LocalPipeline, StageLoop, StepStats, VirtualEventLoop, run
from .loop._executors import CostModelExecutor, Executor, TaskContext
from .observability import (
    LogObserver,
    MultiObserver,
    PairedRatio,
    TraceData,
    TraceRecorder,
    chrome_trace,
    configure_logging,
    load_trace,
    merge_traces,
    paired_ratio,
    render_png,
    stalls,
    summarize,
    validate_chrome_trace,
    write_trace,
)
from .policies import (
    HINTS,
    Policy,
    PolicyBase,
    ReadyView,
    StepSchedule,
    hint_from_torch,
    make_hint,
    readiness_first,
    register_policy,
    strict,
    validate_hint,
)
from .sim._simulate import SimResult, compare, lower_bound, simulate

__version__ = "0.1.0"

__all__ = [
    "HINTS",
    "WORKLOADS",
    "AdmissionLedger",
    "Args",
    "ChannelError",
    "ClosedError",
    "CostModel",
    "CostModelExecutor",
    "DeadlockError",
    "DistributedStage",
    "DivergenceError",
    "Durations",
    "EmulatedCost",
    "ExecutedTask",
    "Executor",
    "HintError",
    "Kind",
    "LocalPipeline",
    "LogObserver",
    "Microbatch",
    "MultiObserver",
    "ObserverError",
    "PairedRatio",
    "PeerError",
    "PeerStepError",
    "Placement",
    "PlanError",
    "Policy",
    "PolicyBase",
    "PolicyError",
    "ProcessLayout",
    "ProtocolError",
    "RRFPError",
    "ReadyView",
    "SimResult",
    "SpawnError",
    "StageGroups",
    "StageLoop",
    "StageModule",
    "StageProfile",
    "StageSplit",
    "StepPlan",
    "StepSchedule",
    "StepStats",
    "StepTimeoutError",
    "Task",
    "TaskContext",
    "Topology",
    "TorchStageExecutor",
    "TraceData",
    "TraceError",
    "TraceRecorder",
    "TrainConfig",
    "TrainResult",
    "VirtualEventLoop",
    "Workload",
    "build_groups",
    "chrome_trace",
    "compare",
    "configure_logging",
    "format_tasks",
    "free_port",
    "from_pipe",
    "from_stage_modules",
    "hint_from_torch",
    "hint_peak",
    "image_text_cost",
    "load_trace",
    "lower_bound",
    "make_hint",
    "make_workload",
    "merge_traces",
    "paired_ratio",
    "parse_tasks",
    "pipeline_neighbors",
    "readiness_first",
    "register_policy",
    "render_png",
    "run",
    "simulate",
    "spawn",
    "split_model",
    "stalls",
    "strict",
    "summarize",
    "task_rng",
    "task_seed",
    "train_worker",
    "validate_chrome_trace",
    "validate_hint",
    "write_trace",
]
