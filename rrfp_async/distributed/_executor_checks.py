"""The torch stage executor's refusals, each naming the mistake and the fix: a ``modules``
argument that is no mapping of stage indices to modules (``check_modules``), and a task
sent to an executor that was closed (``closed_executor``: its compute thread is stopped, so
the task would fail with the worker's bare "closed" error).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._check import describe
from .._errors import ClosedError, PlanError
from .._tasks import Task
from ..loop import TaskContext

__all__ = ["check_modules", "closed_executor"]

_MODULES_FIX = (
    "pass {0: module} for the first stage of a pipeline (the key is the virtual stage the"
    " module runs: Topology.stages_of(pipeline rank), e.g. {rank: module} with one chunk"
    " per rank)"
)


def check_modules(modules: object) -> None:
    """Refuse ``modules`` unless it is a non-empty mapping of stage indices (ints >= 0) to
    callables: a bare module or a list of them is the usual mistake, and ``dict()`` of one
    says nothing a user can act on ("cannot convert dictionary update sequence ...")."""
    if not isinstance(modules, Mapping):
        raise PlanError(
            "TorchStageExecutor takes a dict {stage_index: module} of the virtual stages"
            f" this rank runs; got a {type(modules).__name__}: {_MODULES_FIX}"
        )
    if not modules:
        raise PlanError(f"a TorchStageExecutor needs at least one module: {_MODULES_FIX}")
    for k, m in modules.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise PlanError(
                f"TorchStageExecutor: the stage index {describe(k)} must be an int >= 0 (the"
                f" virtual stage its module runs): {_MODULES_FIX}"
            )
        if not callable(m):
            raise PlanError(
                f"TorchStageExecutor: stage {k}'s module must be an nn.Module, got {describe(m)}"
            )


def closed_executor(executor: Any, task: Task, ctx: TaskContext) -> ClosedError:
    """The error of ``task`` sent to ``executor`` after its ``close()``."""
    name = type(executor).__name__
    return ClosedError(
        f"rank {ctx.rank} step {ctx.step} {task}: this {name} is closed (its close() stopped"
        f" its compute thread, {executor.worker!r}), so it runs no more tasks. Close an"
        " executor after the last step of the pipeline or stage that runs it (and that"
        f" stage first), or build a new {name} for more steps"
    )
