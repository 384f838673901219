"""The per-stage event loop: ready set, arbitration, executors' completions, virtual time."""

from .._bridges import ComputeWorker, cuda_event_future, run_blocking, torch_future, work_future
from ._loop_fields import Coordinator
from ._pipeline import LocalPipeline
from ._runner import loop_factory, run
from ._stage_loop import (
    ExecutedTask,
    StageLoop,
    StageMonitor,
    StageObserver,
    StepStats,
)
from ._virtual import (
    VirtualClockStall,
    VirtualEventLoop,
    VirtualTimeLimit,
    new_virtual_event_loop,
)

__all__ = [
    "ComputeWorker",
    "Coordinator",
    "ExecutedTask",
    "LocalPipeline",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepStats",
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
