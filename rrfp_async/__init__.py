"""rrfp_async: readiness-first pipeline-parallel training steps, driven by asyncio.

The friendly public API, pulled together from the private modules and the layers:

* the schedule IR: ``Task``, ``Topology``, ``StepPlan``;
* costs and workloads: ``Microbatch``, ``CostModel``, ``Durations``, ``make_workload``;
* deciding (``rrfp_async.policies``): hints, ``StepSchedule``, policies;
* running (``rrfp_async.loop``): ``StageLoop``, ``LocalPipeline``, ``run``, the bridges;
* distributed: ``ProcessLayout``, ``build_groups``, ``DistributedStage``,
  ``TorchStageExecutor``, ``EmulatedCost``, ``spawn``;
* simulating: ``simulate``, ``compare``, ``SimResult``;
* errors: ``RRFPError`` and its subclasses.
"""

from ._admission import AdmissionLedger, hint_peak
from ._costs import (
    WORKLOADS,
    CostModel,
    Durations,
    Microbatch,
    StageProfile,
    Workload,
    make_workload,
)
from ._errors import (
    ChannelError,
    DeadlockError,
    DivergenceError,
    HintError,
    PeerError,
    PlanError,
    PolicyError,
    ProtocolError,
    RRFPError,
    SpawnError,
    StepTimeoutError,
)
from ._tasks import Kind, Placement, StepPlan, Task, Topology, format_tasks, parse_tasks
from .distributed._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
from .distributed._spawn import free_port, spawn
from .distributed._stage import DistributedStage
from .distributed._torch_executor import EmulatedCost, TorchStageExecutor
from .loop import ExecutedTask, LocalPipeline, StageLoop, StepStats, VirtualEventLoop, run
from .loop._executors import CostModelExecutor, Executor, TaskContext
from .observability._logging import LogObserver, configure_logging
from .observability._trace import (
    MultiObserver,
    TraceData,
    TraceRecorder,
    chrome_trace,
    load_trace,
    render_png,
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
    "ChannelError",
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
    "PeerError",
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
    "StageProfile",
    "StepPlan",
    "StepSchedule",
    "StepStats",
    "StepTimeoutError",
    "Task",
    "TaskContext",
    "Topology",
    "TorchStageExecutor",
    "TraceData",
    "TraceRecorder",
    "VirtualEventLoop",
    "Workload",
    "build_groups",
    "chrome_trace",
    "compare",
    "configure_logging",
    "format_tasks",
    "free_port",
    "hint_from_torch",
    "hint_peak",
    "load_trace",
    "lower_bound",
    "make_hint",
    "make_workload",
    "parse_tasks",
    "pipeline_neighbors",
    "readiness_first",
    "register_policy",
    "render_png",
    "run",
    "simulate",
    "spawn",
    "strict",
    "summarize",
    "validate_chrome_trace",
    "validate_hint",
    "write_trace",
]
