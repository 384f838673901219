"""The history of a stage's steps: which number comes next, which steps failed, and what
arrived for a step that has not started yet.

Design note
-----------
A failed step must not poison the next one, and must fail everywhere or nowhere. So the
stage keeps, per step number: the steps that failed (or were cancelled) on this rank (``dead``:
their late messages are dropped, and the number is not run again), the steps that failed on
another rank before they started on this one (``aborted``, from the channel's ABORT: such a step
fails the moment it starts), and the ABORTs of steps that had already ended well on this rank
(``late_failures``: the end-of-step agreement fails those). A message of a later step is
kept until that step starts (``early``). :class:`StepHistory` owns these and nothing else:
it knows no running step, so every question that depends on one takes its number.
"""

from __future__ import annotations

from typing import Any

from .._errors import PlanError
from .._tasks import Task

__all__ = ["StepHistory"]


class StepHistory:
    """Past and failed steps of one stage (see the module's design note).

    Args:
        rank: The stage's pipeline rank (for messages).
    """

    __slots__ = ("_aborted", "_dead", "_early", "late_failures", "next_step", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        #: The number of the step that runs when ``run_step`` is given none.
        self.next_step = 0
        #: ABORTs of steps that had ended well on this rank (the agreement fails them).
        self.late_failures: list[BaseException] = []
        # Steps that failed (or were cancelled) on this rank: their late messages are dropped.
        self._dead: set[int] = set()
        # Steps that failed on another rank before they started on this one.
        self._aborted: dict[int, BaseException] = {}
        # Messages of steps that have not started yet: (task, payload, src) each.
        self._early: dict[int, list[tuple[Task, Any, int]]] = {}

    def is_dead(self, step: int) -> bool:
        """Whether ``step`` failed on this rank (or elsewhere before it started on this one)."""
        return step in self._dead

    def is_ahead(self, step: int, running: int | None) -> bool:
        """Whether ``step`` has not started yet (``running``: the running step's number, or
        None between steps)."""
        return step >= self.next_step if running is None else step > running

    def refuse_rerun(self, step: int) -> None:
        """Refuse to run ``step`` again after it failed on this rank (its late messages are dropped
        by that number); a step that failed on another rank first is not refused (it fails).

        Raises:
            PlanError: ``step`` failed on this rank before.
        """
        if step in self._dead and step not in self._aborted:
            raise PlanError(
                f"rank {self.rank}: step {step} failed here before and its late messages are"
                " dropped; run the retry under a new step number (the default)"
            )

    def aborted(self, step: int) -> BaseException | None:
        """Why ``step`` failed on another rank before it started on this one (None if not)."""
        return self._aborted.get(step)

    def abort(self, step: int, exc: BaseException, running: int | None) -> None:
        """Step ``step``, not the running one, failed on another rank (``exc`` says where
        and why): it fails the moment it starts on this rank if it has not started, and its
        messages are dropped; one that already ended well on this rank keeps ``exc`` in
        ``late_failures``."""
        if step in self._dead:
            return  # it failed on this rank too
        if self.is_ahead(step, running):
            self._aborted[step] = exc
            self._dead.add(step)
            self._early.pop(step, None)
        else:
            self.late_failures.append(exc)

    def start(self, step: int) -> BaseException | None:
        """Step ``step`` starts: the next one is ``step + 1``. Returns why it failed on
        another rank before it started on this one (it must fail at once), or None."""
        self.next_step = step + 1
        return self._aborted.pop(step, None)

    def failed(self, step: int) -> None:
        """Step ``step`` failed (or was cancelled) on this rank: its late messages are dropped."""
        self._dead.add(step)
        self._early.pop(step, None)

    def forget_failed(self) -> None:
        """The channel dropped every message still in flight: a failed step's number may be
        run again."""
        self._dead.clear()

    def keep_early(self, step: int, task: Task, payload: Any, src: int) -> None:
        """Keep a message of ``step``, which has not started yet, until it starts."""
        self._early.setdefault(step, []).append((task, payload, src))

    def take_early(self, step: int) -> list[tuple[Task, Any, int]]:
        """The messages of ``step`` kept before it started, in their order of arrival."""
        return self._early.pop(step, [])
