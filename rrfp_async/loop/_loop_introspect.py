"""What a stage loop shows of itself: its clock, view, plan and step, and its state dump.

The bottom part of :class:`~rrfp_async.loop.StageLoop` (see the design note in
``_loop_fields``): read-only properties that observers and policies use, what waiting tasks
wait for, and the dump of a failed step (the text itself is
:func:`rrfp_async.loop._diagnostics.dump`).
"""

from __future__ import annotations

from collections.abc import Iterator

from .._errors import DeadlockError
from .._tasks import StepPlan
from ..policies import ReadyView
from ._diagnostics import dump
from ._loop_fields import StageFields
from ._observe import attach_observer_error, call_failed

__all__ = ["StageIntrospection"]


class StageIntrospection(StageFields):
    """The introspection of :class:`~rrfp_async.loop.StageLoop` (a mixin of it)."""

    def now(self) -> float:
        """The loop's clock (virtual time under a :class:`VirtualEventLoop`, else monotonic)."""
        return self._now()

    @property
    def view(self) -> ReadyView:
        """The policy's view of this stage (what observers and policies may read)."""
        return self._view

    @property
    def plan(self) -> StepPlan:
        """The step plan."""
        return self.schedule.plan

    @property
    def step(self) -> int | None:
        """The step being run, or None between steps."""
        return None if self._st is None else self._st.step

    def waiting_for(self, limit: int | None = None) -> Iterator[str]:
        """What the next unstarted, not-ready tasks (in hint order) wait for, one line each."""
        st = self._st
        return iter(()) if st is None else st.waiting_for(limit)

    def dump(self, recent: bool = False) -> str:
        """A readable snapshot of the stage: ready set, in-flight, what waiting tasks wait for
        (and, with ``recent``, the last events of the flight recorder)."""
        return dump(self, recent)

    def _dump_on_failure(self, exc: BaseException) -> None:
        """Attach this rank's state to the error and hand it to the observer's ``failed``
        (:class:`~rrfp_async.LogObserver` logs it as event ``stage_dump``)."""
        text = self.dump(recent=True)
        attach_observer_error(self, exc)
        call_failed(self, exc, text)  # a hook that raises adds a note, never replaces exc
        if not isinstance(exc, DeadlockError):  # a deadlock carries every rank's grid
            exc.add_note(f"state of rank {self.rank} when the step failed:\n{text}")
