"""The policy's view of a stage: what a policy (and an observer) may read and await."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Protocol

from .._errors import PolicyError
from .._tasks import Task
from ..policies import StepSchedule
from ._state import StepState
from ._step_run import StepRun

__all__ = ["StageView", "ViewedStage"]


class ViewedStage(Protocol):
    """What the view reads of its stage (a :class:`~rrfp_async.loop.StageLoop`)."""

    @property
    def rank(self) -> int: ...

    @property
    def policy_name(self) -> str: ...

    @property
    def schedule(self) -> StepSchedule: ...


class StageView:
    """The live :class:`~rrfp_async.ReadyView` a stage hands its policy (valid during a step;
    read between steps, it raises ``PolicyError``).

    Args:
        stage: The stage (its rank, policy name and the running step's schedule).
        run: The running step (its state, clock and the wait for a change).
    """

    __slots__ = ("_run", "_s")

    def __init__(self, stage: ViewedStage, run: StepRun) -> None:
        self._s = stage
        self._run = run

    def _st(self) -> StepState:
        st = self._run.state
        if st is None:
            raise self._outside_a_step()
        return st

    def _outside_a_step(self) -> PolicyError:
        """A view read between steps: kept by its policy (or an observer) past its call."""
        name, rank = self._s.policy_name, self._s.rank
        return PolicyError(
            f"policy {name!r} on rank {rank}: its ReadyView was read while no step runs (kept"
            " past the policy's call, or read by an observer after the step ended). The view"
            " is live and valid only during a step: read it inside the policy's call, and"
            " keep values, not the view (ready = list(view.ready), rank = view.hint_rank(t))",
            policy=name,
            rank=rank,
        )

    @property
    def rank(self) -> int:
        return self._s.rank

    @property
    def step(self) -> int:
        return self._st().step

    @property
    def ready(self) -> list[Task]:
        st = self._st()
        order = st.prog.order
        return [order[p] for p in st.admitted()]

    @property
    def blocked(self) -> list[Task]:
        st = self._st()
        adm = set(st.admitted())
        return [st.prog.order[p] for p in st.ready if p not in adm]

    @property
    def next_hinted(self) -> Task:
        st = self._st()
        return st.prog.order[st.ledger.head]

    @property
    def hint(self) -> Sequence[Task]:
        return self._st().prog.order

    def hint_rank(self, task: Task) -> int:
        return self._st().prog.pos[task]

    def is_ready(self, task: Task) -> bool:
        st = self._st()
        pos = st.prog.pos.get(task)
        return pos is not None and pos in st.admitted()

    @property
    def inflight(self) -> int:
        return self._st().ledger.count

    @property
    def max_inflight(self) -> int:
        st = self._st()
        return st.ledger.bound if not st.ledger.bytes else self._s.schedule.bounds[self.rank]

    @property
    def inflight_bytes(self) -> int | None:
        led = self._st().ledger
        return led.inflight if led.bytes else None

    @property
    def budget_bytes(self) -> int | None:
        led = self._st().ledger
        return led.bound if led.bytes else None

    @property
    def remaining(self) -> int:
        return self._st().left

    @property
    def durations(self) -> Mapping[Task, float]:
        return self._st().observed

    def now(self) -> float:
        return self._run.now()

    @property
    def idle_since(self) -> float:
        return self._st().last_end

    @property
    def hinted_deadline(self) -> float | None:
        planned = self._s.schedule.planned(self._s.rank)
        if planned is None:
            return None
        starts, gaps = planned
        st = self._st()
        head = st.ledger.head
        # Every task before the head has started; between decisions they have all ended.
        ends = st.ends
        j = st.prefix_scan
        m = st.prefix_end
        while j < head:
            if ends[j] > m:
                m = ends[j]
            j += 1
        st.prefix_scan = j
        st.prefix_end = m
        if head >= len(gaps):
            return m
        # Late means later than the plan both relative to this rank's own progress (its
        # hint prefix ended at m; the plan foresees a gap) and in absolute terms (a rank
        # ahead of the plan waits for the planned start). Clocks are exact up to float
        # rounding of sums taken in different orders, hence the tiny slack.
        d = max(m + gaps[head], st.t_start + starts[head])
        return d + 1e-9 * (1.0 + abs(d))

    async def wait_until_ready(self, task: Task, timeout: float | None = None) -> bool:
        st = self._st()
        pos = st.prog.pos.get(task)
        if pos is None or st.started[pos]:
            why = "already ran" if pos is not None else "is not a task of this rank"
            raise PolicyError(
                f"policy {self._s.policy_name!r} on rank {self._s.rank} step {st.step} waits for"
                f" {task!r}, which {why}",
                policy=self._s.policy_name,
                rank=self._s.rank,
                step=st.step,
                task=task,
            )
        now = self._run.now
        deadline = None if timeout is None else now() + timeout
        st.awaited = pos
        try:
            while pos not in st.admitted():
                left = None if deadline is None else deadline - now()
                if left is not None and left <= 0:
                    return False
                await self._run.wait(self._reason, left)
        except asyncio.CancelledError:
            st.view_wait = True  # (the watchdog's message: see ``watchdog_error``)
            raise
        finally:
            st.awaited = -1
        return True

    def declared_duration(self, task: Task) -> float | None:
        d = self._s.schedule.declared
        return None if d is None else d.of(task)

    async def wait_for_change(self, timeout: float | None = None) -> bool:
        st = self._st()
        st.changing = True
        try:
            return await self._run.wait(self._reason, timeout)
        except asyncio.CancelledError:
            st.view_wait = True  # (the watchdog's message: see ``watchdog_error``)
            raise
        finally:
            st.changing = False

    def _reason(self) -> str:
        """Why the policy's wait starts nothing (asked only when an observer listens)."""
        return self._st().stall_reason(self._s.policy_name)
