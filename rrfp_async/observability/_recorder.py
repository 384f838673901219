"""Observers that record: ``TraceRecorder`` keeps what a trace shows, ``MultiObserver`` fans
every transition out to several observers.

``TraceRecorder`` is a ``StageObserver``: it appends compute spans, message sends and
arrivals, ready times, decisions and per-step stats to a ``TraceData`` (cheap appends of
named-tuple rows), which travels between processes and merges. It also keeps the tasks that
started and have not ended, so that a step that fails (``failure``) says what was running.
It reads the stage only through its public surface (``rank``, ``step``, ``now()``,
``view``, ``schedule``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._tasks import Task
from ._trace_data import Arrival, Decision, Failure, Ready, Send, Span, StepRecord, TraceData

if TYPE_CHECKING:
    from ..loop import StageLoop, StepStats

__all__ = ["MultiObserver", "TraceRecorder"]


class TraceRecorder:
    """A ``StageObserver`` that records everything a trace shows (cheap appends).

    Args:
        peers: Pipeline rank -> lane (global rank) of this process's peers; default: lanes
            are pipeline ranks (one process per stage, or a simulation).
    """

    active = True

    def __init__(self, peers: Mapping[int, int] | None = None) -> None:
        self.peers = dict(peers) if peers is not None else None
        self.data = TraceData()
        # (step, task) -> start, of the tasks that started and have not ended yet.
        self._running: dict[tuple[int, str], float] = {}

    def _lane(self, pp_rank: int) -> int:
        return pp_rank if self.peers is None else self.peers[pp_rank]

    def _step(self, stage: StageLoop) -> int:
        # Observers are called only during a step, so the stage always has one here.
        step = stage.step
        assert step is not None
        return step

    def step_start(self, stage: StageLoop) -> None:
        self._running.clear()  # a failed step's tasks that never ended

    def message(self, stage: StageLoop, task: Task, src: int) -> None:
        self.data.arrivals.append(
            Arrival(
                lane=self._lane(stage.rank),
                step=self._step(stage),
                task=str(task),
                src=self._lane(src),
                time=stage.now(),
            )
        )

    def ready(self, stage: StageLoop, task: Task) -> None:
        self.data.ready.append(
            Ready(
                lane=self._lane(stage.rank),
                step=self._step(stage),
                task=str(task),
                time=stage.now(),
            )
        )

    def decision(self, stage: StageLoop, task: Task, ready: Sequence[Task], idle: float) -> None:
        view = stage.view
        self.data.decisions.append(
            Decision(
                lane=self._lane(stage.rank),
                step=self._step(stage),
                time=stage.now(),
                chosen=str(task),
                hinted=str(view.next_hinted),
                ready={str(t): view.hint_rank(t) for t in ready},
                idle=idle,
            )
        )

    def task_start(self, stage: StageLoop, task: Task) -> None:
        self._running[(self._step(stage), str(task))] = stage.now()

    def task_end(self, stage: StageLoop, task: Task, start: float, end: float) -> None:
        lane, step = self._lane(stage.rank), self._step(stage)
        self._running.pop((step, str(task)), None)
        self.data.spans.append(Span(lane=lane, step=step, task=str(task), start=start, end=end))
        prog = stage.schedule.program(stage.rank)
        remote = prog.data_remote[prog.pos[task]]
        if remote is not None:
            dst, consumer = remote
            self.data.sends.append(
                Send(lane=lane, step=step, task=str(consumer), dst=self._lane(dst), time=end)
            )

    def stall(self, stage: StageLoop, reason: str) -> None:
        pass

    def tp_decision(self, stage: StageLoop, task: Task, seq: int, sent: bool) -> None:
        pass

    def step_end(self, stage: StageLoop, stats: StepStats) -> None:
        self.data.steps.append(
            StepRecord(
                lane=self._lane(stage.rank),
                step=stats.step,
                stats={
                    "stage": stage.rank,
                    "policy": stats.policy,
                    "hint": stats.hint,
                    "started": stats.started,
                    "finished": stats.finished,
                    "busy": stats.busy,
                    "peak_inflight": stats.peak_inflight,
                    "max_inflight": stats.max_inflight,
                    "deviations": stats.deviations,
                    "decisions": stats.decisions,
                },
            )
        )

    def failure(self, lane: int, step: int, time: float, exc: BaseException) -> Failure:
        """Record that ``step`` failed on ``lane`` at ``time`` (stage clock) with ``exc``,
        with the tasks it had started and not ended; returns the row (also in ``data``).

        Called by whoever runs the step (``DistributedStage``), not by the loop: a step also
        fails outside the loop (the plan check, the end-of-step agreement).
        """
        running = {t: s for (st, t), s in self._running.items() if st == step}
        for t in running:
            del self._running[(step, t)]
        row = Failure(lane, step, time, type(exc).__name__, _message(exc), running)
        self.data.failures.append(row)
        return row


#: The longest error message a failure row keeps (a watchdog's carries a state dump).
MAX_FAILURE_MESSAGE = 4000


def _message(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > MAX_FAILURE_MESSAGE:
        text = (
            text[:MAX_FAILURE_MESSAGE] + f" ... ({len(text) - MAX_FAILURE_MESSAGE} more characters)"
        )
    return text


class MultiObserver:
    """Fans every transition out to several observers (e.g. a logger and a recorder)."""

    def __init__(self, *observers: Any) -> None:
        self.observers = [o for o in observers if o is not None]
        self._live: list[Any] = []

    # The loop's optional observer hooks are imported where they are read: a stage reads
    # them, so the loop is imported by then, and ``import rrfp_async.observability`` stays
    # free of torch.

    @property
    def active(self) -> bool:
        """True when any observer is active (the inactive ones are skipped this step; one
        without ``active`` is, as for a stage, always active)."""
        from ..loop import ActiveObserver

        self._live = [o for o in self.observers if not isinstance(o, ActiveObserver) or o.active]
        return bool(self._live)

    def failed(self, stage: StageLoop, exc: BaseException, dump: str) -> None:
        """Every observer that has ``failed`` (``loop.FailedObserver``) gets it, active or
        not."""
        from ..loop import FailedObserver

        for o in self.observers:
            if isinstance(o, FailedObserver):
                o.failed(stage, exc, dump)

    def __getattr__(self, name: str) -> Any:
        def fan(*args: Any) -> None:
            for o in self._live:
                getattr(o, name)(*args)

        return fan
