"""rrfp_async: readiness-first pipeline-parallel training steps, driven by asyncio.

The friendly public API, pulled together from the private modules and the layers:

* the schedule IR: ``Task``, ``Topology``, ``StepPlan``;
* costs and workloads: ``Microbatch``, ``CostModel``, ``Durations``, ``make_workload``;
* deciding (``rrfp_async.policies``): hints, ``StepSchedule``, policies;
* running (``rrfp_async.loop``): ``StageLoop``, ``LocalPipeline``, ``run``, the bridges;
* distributed: ``ProcessLayout``, ``build_groups``, ``DistributedStage``,
  ``TorchStageExecutor``, ``EmulatedCost``, ``spawn`` (``report_progress``: a worker's
  messages to its ``on_progress``); splitting a model into stage
  modules with the parameters they share: ``split_model``, ``from_stage_modules``,
  ``from_pipe``, ``StageSplit``, ``StageModule``; a Hugging Face causal LM in one call:
  ``split_causal_lm``, ``CausalLMSplit``, ``CausalLMStage``;
* simulating: ``simulate``, ``compare``, ``SimResult``;
* reporting a measured speedup honestly: ``paired_ratio``, ``PairedRatio``;
* the tasks' random streams (dropout independent of the dispatch order) and their
  single-process reference: ``task_rng``, ``task_seed``;
* errors: ``RRFPError`` and its subclasses.
"""

from typing import TYPE_CHECKING, Any

from ._lazy import exports

__version__ = "0.1.0"

# The public names and where each lives. ``import rrfp_async`` imports none of them (no
# torch): a name's module is imported when the name is first used, so the command line's
# ``--help`` and code that needs only the simulator stay light (see ``__getattr__``).
_EXPORTS: dict[str, str] = {
    "AdmissionLedger": "._admission",
    "Args": "._pytree",
    "CausalLMSplit": ".distributed._causal_lm",
    "CausalLMStage": ".distributed._causal_lm_stage",
    "ChannelError": "._errors",
    "ClosedError": "._errors",
    "CostModel": "._costs",
    "CostModelExecutor": ".loop._executors",
    "DeadlockError": "._errors",
    "DistributedStage": ".distributed._dist_stage",
    "DivergenceError": "._errors",
    "Durations": "._costs",
    "EmulatedCost": ".distributed._emulation",
    "ExecutedTask": ".loop",
    "Executor": ".loop._executors",
    "ExtraMissingError": "._errors",
    "HINTS": ".policies",
    "HintError": "._errors",
    "InterruptedStepError": "._errors",
    "Kind": "._tasks",
    "LocalPipeline": ".loop",
    "LogObserver": ".observability",
    "Microbatch": "._costs",
    "MultiObserver": ".observability",
    "NonFinite": ".distributed._nonfinite",
    "NonFiniteError": "._errors",
    "ObserverError": "._errors",
    "PairedRatio": ".observability",
    "PeerError": "._errors",
    "PeerStepError": "._errors",
    "Placement": "._tasks",
    "PlanError": "._errors",
    "Policy": ".policies",
    "PolicyBase": ".policies",
    "PolicyError": "._errors",
    "ProcessLayout": ".distributed._layout",
    "ProtocolError": "._errors",
    "RRFPError": "._errors",
    "ReadyView": ".policies",
    "SimResult": ".sim._simulate",
    "SpawnError": "._errors",
    "StageGroups": ".distributed._layout",
    "StageLoop": ".loop",
    "StageModule": ".distributed._split",
    "StageProfile": "._costs",
    "StageSplit": ".distributed._split",
    "StepPlan": "._tasks",
    "StepSchedule": ".policies",
    "StepStats": ".loop",
    "StepTimeoutError": "._errors",
    "Task": "._tasks",
    "TaskContext": ".loop._executors",
    "Topology": "._tasks",
    "TorchStageExecutor": ".distributed._torch_executor",
    "TraceData": ".observability",
    "TraceError": "._errors",
    "TraceRecorder": ".observability",
    "VirtualEventLoop": ".loop",
    "WORKLOADS": "._workloads",
    "Workload": "._workloads",
    "build_groups": ".distributed._layout",
    "chrome_trace": ".observability",
    "compare": ".sim._simulate",
    "configure_logging": ".observability",
    "format_tasks": "._tasks",
    "free_port": ".distributed._spawn",
    "from_pipe": ".distributed._split",
    "from_stage_modules": ".distributed._split",
    "hint_from_torch": ".policies",
    "hint_peak": "._admission",
    "load_trace": ".observability",
    "lower_bound": ".sim._simulate",
    "make_hint": ".policies",
    "make_workload": "._workloads",
    "merge_traces": ".observability",
    "paired_ratio": ".observability",
    "parse_tasks": "._tasks",
    "pipeline_neighbors": ".distributed._layout",
    "readiness_first": ".policies",
    "register_policy": ".policies",
    "render_png": ".observability",
    "run": ".loop",
    "simulate": ".sim._simulate",
    "report_progress": ".distributed._spawn",
    "spawn": ".distributed._spawn",
    "split_causal_lm": ".distributed._causal_lm",
    "split_model": ".distributed._split",
    "stalls": ".observability",
    "strict": ".policies",
    "summarize": ".observability",
    "task_rng": "._rng",
    "task_seed": "._rng",
    "validate_chrome_trace": ".observability",
    "validate_hint": ".policies",
    "write_trace": ".observability",
}

if TYPE_CHECKING:  # the same names for type checkers (tests/test_public_api.py holds them equal)
    from ._admission import AdmissionLedger, hint_peak
    from ._costs import CostModel, Durations, Microbatch, StageProfile
    from ._errors import (
        ChannelError,
        ClosedError,
        DeadlockError,
        DivergenceError,
        ExtraMissingError,
        HintError,
        InterruptedStepError,
        NonFiniteError,
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
    from .distributed._causal_lm import CausalLMSplit, split_causal_lm
    from .distributed._causal_lm_stage import CausalLMStage
    from .distributed._dist_stage import DistributedStage
    from .distributed._emulation import EmulatedCost
    from .distributed._layout import ProcessLayout, StageGroups, build_groups, pipeline_neighbors
    from .distributed._nonfinite import NonFinite
    from .distributed._spawn import free_port, report_progress, spawn
    from .distributed._split import (
        StageModule,
        StageSplit,
        from_pipe,
        from_stage_modules,
        split_model,
    )
    from .distributed._torch_executor import TorchStageExecutor
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


_exported, __dir__ = exports(__name__, _EXPORTS)

# The example model's training harness moved to the lab (``rrfp_lab``, beside the runtime);
# until 0.2 its old names still resolve, with a warning. The lab's module is looked up by
# name here, never imported by the runtime's layers (tests/test_layers.py).
_MOVED_TO_LAB = frozenset({"TrainConfig", "TrainResult", "image_text_cost", "train_worker"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_LAB:
        import importlib
        import warnings

        warnings.warn(
            f"rrfp_async.{name} moved to rrfp_lab.{name} (the example model's training"
            f" harness is lab, not runtime): `from rrfp_lab import {name}`; the old name goes"
            " in 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("rrfp_lab"), name)
    return _exported(name)


__all__ = [
    "HINTS",
    "WORKLOADS",
    "AdmissionLedger",
    "Args",
    "CausalLMSplit",
    "CausalLMStage",
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
    "ExtraMissingError",
    "HintError",
    "InterruptedStepError",
    "Kind",
    "LocalPipeline",
    "LogObserver",
    "Microbatch",
    "MultiObserver",
    "NonFinite",
    "NonFiniteError",
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
    "report_progress",
    "run",
    "simulate",
    "spawn",
    "split_causal_lm",
    "split_model",
    "stalls",
    "strict",
    "summarize",
    "task_rng",
    "task_seed",
    "validate_chrome_trace",
    "validate_hint",
    "write_trace",
]
