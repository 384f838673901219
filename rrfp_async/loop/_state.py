"""The state of one step on one stage, and the questions asked of it (what is admitted, what
a task waits for). Plain bookkeeping: the stage loop mutates it, the policy's view and the
diagnostics read it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._admission import AdmissionLedger
from .._tasks import StepPlan, Task
from ..policies import RankProgram
from ._executors import TaskContext
from ._records import ExecutedTask

__all__ = ["NO_DATA", "ObservedDurations", "StepState"]

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
    decisions: int = 0
    deviations: int = 0
    deduced: int = 0  # TP follower: decisions deduced, not waited for
    t_start: float = 0.0
    last_end: float = 0.0
    adm_cache: tuple[int, list[int]] = (-1, [])
    awaited: int = -1  # the position a policy waits for (wait_until_ready), or -1
    changing: bool = False  # the policy waits for any change (wait_for_change)
    deciding: bool = False  # the policy's turn: awaited, not returned yet
    policy_at: str = ""  # where the policy was suspended when the step was cancelled
    # The policy was waiting on the ready set (wait_until_ready / wait_for_change) when the
    # step was cancelled: it waited for the step's inputs, as the loop would.
    view_wait: bool = False
    running: int = -1  # the position of the task on the executor, or -1
    leader_wait: int = -1  # TP follower: the decision it awaits from its leader, or -1
    decided: int = -1  # TP follower: the leader's decided task, not ready on this rank yet, or -1
    leader: int | None = None  # TP follower: the leader's global rank, when known
    ends: list[float] = field(default_factory=list)  # per position, once finished
    starts: list[float] = field(default_factory=list)  # per position, once finished
    prefix_scan: int = 0
    prefix_end: float = 0.0

    @property
    def observed(self) -> ObservedDurations:
        """The seconds each task that ended took (``ReadyView.durations``)."""
        return ObservedDurations(self)

    def admitted(self) -> list[int]:
        """Ready positions the admission bound lets start now (cached per version)."""
        if self.adm_cache[0] != self.version:
            self.adm_cache = (self.version, self.ledger.filter_admissible(self.ready))
        return self.adm_cache[1]

    def why(self, pos: int) -> str:
        """What the task at ``pos`` waits for, in words: the messages (which task, from
        which rank) and local tasks it still needs, or why admission holds it back."""
        plan = self.plan
        task = self.prog.order[pos]
        if self.started[pos]:
            if not self.finished[pos]:
                return f"{task} is running (the executor is busy with it)"
            return f"{task} already ran"
        why = []
        for dep in plan.producers(task):
            dpos = self.prog.pos.get(dep)
            if dpos is None:  # a remote producer: its message has not arrived
                if not self.arrived[pos]:
                    why.append(f"message {dep} from rank {plan.rank_of(dep)}")
            elif not self.finished[dpos]:
                why.append(f"local {dep}" + (" (running)" if self.started[dpos] else ""))
        if not why and self.missing[pos] == 0:
            if pos in self.admitted():
                return f"{task} is ready and admitted"
            return f"{task} is ready but admission holds it back: {self.admission_refusal(pos)}"
        return f"{task} <- " + (", ".join(why) if why else "a running task")

    def admission_refusal(self, pos: int) -> str:
        """Why the admission ledger holds the ready forward at ``pos`` back, with the real
        count and bound (see ``_admission``'s design note)."""
        led = self.ledger
        unit = " bytes" if led.bytes else ""
        held = f"{led.inflight}/{led.bound}{unit} in flight"
        if not led.fits_next(pos):
            size = f" {self.prog.order[pos]} needs {led.size_at(pos)}{unit}" if led.bytes else ""
            return f"the admission bound is reached ({held}){size}"
        need = led.reserve_before(pos)
        return (
            f"{held} and the tasks hinted before"
            f" {self.prog.order[pos]} that have not started still need {need}{unit} more"
        )

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

    def _tasks(self, positions: Sequence[int]) -> str:
        return " ".join(str(self.prog.order[p]) for p in positions)

    def _inputs(self) -> str:
        waits = list(self.waiting_for(limit=3))
        return "waiting for " + ("; ".join(waits) if waits else "nothing")

    def stall_reason(self, policy: str = "the policy") -> str:
        """Why this stage starts nothing now, in words, naming the actual blocker first.

        In the order it is checked: a task running on the executor; a TP follower waiting
        for its leader's decision, or for the task the leader decided to become ready on this rank;
        the policy waiting for one task (``wait_until_ready``: which task, what that task
        waits for, and the ready tasks the policy holds back meanwhile) or for any change
        (``wait_for_change``: the policy chose to wait); a policy that has not returned
        from its turn otherwise (it overran it); ready tasks that the admission bound
        holds back (with the real count and bound); otherwise the inputs (messages and
        local tasks) the next tasks in hint order wait for.

        Args:
            policy: The policy's name, to say whose choice a wait is.
        """
        order = self.prog.order
        if self.running >= 0:
            return f"{order[self.running]} is running (the executor is busy with it)"
        if self.leader_wait >= 0:
            leader = "" if self.leader is None else f" (global rank {self.leader})"
            return (
                f"TP follower waits for decision {self.leader_wait} of step {self.step} from"
                f" the TP leader{leader}"
            )
        if self.decided >= 0:
            return (
                f"TP follower waits for {self.why(self.decided)} (the TP leader's decision"
                f" {self.decisions})"
            )
        adm = self.admitted()
        if self.awaited >= 0:
            pos = self.awaited
            hinted = " (the next hinted task)" if pos == self.ledger.head else ""
            text = f"policy {policy} waits for {self.why(pos)}{hinted}"
            if adm:
                text += f"; it holds back ready {self._tasks(adm)}"
            return text
        if self.changing:
            text = f"policy {policy} chose to wait (for a change of the ready set)"
            if adm:
                text += f"; it holds back ready {self._tasks(adm)}"
            else:
                text += f"; nothing is admitted: {self._stalled()}"
            return text
        if self.deciding:  # its turn, and it neither returned nor waits through the view
            return (
                f"policy {policy} has not returned its choice among ready and admitted"
                f" {self._tasks(adm) if adm else '-'}: it blocks, or awaits something other"
                " than the view's waits (wait_until_ready, wait_for_change); the stage runs"
                " nothing until it returns"
            )
        if adm:  # not a stall: the loop is about to ask the policy
            return f"ready and admitted: {self._tasks(adm)}"
        return self._stalled()

    def _stalled(self) -> str:
        """Nothing is admitted: the admission bound holds ready tasks back, or the next
        tasks' inputs have not arrived."""
        held = [p for p in self.ready if p not in self.admitted()]
        if not held:
            return self._inputs()
        led = self.ledger
        if not any(led.fits_next(p) for p in held):
            unit = " bytes" if led.bytes else ""
            text = (
                f"admission bound reached ({led.inflight}/{led.bound}{unit} in flight): it"
                f" holds back ready {self._tasks(held)} until a backward frees an activation"
            )
        else:
            text = (
                f"admission holds back ready {self._tasks(held)}: {self.admission_refusal(held[0])}"
            )
        waits = list(self.waiting_for(limit=2))
        return text + ("; waiting for " + "; ".join(waits) if waits else "")


class ObservedDurations(Mapping[Task, float]):
    """The seconds each task of a step that ended took, by task, in the order they ended.

    A view of the step's state (``starts``/``ends`` per position), not a dict filled per
    task: a dict insert per task was a tenth of a 128 x 1024 simulated step's run (its
    cost per task grew with the step, the dicts outgrowing the caches).
    """

    __slots__ = ("_st",)

    def __init__(self, st: StepState) -> None:
        self._st = st

    def __getitem__(self, task: Task) -> float:
        st = self._st
        pos = st.prog.pos.get(task)
        if pos is None or not st.finished[pos]:
            raise KeyError(task)
        return st.ends[pos] - st.starts[pos]

    def __iter__(self) -> Iterator[Task]:
        return (e.task for e in self._st.executed)

    def __len__(self) -> int:
        return len(self._st.executed)
