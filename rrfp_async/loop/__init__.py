"""The per-stage event loop: ready set, arbitration, executors' completions, virtual time.

Internal to the package family: imported here (``from ._x import name as name``, mypy's
explicit re-export) for the packages above (``sim/``, ``distributed/``, ``integrations/``,
and the lab, ``rrfp_lab``), not in ``__all__``:

* ``OutputHook``: the type of an executor's ``output_hook``;
* ``GradStash``, ``stash_grads``, ``restore_grads``: tied gradients set aside while a step
  runs (``_accumulate``);
* ``check_step_args``: the checks on a step's inputs, targets and losses;
* ``resolve_step``, ``ResolvedStep``: the one resolution of a step's number and schedule
  from ``run_step``'s arguments (``_checks``), for every entry point;
* ``deadlock_grid``: the deadlock picture of a set of stages (``_diagnostics``);
* ``policy_awaits``: what the policy of each stage that is in its turn awaits
  (``_diagnostics``);
* ``SyncPortal``: the synchronous face's event loop thread;
* ``UNSET``, ``resolve_tp_options``: the flat TP keywords of an entry point, resolved
  into one ``TPOptions`` (``_tp_options``).
"""

from .._bridges import ComputeWorker, cuda_event_future, run_blocking, torch_future, work_future
from ._accumulate import GradStash as GradStash
from ._accumulate import restore_grads as restore_grads
from ._accumulate import stash_grads as stash_grads
from ._checks import ResolvedStep as ResolvedStep
from ._checks import check_step_args as check_step_args
from ._checks import resolve_step as resolve_step
from ._coordinator import Coordinator
from ._diagnostics import deadlock_grid as deadlock_grid
from ._diagnostics import policy_awaits as policy_awaits
from ._executors import (
    CostModelExecutor,
    Executor,
    OutputHookExecutor,
    SettlingExecutor,
    StepFailedExecutor,
    StepResultsExecutor,
    TaskContext,
    TiedExecutor,
)
from ._executors import OutputHook as OutputHook
from ._observe import ActiveObserver, FailedObserver
from ._pipeline import LocalPipeline
from ._portal import SyncPortal as SyncPortal
from ._runner import loop_factory, run
from ._stage_loop import (
    ExecutedTask,
    StageLoop,
    StageMonitor,
    StageObserver,
    StepStats,
)
from ._tp_options import UNSET as UNSET
from ._tp_options import TPOptions
from ._tp_options import resolve_tp_options as resolve_tp_options
from ._virtual import (
    VirtualClockStall,
    VirtualEventLoop,
    VirtualTimeLimit,
    new_virtual_event_loop,
)

__all__ = [
    "ActiveObserver",
    "ComputeWorker",
    "Coordinator",
    "CostModelExecutor",
    "ExecutedTask",
    "Executor",
    "FailedObserver",
    "LocalPipeline",
    "OutputHookExecutor",
    "SettlingExecutor",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepFailedExecutor",
    "StepResultsExecutor",
    "StepStats",
    "TPOptions",
    "TaskContext",
    "TiedExecutor",
    "VirtualClockStall",
    "VirtualEventLoop",
    "VirtualTimeLimit",
    "cuda_event_future",
    "loop_factory",
    "new_virtual_event_loop",
    "run",
    "run_blocking",
    "torch_future",
    "work_future",
]
