"""Diagnostics of stages: the state dump of a failed step, the deadlock grid, and what a
policy that has not returned awaits."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .._errors import DeadlockError
from ._decide import Decider
from ._follow import Follower
from ._state import StepState
from ._step_run import FlightRecorder, StepRun
from ._task_runner import TaskRunner

__all__ = ["deadlock_grid", "dump", "grid_row", "make_deadlock", "policy_awaits"]


class Diagnosed(Protocol):
    """What the deadlock grid reads of a stage (a :class:`~rrfp_async.loop.StageLoop`)."""

    def grid_row(self, width: int = 8) -> str:
        """This stage's row of the deadlock grid (``grid_row`` below)."""


def dump(
    rank: int,
    policy_name: str,
    hint_name: str,
    st: StepState | None,
    events: FlightRecorder | None = None,
) -> str:
    """A readable snapshot of a stage: ready set, in-flight, what waiting tasks wait for
    (and, given ``events``, the last events of its flight recorder).

    Args:
        rank: The stage's pipeline rank.
        policy_name: Its policy's name.
        hint_name: The running step's hint's name.
        st: The running step's state (None: the stage is idle).
        events: The flight recorder to list, or None.
    """
    if st is None:
        return f"rank {rank}: idle (no step running)"
    order = st.prog.order
    ready = " ".join(str(order[p]) for p in st.ready) or "-"
    adm = " ".join(str(order[p]) for p in st.admitted()) or "-"
    head = order[st.ledger.head] if st.ledger.head < len(order) else None
    lines = [
        f"rank {rank} step {st.step} policy {policy_name} hint"
        f" {hint_name}: {len(order) - st.left}/{len(order)} tasks started,"
        f" in flight {st.ledger.inflight}/{st.ledger.bound}",
        f"  next hinted: {head}",
        f"  ready: {ready}",
        f"  admitted: {adm}",
        f"  now: {st.stall_reason(policy_name)}",
    ]
    lines += [f"  waits: {w}" for w in st.waiting_for(limit=6)]
    if events:
        t_end = events[-1][0]
        lines.append(f"  last {len(events)} events (seconds before the last):")
        lines += [f"    -{t_end - t:.6f} {what} {detail}" for t, what, detail in events]
    return "\n".join(lines)


def grid_row(rank: int, policy_name: str, st: StepState | None, width: int = 8) -> str:
    """A stage's row of the deadlock grid: its next unstarted tasks in hint order (``*``
    marks ready ones, at most ``width``) and why it starts nothing (``stall_reason``)."""
    if st is None:
        return f"rank {rank:>3} | finished"
    order = st.prog.order
    cells = []
    for pos in range(st.ledger.head, len(order)):
        if st.started[pos]:
            continue
        mark = "*" if st.missing[pos] == 0 else " "
        cells.append(f"{order[pos]!s:>6}{mark}")
        if len(cells) >= width:
            break
    first = st.stall_reason(policy_name)
    return (
        f"rank {rank:>3} | {' '.join(cells)} | in flight {st.ledger.inflight}/"
        f"{st.ledger.bound} | {first}  <-- WAITING"
    )


def deadlock_grid(stages: Sequence[Diagnosed], width: int = 8) -> str:
    """The rank x task grid of a deadlocked step: each rank's next unstarted tasks in hint
    order (``*`` marks ready ones) and why the rank starts nothing (``stall_reason``)."""
    return "\n".join(s.grid_row(width) for s in stages)


def make_deadlock(stages: Sequence[Diagnosed], step: int) -> DeadlockError:
    """The ``DeadlockError`` for ``stages`` (all blocked, nothing in flight)."""
    return DeadlockError(
        f"step {step} cannot finish: no task is ready, none is running and no message is in"
        " flight (* = ready but not chosen or not admitted)",
        step=step,
        grid=deadlock_grid(stages),
    )


# What a policy awaits
# --------------------
# A step that cannot finish on a virtual loop (the simulator) stops with every coroutine
# suspended where it waits. A rank whose dispatcher is in its policy's turn shows, in its
# task's coroutine chain, the dispatcher's frame followed by the policy's frames; the last
# one says what the policy awaits. The chain is read from the dispatchers' own code, inside
# the loop package, so that no caller needs to know how the dispatch is written.

_DISPATCH = (Decider.dispatch.__code__, Follower.dispatch.__code__)
_STEP_WAIT = StepRun.wait.__code__
_EXECUTE = TaskRunner.execute.__code__


def _frames(obj: Any) -> list[types.FrameType | None]:
    """The frames of a suspended coroutine chain, outermost first (None: a bare future)."""
    out: list[types.FrameType | None] = []
    seen = 0
    while obj is not None and seen < 200:
        seen += 1
        # A coroutine has cr_*, a generator-based awaitable gi_*; a future has neither.
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        out.append(frame)
        nxt = getattr(obj, "cr_await", None)
        if nxt is None:
            nxt = getattr(obj, "gi_yieldfrom", None)
        obj = nxt
    return out


def _where(frame: types.FrameType) -> str:
    code = frame.f_code
    return f"{code.co_qualname} ({code.co_filename}:{frame.f_lineno})"


def policy_awaits(tasks: Iterable[asyncio.Task[Any]]) -> dict[int, str]:
    """For each rank whose policy was called and has not returned, among the stages that
    ``tasks`` (suspended asyncio tasks) run: what it awaits (a function and where it is).

    A rank whose dispatcher waits itself (admission) or runs a task is not listed, nor one
    whose policy waits through its view (the stage's stall reason says that)."""
    out: dict[int, str] = {}
    for task in tasks:
        frames = _frames(task.get_coro())
        for i, fr in enumerate(frames):
            if fr is None or fr.f_code not in _DISPATCH:
                continue
            dispatcher = fr.f_locals.get("self")
            rest = [f for f in frames[i + 1 :] if f is not None]
            if not isinstance(dispatcher, (Decider, Follower)) or not rest:
                break
            if rest[0].f_code in (_STEP_WAIT, _EXECUTE):
                break  # the stage itself waits (admission) or runs a task: no policy call
            policy, leaf = rest[0], rest[-1]
            if leaf.f_code is _STEP_WAIT:
                break  # the policy waits through its view: the stage's stall reason says it
            if leaf is policy:
                what = f"a future at {_where(policy)}"
            else:
                what = f"{leaf.f_code.co_qualname} ({leaf.f_code.co_filename}:{leaf.f_lineno})"
                what += f", called from {_where(policy)}"
            out[dispatcher.rank] = what
            break
    return out
