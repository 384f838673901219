"""Running a simulated step on the virtual loop, and saying why one cannot finish.

The guards themselves are the ``VirtualEventLoop``'s (``stall_when_idle``, ``time_limit``,
``wall_limit``); this module turns what they raise into errors that name the policy and
what it awaits, and unwinds the stages' coroutines before the loop closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Sequence
from typing import Any

from .._errors import DeadlockError, PolicyError, RRFPError, StepTimeoutError
from ..loop import (
    LocalPipeline,
    StageLoop,
    StepStats,
    VirtualClockStall,
    VirtualEventLoop,
    VirtualTimeLimit,
    deadlock_grid,
    policy_awaits,
)

__all__ = ["run_virtual"]

# What cancelled coroutines get to unwind after a failure, in real and in virtual seconds.
_UNWIND_WALL = 1.0
_UNWIND_TIME = 60.0


# Design note
# -----------
# The step runs as one task on a fresh VirtualEventLoop with ``stall_when_idle`` and both
# limits. When a guard fires, the loop raises out of ``run_until_complete`` with every
# coroutine still suspended where it waits; ``_diagnose`` asks the loop which policy has not
# returned on which rank and what it awaits (``policy_awaits``, which reads the coroutine
# chains), then ``_unwind`` cancels every task and runs the loop again (briefly, with a
# fresh wall limit) so that they unwind before the loop closes. A policy that raises
# ``CancelledError`` itself ends its stage's task as *cancelled*, which a task group does
# not treat as a failure: its peers then wait forever (a stall) or the step "returns" a
# cancellation; either way ``_diagnose`` finds the rank that left its step without
# finishing it.


def _describe(pipe: LocalPipeline, loop: asyncio.AbstractEventLoop) -> list[str]:
    """One line per rank: finished, in its policy (and what that awaits), or waiting."""
    policies = policy_awaits(asyncio.all_tasks(loop))
    lines = []
    for s in pipe.stages:
        reason = s.stall_reason()
        if reason is None:
            lines.append(f"rank {s.rank}: finished its step")
        elif s.rank in policies:
            awaited = s.policy_waits_for()
            extra = f"; it waits for {awaited}" if awaited is not None else ""
            lines.append(
                f"rank {s.rank}: policy {s.policy_name!r} was called and has not returned: it"
                f" awaits {policies[s.rank]}{extra}"
            )
        else:
            lines.append(f"rank {s.rank}: {reason}")
    return lines


def _cancelled_rank(pipe: LocalPipeline) -> StageLoop | None:
    """A stage that left its step without finishing it and without an error: its coroutine
    raised ``CancelledError`` that no one asked for (any other exception fails the step)."""
    active = pipe.unfinished_ranks
    for s in pipe.stages:
        if s.step is None and s.rank in active:
            return s
    return None


def _policy_cancelled(stage: StageLoop) -> PolicyError:
    return PolicyError(
        f"policy {stage.policy_name!r} on rank {stage.rank} step 0 raised"
        " asyncio.CancelledError, though nothing cancelled the step; a policy must return one"
        " of view.ready (to give up, raise an ordinary exception)",
        policy=stage.policy_name,
        rank=stage.rank,
        step=0,
    )


def _diagnose(
    pipe: LocalPipeline, loop: asyncio.AbstractEventLoop, stop: RRFPError, limit_note: str
) -> RRFPError:
    """The typed error for a simulation the loop had to stop."""
    gone = _cancelled_rank(pipe)
    if gone is not None:
        return _policy_cancelled(gone)
    lines = "\n".join(_describe(pipe, loop))
    if isinstance(stop, VirtualTimeLimit):
        if stop.limit == "time_limit":
            what = f"time_limit={stop.value:.6g} virtual seconds ({limit_note})"
        else:
            what = f"wall_limit={stop.value:.6g} real seconds (pass wall_limit= to change it)"
        return StepTimeoutError(f"simulated step 0 ran past {what} without finishing:\n{lines}")
    return DeadlockError(
        "simulated step 0 cannot finish: nothing is scheduled (no task runs, no message is"
        " in flight, no timer is set) while ranks still wait, so no event can ever come:\n"
        f"{lines}\nrank x task grid (* = ready but not chosen or not admitted):",
        step=0,
        grid=deadlock_grid(pipe.stages),
    )


def _unwind(loop: VirtualEventLoop) -> None:
    """Cancel every task of ``loop`` and let them unwind (bounded: the coroutines of a task
    that ignores its cancellation are closed, which runs their ``finally`` blocks)."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for t in tasks:
        t.cancel()
    loop.set_limits(time_limit=loop.time() + _UNWIND_TIME, wall_limit=_UNWIND_WALL)
    try:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    except (VirtualClockStall, VirtualTimeLimit):
        for t in asyncio.all_tasks(loop):
            # The error that stopped the step is raised already; the task is dropped on
            # purpose, not "destroyed but pending" by accident.
            setattr(t, "_log_destroy_pending", False)  # noqa: B010
            with contextlib.suppress(RuntimeError):  # it ignored GeneratorExit too
                t.get_coro().close()


def run_virtual(
    pipe: LocalPipeline,
    microbatches: Sequence[Any],
    *,
    time_limit: float | None,
    wall_limit: float | None,
    limit_note: str,
) -> list[StepStats]:
    def go() -> list[StepStats]:
        loop = VirtualEventLoop(
            stall_when_idle=True,
            time_limit=time_limit,
            wall_limit=wall_limit,
        )
        try:
            task = loop.create_task(pipe.run_step(microbatches, step=0))
            err: RRFPError
            try:
                return loop.run_until_complete(task)
            except (VirtualClockStall, VirtualTimeLimit) as e:
                err = _diagnose(pipe, loop, e, limit_note)
                err.__cause__ = e
            except asyncio.CancelledError as e:
                gone = _cancelled_rank(pipe) or pipe.stages[0]
                err = _policy_cancelled(gone)
                err.__cause__ = e
            _unwind(loop)
            raise err
        finally:
            loop.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return go()
    # Called from inside a running loop (embedded use): simulate on a helper thread, since
    # one thread cannot run two loops at once.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(go).result()


# ---------------------------------------------------------------------- the public call
