"""The state of one step on one stage, and the questions asked of it (what is admitted, what
a task waits for). Plain bookkeeping: the stage loop mutates it, the policy's view and the
diagnostics read it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._admission import AdmissionLedger
from .._tasks import StepPlan, Task
from ..policies._schedule import RankProgram
from ._executors import TaskContext
from ._records import ExecutedTask

__all__ = ["NO_DATA", "StepState"]

#: Marks an inbox slot whose input has not arrived (or was consumed).
NO_DATA = object()


@dataclass(eq=False)
class StepState:
    """One step on one stage. Positions (``pos``) index the rank's hinted order
    (``prog.order``); per-position flags are bytearrays for speed."""

    step: int
    plan: StepPlan
    prog: RankProgram
    ledger: AdmissionLedger
    microbatches: Sequence[Any]
    ctx: TaskContext
    missing: list[int]  # inputs not yet present, per position
    arrived: bytearray  # the remote input has arrived
    started: bytearray
    finished: bytearray
    inbox: list[Any]  # the input of each position (NO_DATA until present)
    ready: list[int] = field(default_factory=list)  # sorted positions, all inputs present
    left: int = 0  # tasks not started
    version: int = 0  # bumped on every change of ready/started/finished
    executed: list[ExecutedTask] = field(default_factory=list)
    observed: dict[Task, float] = field(default_factory=dict)
    decisions: int = 0
    deviations: int = 0
    t_start: float = 0.0
    last_end: float = 0.0
    adm_cache: tuple[int, list[int]] = (-1, [])
    awaited: int = -1  # the position a policy waits for (wait_until_ready), or -1
    ends: list[float] = field(default_factory=list)
    prefix_scan: int = 0
    prefix_end: float = 0.0
    running: int = -1  # the position on the executor now, or -1

    def admitted(self) -> list[int]:
        """Ready positions the admission bound lets start now (cached per version)."""
        if self.adm_cache[0] != self.version:
            self.adm_cache = (self.version, self.ledger.filter_admissible(self.ready))
        return self.adm_cache[1]

    def why(self, pos: int) -> str:
        """What the task at ``pos`` waits for, in words."""
        plan = self.plan
        task = self.prog.order[pos]
        if self.started[pos]:
            return f"{task} already started"
        why = []
        for dep in plan.producers(task):
            dpos = self.prog.pos.get(dep)
            if dpos is None:  # a remote producer: its message has not arrived
                if not self.arrived[pos]:
                    why.append(f"message {dep} from rank {plan.rank_of(dep)}")
            elif not self.finished[dpos]:
                why.append(f"local {dep}" + (" (running)" if self.started[dpos] else ""))
        if not why and self.missing[pos] == 0:
            led = self.ledger
            return f"{task} is ready but not admitted ({led.inflight}/{led.bound} in flight)"
        return f"{task} <- " + (", ".join(why) if why else "a running task")

    def waiting_for(self, limit: int | None = None) -> Iterator[str]:
        """What the next unstarted, not-ready tasks (in hint order) wait for, one line each."""
        n = 0
        for pos in range(self.ledger.head, len(self.prog.order)):
            if self.started[pos] or self.missing[pos] == 0:
                continue
            yield self.why(pos)
            n += 1
            if limit is not None and n >= limit:
                return

    def stall_reason(self) -> str:
        """Why nothing can start now, in words."""
        if self.ready:
            return (
                f"admission bound reached ({self.ledger.inflight}/{self.ledger.bound} in"
                f" flight); held back: {' '.join(str(self.prog.order[p]) for p in self.ready)}"
            )
        waits = list(self.waiting_for(limit=3))
        return "waiting for " + ("; ".join(waits) if waits else "nothing")
