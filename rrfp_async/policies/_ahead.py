"""Planning the next step while this one runs: ``PlanAhead``.

A cost-aware hint is built from the step's own sizes (``StepSchedule.with_durations``). At
P = 16 x M = 64 that is a pure-Python list schedule of 2048 tasks (two, under a byte budget):
more than a step should pay between two steps (``scripts/planner_cost.py``; BENCHMARKS.md,
"Planning cost"). The sizes of step N+1 are known before step N ends (the data loader
prefetches its batch), so the plan for N+1 can be built while step N runs and be ready when
it ends.

``PlanAhead`` owns one worker. ``submit`` hands it ``schedule.with_durations(...)`` and
returns at once with a ``concurrent.futures.Future``; ``result()`` on it after step N is the
schedule for N+1 (or the ``PlanError`` / ``HintError`` the build raised), equal to what the
inline call returns. One worker, so builds finish in the order they were submitted.

The worker is a process by default (``worker="process"``, started with ``spawn``): a build
in a thread holds the interpreter's lock for milliseconds in slices, and the step's loop
can wake late while it runs (by up to ``sys.getswitchinterval()``, or more on a busy host;
``scripts/planner_cost.py`` measures it). The process keeps the schedules it built, so a
step derived from the previous result sends only its durations and bytes; what comes back
is the pickled schedule, unpickled on the pool's result thread. ``worker="thread"`` avoids
the process (its start, and the pickling: a hint generator given as a function must be
importable by name to cross it) at the cost of that lateness.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from types import TracebackType
from typing import Literal

from .._check import check_type, describe
from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes
from ._schedule import StepSchedule

__all__ = ["PlanAhead"]


class _Evicted(LookupError):
    """The worker no longer holds the schedule a submit derives from."""


# In the worker process: the schedules it built or was sent, by the key the parent gave
# them (the last few: a loop derives each step from the previous one).
_KEPT: dict[int, StepSchedule] = {}
_KEEP = 4


def _derive(
    key: int,
    schedule: StepSchedule | None,
    durations: Durations | None,
    nbytes: ActivationBytes | None,
    new_key: int,
) -> StepSchedule:
    """Worker side: ``with_durations`` on the schedule sent now or kept under ``key``."""
    base = schedule if schedule is not None else _KEPT.get(key)
    if base is None:  # evicted: the parent sends it again (``PlanAhead._relay``)
        raise _Evicted(key)
    out = base.with_durations(durations, nbytes)
    _KEPT[key] = base
    _KEPT[new_key] = out
    while len(_KEPT) > _KEEP:
        del _KEPT[next(iter(_KEPT))]
    return out


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

    def __init__(self, *, worker: Literal["process", "thread"] = "process") -> None:
        """Args:
            worker: ``"process"`` (the default: the build does not share the interpreter's
                lock with the step) or ``"thread"``.

        Raises:
            PlanError: Another ``worker``.
        """
        if worker not in ("process", "thread"):
            raise PlanError(
                f"PlanAhead(worker=) must be 'process' or 'thread', got {describe(worker)}"
            )
        self._pool: Executor
        if worker == "process":
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            )
        else:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rrfp-plan-ahead")
        self.worker = worker
        self._lock = threading.Lock()
        self._closed = False
        # Which schedules the worker process holds (those it built, or was sent): the key
        # it knows each by. Weak: a schedule the loop dropped is forgotten here too.
        self._keys: weakref.WeakKeyDictionary[StepSchedule, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count(1)

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
            if self.worker == "thread":
                return self._pool.submit(schedule.with_durations, durations, activation_bytes)
            key = self._keys.get(schedule)
            sent = None
            if key is None:  # the worker has not seen it: send it once
                key = next(self._next)
                sent = schedule
                self._keys[schedule] = key
            new_key = next(self._next)
            args = (key, sent, durations, activation_bytes, new_key)
            inner = self._pool.submit(_derive, *args)
        out: Future[StepSchedule] = Future()
        inner.add_done_callback(self._relay(out, schedule, args))
        return out

    def _relay(
        self,
        out: Future[StepSchedule],
        schedule: StepSchedule,
        args: tuple[int, StepSchedule | None, Durations | None, ActivationBytes | None, int],
    ) -> Callable[[Future[StepSchedule]], None]:
        """Hand the worker's result to ``out``, remembering that the worker holds it (or
        send the schedule again if the worker had let it go)."""
        key, _, durations, nbytes, new_key = args

        def done(inner: Future[StepSchedule]) -> None:
            exc = inner.exception()
            if isinstance(exc, _Evicted):
                try:
                    again = self._pool.submit(_derive, key, schedule, durations, nbytes, new_key)
                except RuntimeError as e:  # closed meanwhile
                    out.set_exception(e)
                    return
                again.add_done_callback(done)
                return
            if exc is not None:
                out.set_exception(exc)
                return
            result = inner.result()
            with self._lock:
                self._keys[result] = new_key
            out.set_result(result)

        return done

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
