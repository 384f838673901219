"""Planning the next step while this one runs: ``PlanAhead``.

A cost-aware hint is built from the step's own sizes (``StepSchedule.with_durations``). At
P = 16 x M = 64 that is a pure-Python list schedule of 2048 tasks (two, under a byte budget,
plus the checks): tens of milliseconds on a CPU core (``scripts/planner_cost.py``;
BENCHMARKS.md, "Speed at equal bytes"), too much to pay between two steps. The sizes of
step N+1 are known before step N ends (the data loader prefetches its batch), so the plan
for N+1 can be built while step N runs and be ready when it ends.

``PlanAhead`` owns one worker thread. ``submit`` hands it ``schedule.with_durations(...)``
and returns at once with a ``concurrent.futures.Future``; ``result()`` on it after step N
is the schedule for N+1 (or the ``PlanError`` / ``HintError`` the build raised), exactly what
the inline call returns. One thread, so builds finish in the order they were submitted.

What it costs: the build still runs on the host, in Python. It takes the interpreter's lock
only while the step's thread does not need it, but when both want it, the step's thread
waits up to ``sys.getswitchinterval()`` (5 ms by default) for its turn: a step whose host
is busy every moment (a CPU run of small stages) gains nothing. A step that waits on the
device (CUDA events, gloo waits in their threads: the lock is free while they wait) has the
room to hide it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from .._check import check_type
from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes
from ._schedule import StepSchedule

__all__ = ["PlanAhead"]


class PlanAhead:
    """Builds the next step's schedule on a worker thread while the current step runs.

    Example::

        with rr.policies.PlanAhead() as ahead:
            pending = ahead.submit(schedule, durations_of(batch[1]), activation_bytes=b1)
            run_step(schedule, batch[0])  # step N on its own schedule
            schedule = pending.result()  # step N+1's, built meanwhile

    ``submit(schedule, durations, activation_bytes=...)`` computes exactly
    ``schedule.with_durations(durations, activation_bytes)``; the future's ``result()``
    returns that schedule or raises what it raised. Close it (or leave the ``with``) when
    done: the worker thread ends after the builds already submitted.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rrfp-plan-ahead")
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self,
        schedule: StepSchedule,
        durations: Durations | None,
        activation_bytes: ActivationBytes | None = None,
    ) -> Future[StepSchedule]:
        """Start building ``schedule.with_durations(durations, activation_bytes)``.

        Args:
            schedule: The schedule to derive the next step's from (its hint source, bounds
                or byte budget rule).
            durations: The next step's declared durations.
            activation_bytes: The next step's activation bytes (a byte-budget schedule).

        Returns:
            A future whose ``result()`` is the next step's schedule.

        Raises:
            PlanError: ``schedule`` is not a ``StepSchedule``, or this ``PlanAhead`` is
                closed. What the build itself raises comes from ``result()``.
        """
        check_type("schedule", schedule, StepSchedule, "a StepSchedule")
        with self._lock:
            if self._closed:
                raise PlanError("PlanAhead is closed: submit the next step's plan before close()")
            return self._pool.submit(schedule.with_durations, durations, activation_bytes)

    def close(self) -> None:
        """Stop taking builds; wait for those already submitted. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> PlanAhead:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
