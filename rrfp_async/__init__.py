"""rrfp_async: readiness-first pipeline-parallel training steps, driven by asyncio.

The friendly public API, pulled together from the private modules and the layers. The top
level holds what a user writing a training loop, a policy or a simulation reaches for:

* the schedule IR: ``Task``, ``Kind``, ``Topology``, ``Placement``, ``StepPlan``,
  ``parse_tasks``, ``format_tasks``;
* costs and workloads: ``Microbatch``, ``CostModel``, ``StageProfile``, ``Durations``,
  ``make_workload``; memory in bytes: ``ActivationBytes``;
* deciding: ``StepSchedule``, ``Policy``, ``PolicyBase``, ``ReadyView``,
  ``register_policy``;
* running a stage: ``StageLoop``, ``LocalPipeline``, ``run``, ``Executor``,
  ``TaskContext``, ``StepStats``;
* across processes: ``ProcessLayout``, ``build_groups``, ``DistributedStage``,
  ``TorchStageExecutor``, ``EmulatedCost``, ``spawn``, ``Args``; splitting a model:
  ``split_model``, ``split_causal_lm``;
* simulating: ``simulate``, ``compare``;
* logging: ``configure_logging``, ``LogObserver``;
* the tasks' random streams (dropout independent of the dispatch order): ``task_rng``,
  ``task_seed``;
* the errors a training loop catches: ``RRFPError`` (the base), ``PlanError``,
  ``StepTimeoutError``, ``PeerStepError``, ``DeadlockError``.

The rest lives in namespaces, each reachable as an attribute (``rr.sim.SimResult``):
``rrfp_async.errors`` (every error, the tree drawn in its docstring),
``rrfp_async.policies`` (hints, the built-in policies, admission), ``rrfp_async.sim`` (the
simulator's results, cost-model executor, virtual clock, workloads),
``rrfp_async.observability`` (traces, summaries, stalls, the paired speedup),
``rrfp_async.distributed`` (groups, the model splitters' parts, ``report_progress``),
``rrfp_async.loop`` (the stage loop's parts), ``rrfp_async.channels`` and
``rrfp_async.testing`` (the NCCL-rules checker, ``free_port``). The names that left the
top level still resolve there until 0.2, with a ``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._lazy import exports

__version__ = "0.1.0"

# The public names and where each lives: the one list of the face (``__all__`` is its keys).
# ``import rrfp_async`` imports none of them (no torch): a name's module is imported when the
# name is first used, so the command line's ``--help`` and code that needs only the
# simulator stay light (see ``__getattr__``). Type checkers read the same names from the
# ``if TYPE_CHECKING:`` imports below; tests/test_public_api.py holds the two equal.
_EXPORTS: dict[str, str] = {
    # the schedule IR
    "Kind": "._tasks",
    "Placement": "._tasks",
    "StepPlan": "._tasks",
    "Task": "._tasks",
    "Topology": "._tasks",
    "format_tasks": "._tasks",
    "parse_tasks": "._tasks",
    # costs and workloads
    "CostModel": "._costs",
    "Durations": "._costs",
    "Microbatch": "._costs",
    "StageProfile": "._costs",
    "make_workload": "._workloads",
    "ActivationBytes": "._memory",
    # deciding
    "Policy": ".policies",
    "PolicyBase": ".policies",
    "ReadyView": ".policies",
    "StepSchedule": ".policies",
    "register_policy": ".policies",
    # running a stage
    "Executor": ".loop",
    "LocalPipeline": ".loop",
    "StageLoop": ".loop",
    "StepStats": ".loop",
    "TaskContext": ".loop",
    "run": ".loop",
    # across processes
    "Args": "._pytree",
    "DistributedStage": ".distributed",
    "EmulatedCost": ".distributed",
    "ProcessLayout": ".distributed",
    "TorchStageExecutor": ".distributed",
    "build_groups": ".distributed",
    "spawn": ".distributed",
    "split_causal_lm": ".distributed",
    "split_model": ".distributed",
    # simulating
    "compare": ".sim",
    "simulate": ".sim",
    # logging
    "LogObserver": ".observability",
    "configure_logging": ".observability",
    # the tasks' random streams
    "task_rng": "._rng",
    "task_seed": "._rng",
    # the errors a training loop catches (all of them: rrfp_async.errors)
    "DeadlockError": ".errors",
    "PeerStepError": ".errors",
    "PlanError": ".errors",
    "RRFPError": ".errors",
    "StepTimeoutError": ".errors",
}

#: The namespaces, reachable as attributes of the face without an import of their own.
_NAMESPACES = frozenset(
    {"channels", "distributed", "errors", "loop", "observability", "policies", "sim", "testing"}
)

#: Names that left the top level, and their new home: until 0.2 ``rrfp_async.<name>`` still
#: resolves (to the same object) with a ``DeprecationWarning`` naming the new path. The
#: example model's harness moved to the lab (``rrfp_lab``): it is looked up by name when
#: used, never imported by the runtime's layers (tests/test_layers.py).
_MOVED: dict[str, str] = {
    **dict.fromkeys(
        (
            "ChannelError",
            "ClosedError",
            "DivergenceError",
            "ExtraMissingError",
            "HintError",
            "InterruptedStepError",
            "NonFiniteError",
            "ObserverError",
            "PeerError",
            "PolicyError",
            "ProtocolError",
            "SpawnError",
            "TraceError",
        ),
        "rrfp_async.errors",
    ),
    **dict.fromkeys(
        (
            "AdmissionLedger",
            "HINTS",
            "hint_from_torch",
            "hint_peak",
            "make_hint",
            "readiness_first",
            "strict",
            "validate_hint",
        ),
        "rrfp_async.policies",
    ),
    **dict.fromkeys(
        (
            "CostModelExecutor",
            "SimResult",
            "VirtualEventLoop",
            "WORKLOADS",
            "Workload",
            "lower_bound",
        ),
        "rrfp_async.sim",
    ),
    **dict.fromkeys(
        (
            "MultiObserver",
            "PairedRatio",
            "TraceData",
            "TraceRecorder",
            "chrome_trace",
            "load_trace",
            "merge_traces",
            "paired_ratio",
            "render_png",
            "stalls",
            "summarize",
            "validate_chrome_trace",
            "write_trace",
        ),
        "rrfp_async.observability",
    ),
    **dict.fromkeys(
        (
            "CausalLMSplit",
            "CausalLMStage",
            "NonFinite",
            "StageGroups",
            "StageModule",
            "StageSplit",
            "from_pipe",
            "from_stage_modules",
            "pipeline_neighbors",
            "report_progress",
        ),
        "rrfp_async.distributed",
    ),
    "ExecutedTask": "rrfp_async.loop",
    "free_port": "rrfp_async.testing",
    **dict.fromkeys(("TrainConfig", "TrainResult", "image_text_cost", "train_worker"), "rrfp_lab"),
}

if TYPE_CHECKING:  # the same names for type checkers (``X as X``: an explicit re-export)
    from . import channels as channels
    from . import distributed as distributed
    from . import errors as errors
    from . import loop as loop
    from . import observability as observability
    from . import policies as policies
    from . import sim as sim
    from . import testing as testing
    from ._costs import CostModel as CostModel
    from ._costs import Durations as Durations
    from ._costs import Microbatch as Microbatch
    from ._costs import StageProfile as StageProfile
    from ._memory import ActivationBytes as ActivationBytes
    from ._pytree import Args as Args
    from ._rng import task_rng as task_rng
    from ._rng import task_seed as task_seed
    from ._tasks import Kind as Kind
    from ._tasks import Placement as Placement
    from ._tasks import StepPlan as StepPlan
    from ._tasks import Task as Task
    from ._tasks import Topology as Topology
    from ._tasks import format_tasks as format_tasks
    from ._tasks import parse_tasks as parse_tasks
    from ._workloads import make_workload as make_workload
    from .distributed import DistributedStage as DistributedStage
    from .distributed import EmulatedCost as EmulatedCost
    from .distributed import ProcessLayout as ProcessLayout
    from .distributed import TorchStageExecutor as TorchStageExecutor
    from .distributed import build_groups as build_groups
    from .distributed import spawn as spawn
    from .distributed import split_causal_lm as split_causal_lm
    from .distributed import split_model as split_model
    from .errors import DeadlockError as DeadlockError
    from .errors import PeerStepError as PeerStepError
    from .errors import PlanError as PlanError
    from .errors import RRFPError as RRFPError
    from .errors import StepTimeoutError as StepTimeoutError
    from .loop import Executor as Executor
    from .loop import LocalPipeline as LocalPipeline
    from .loop import StageLoop as StageLoop
    from .loop import StepStats as StepStats
    from .loop import TaskContext as TaskContext
    from .loop import run as run
    from .observability import LogObserver as LogObserver
    from .observability import configure_logging as configure_logging
    from .policies import Policy as Policy
    from .policies import PolicyBase as PolicyBase
    from .policies import ReadyView as ReadyView
    from .policies import StepSchedule as StepSchedule
    from .policies import register_policy as register_policy
    from .sim import compare as compare
    from .sim import simulate as simulate

__all__ = sorted(_EXPORTS)

_exported, _dir = exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        return importlib.import_module(f".{name}", __name__)
    new = _MOVED.get(name)
    if new is not None:
        import warnings

        warnings.warn(
            f"rrfp_async.{name} moved to {new}.{name}: `from {new} import {name}`; the old"
            " name goes in 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)
    return _exported(name)


def __dir__() -> list[str]:
    return sorted({*_dir(), *_NAMESPACES})
