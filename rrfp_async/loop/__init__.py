"""The per-stage event loop: ready set, arbitration, executors' completions, virtual time."""

from ._pipeline import LocalPipeline
from ._runner import loop_factory, run
from ._stage import ExecutedTask, StageLoop, StageMonitor, StageObserver, StepStats
from ._virtual import VirtualClockStall, VirtualEventLoop, new_virtual_event_loop

__all__ = [
    "ExecutedTask",
    "LocalPipeline",
    "StageLoop",
    "StageMonitor",
    "StageObserver",
    "StepStats",
    "VirtualClockStall",
    "VirtualEventLoop",
    "loop_factory",
    "new_virtual_event_loop",
    "run",
]
