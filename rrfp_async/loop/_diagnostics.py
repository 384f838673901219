"""Diagnostics of stages: the state dump of a failed step and the deadlock grid."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol

from .._errors import DeadlockError
from .._tasks import Task
from ..policies import StepSchedule
from ._state import StepState

__all__ = ["deadlock_grid", "dump", "make_deadlock"]


class Diagnosed(Protocol):
    """What the diagnostics read of a stage (a :class:`~rrfp_async.loop.StageLoop`)."""

    rank: int
    policy_name: str
    schedule: StepSchedule
    recent: collections.deque[tuple[float, str, Task]] | None
    _st: StepState | None


def dump(stage: Diagnosed, recent: bool = False) -> str:
    """A readable snapshot of a stage: ready set, in-flight, what waiting tasks wait for
    (and, with ``recent``, the last events of its flight recorder)."""
    st = stage._st
    if st is None:
        return f"rank {stage.rank}: idle (no step running)"
    order = st.prog.order
    ready = " ".join(str(order[p]) for p in st.ready) or "-"
    adm = " ".join(str(order[p]) for p in st.admitted()) or "-"
    head = order[st.ledger.head] if st.ledger.head < len(order) else None
    lines = [
        f"rank {stage.rank} step {st.step} policy {stage.policy_name} hint"
        f" {stage.schedule.hint_name}: {len(order) - st.left}/{len(order)} tasks started,"
        f" in flight {st.ledger.inflight}/{st.ledger.bound}",
        f"  next hinted: {head}",
        f"  ready: {ready}",
        f"  admitted: {adm}",
        f"  now: {st.stall_reason(stage.policy_name)}",
    ]
    lines += [f"  waits: {w}" for w in st.waiting_for(limit=6)]
    events = stage.recent
    if recent and events:
        t_end = events[-1][0]
        lines.append(f"  last {len(events)} events (seconds before the last):")
        lines += [f"    -{t_end - t:.6f} {what} {detail}" for t, what, detail in events]
    return "\n".join(lines)


def deadlock_grid(stages: Sequence[Diagnosed], width: int = 8) -> str:
    """The rank x task grid of a deadlocked step: each rank's next unstarted tasks in hint
    order (``*`` marks ready ones) and why the rank starts nothing (``stall_reason``)."""
    lines = []
    for s in stages:
        st = s._st
        if st is None:
            lines.append(f"rank {s.rank:>3} | finished")
            continue
        order = st.prog.order
        cells = []
        for pos in range(st.ledger.head, len(order)):
            if st.started[pos]:
                continue
            mark = "*" if st.missing[pos] == 0 else " "
            cells.append(f"{order[pos]!s:>6}{mark}")
            if len(cells) >= width:
                break
        first = st.stall_reason(s.policy_name)
        lines.append(
            f"rank {s.rank:>3} | {' '.join(cells)} | in flight {st.ledger.inflight}/"
            f"{st.ledger.bound} | {first}  <-- WAITING"
        )
    return "\n".join(lines)


def make_deadlock(stages: Sequence[Diagnosed], step: int) -> DeadlockError:
    """The ``DeadlockError`` for ``stages`` (all blocked, nothing in flight)."""
    return DeadlockError(
        f"step {step} cannot finish: no task is ready, none is running and no message is in"
        " flight (* = ready but not chosen or not admitted)",
        step=step,
        grid=deadlock_grid(stages),
    )
