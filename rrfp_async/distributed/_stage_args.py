"""What ``DistributedStage`` refuses before it builds or runs anything: arguments of the
wrong kind, a layout at another rank than torch.distributed's, a step on a stage that is not
open on this event loop. Each message names the mistake and the call that fixes it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .._check import describe
from .._errors import ClosedError, PlanError
from .._tasks import StepPlan
from ..policies import StepSchedule
from ._layout import ProcessLayout

__all__ = [
    "check_layout_rank",
    "check_positional",
    "not_open_with_with",
    "refuse_unless_open_here",
]


def _loop_name(loop: asyncio.AbstractEventLoop | None) -> str:
    """An event loop, told apart from others: its class, its id and whether it still runs."""
    if loop is None:
        return "no loop"
    state = "closed" if loop.is_closed() else "running" if loop.is_running() else "not running"
    cls = type(loop)
    return f"{cls.__module__}.{cls.__qualname__} at {id(loop):#x} ({state})"


def check_layout_rank(layout: ProcessLayout) -> None:
    """Refuse a layout that places this process at another rank than torch.distributed's
    (every process building ``ProcessLayout(pp=2, rank=0)``): otherwise two processes would
    claim one pipeline rank and the other would see only "lost rank 1"."""
    real, world = dist.get_rank(), dist.get_world_size()
    if layout.rank != real:
        raise PlanError(
            f"the layout places this process at global rank {layout.rank}, but"
            f" torch.distributed says it is global rank {real} (of {world}): every process"
            " must build its layout with its own rank (rr.ProcessLayout.from_world(pp=...),"
            " or rank=dist.get_rank()); two processes at one rank cannot form a pipeline"
        )
    if layout.world_size > world:
        raise PlanError(
            f"rank {real}: the layout has {layout.world_size} ranks (PP x TP x DP), but the"
            f" torch.distributed world has {world}"
        )


def check_positional(layout: object, schedule: object, executor: object) -> None:
    """Refuse a positional argument of the wrong kind with the call that makes the right
    one: a ``StepPlan`` for the schedule, modules for the executor (otherwise the first use
    fails with an attribute error that names neither the argument nor the fix)."""
    if not isinstance(layout, ProcessLayout):
        raise PlanError(
            f"DistributedStage: layout must be a ProcessLayout, got {describe(layout)}: pass"
            " rr.ProcessLayout.from_world(pp=...) (after dist.init_process_group, under"
            " torchrun or rr.spawn), rr.ProcessLayout.from_mesh(mesh) or"
            " rr.ProcessLayout(pp=..., rank=dist.get_rank())"
        )
    who = f"rank {layout.rank}: DistributedStage"
    if not isinstance(schedule, StepSchedule):
        got = "a StepPlan" if isinstance(schedule, StepPlan) else describe(schedule)
        raise PlanError(
            f"{who}: schedule must be a StepSchedule, got {got}: pass"
            " StepSchedule.build(plan, hint) (hint: a name such as '1f1b' or"
            " 'interleaved_1f1b', see rr.HINTS, or one task order per rank)"
        )
    if not callable(getattr(executor, "execute", None)):
        got = (
            "modules"
            if isinstance(executor, (torch.nn.Module, Mapping, list, tuple))
            else "an object with no execute method"
        )
        raise PlanError(
            f"{who}: executor must have an async execute(task, data, ctx) method, got {got}"
            f" ({describe(executor)}): wrap the modules of this rank's stages as"
            " rr.TorchStageExecutor({stage_index: module}, loss_fn)"
        )


def refuse_unless_open_here(
    who: str, state: str, opened_on: asyncio.AbstractEventLoop | None, running: int | None
) -> None:
    """Refuse a step on a stage that is not open (``state``), on another event loop than
    the one it was opened on (``opened_on``; see ``_dist_stage``'s design note), or while
    step ``running`` runs: before anything changes.

    Raises:
        ClosedError: Not open, or another loop.
        PlanError: A step is running.
    """
    if state != "open":
        why = "was closed (its async with block ended)" if state == "closed" else "is not open yet"
        raise ClosedError(
            f"{who}: run_step on a DistributedStage that {why}; run steps inside"
            " `async with DistributedStage(...) as stage:`"
        )
    loop = asyncio.get_running_loop()
    if loop is not opened_on:
        raise ClosedError(
            f"{who}: run_step on event loop {_loop_name(loop)}, but the stage was"
            f" opened on event loop {_loop_name(opened_on)}; its channel hands every"
            " message to that loop, so this step would wait for messages that never come."
            " Run every step on the loop of the `async with` block (one `rr.run` around"
            " the whole training loop, not one per step), or from synchronous code use"
            " `with DistributedStage(...) as stage:` and `stage.run_step_sync(...)`"
        )
    if running is not None:
        # Refused before anything changes: the running step goes on undisturbed.
        raise PlanError(
            f"{who}: run_step is already running step {running}; a stage runs"
            " one step at a time (await the running step first). This call changed nothing"
        )


def not_open_with_with(who: str, state: str) -> ClosedError:
    """The error of ``run_step_sync`` on a stage that is not open with ``with`` (``state``:
    not yet, no more, or open with ``async with``)."""
    if state == "open":
        how = "it was opened with `async with`: there, run steps with `await stage.run_step(...)`"
    else:
        how = "it is not open yet" if state == "new" else "it was closed"
    return ClosedError(
        f"{who}: run_step_sync runs steps inside `with DistributedStage(...) as stage:`"
        f" (on that block's event loop thread); {how}"
    )
