"""What a ``DistributedStage`` shows of itself: its per-step trace files (``trace_dir``: a
``TraceRecorder`` beside the stage's observer, written when each step ends) and its state
dumps (``dump_state``; the signal handler and the file: ``_state_dump``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from .._errors import PlanError
from ..loop import StageObserver
from ..observability import (
    MultiObserver,
    TraceRecorder,
    chrome_trace,
    rank_trace_path,
    write_trace,
)
from ..policies import StepSchedule
from . import _state_dump as state_dump
from ._executor_hooks import EmulatingExecutor
from ._stage_fields import StageFields

__all__ = ["StageViews"]

_log = logging.getLogger(__name__)


class StageViews(StageFields):
    """``DistributedStage``'s traces and state dumps (a part: see ``_stage_fields``)."""

    def _open_trace(
        self,
        trace_dir: str | Path | None,
        emulated_gpu_time: bool | None,
        executor: object,
        observer: StageObserver | None,
    ) -> StageObserver | None:
        """Set up ``trace_dir`` (see ``DistributedStage``'s Args): create it, and record the
        steps with a ``TraceRecorder`` beside ``observer``; the observer the stage gets.

        Raises:
            PlanError: ``emulated_gpu_time`` is not a bool or None, or ``trace_dir`` cannot
                be created.
        """
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        if emulated_gpu_time is not None and not isinstance(emulated_gpu_time, bool):
            raise PlanError(f"emulated_gpu_time must be a bool or None, got {emulated_gpu_time!r}")
        self._emulated = (
            isinstance(executor, EmulatingExecutor) and executor.emulate is not None
            if emulated_gpu_time is None
            else emulated_gpu_time
        )
        self._recorder = None
        if self.trace_dir is not None:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PlanError(
                    f"rank {self.layout.rank}: cannot create trace_dir {str(trace_dir)!r}: {e}"
                ) from None
            self._recorder = TraceRecorder(self.layout.pipeline_peers())
            observer = MultiObserver(observer, self._recorder)
        return observer

    def _write_trace(self, step: int, schedule: StepSchedule, *, failed: bool) -> None:
        """Write this step's recording to ``trace_dir`` (see the class's Args): a step that
        ended well to ``rank{r}.json``, a failed one to ``failed-rank{r}.json``, so that a
        failure never overwrites the last good step (after a rank died, the survivors' and
        the dead rank's ``rank*.json`` still hold the same step, and merge). A write that
        fails is logged and never fails the step."""
        assert self._recorder is not None and self.trace_dir is not None
        path = rank_trace_path(self.trace_dir, self.layout.rank, failed=failed)
        try:
            write_trace(
                path,
                chrome_trace(
                    self._recorder.data,
                    clock="real",
                    emulated=self._emulated,
                    policy=self.stage.policy_name,
                    hint=schedule.hint_name,
                    title=f"{self._who()}, step {step}",
                ),
            )
        except Exception as e:
            _log.warning(
                "%s: could not write its trace of step %d to %s: %r", self._who(), step, path, e
            )

    def dump_state(self, reason: str = "requested") -> Path | None:
        """Write this rank's state now (see ``rrfp_async.distributed._state_dump``): the
        step, the running task, the ready and admitted sets, what each waiting task waits
        for and the last events, to the log and to ``trace_dir/state-rank{r}.txt``. A
        ``SIGUSR1`` to the process does it for every open stage; a step timeout does it too.

        Returns:
            The file written (None without a ``trace_dir``).
        """
        return state_dump.write_state(self, reason)

    def _state_text(self) -> str:
        return self.stage.dump(recent=True)

    @property
    def _dump_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop if self._state == "open" else None

    @property
    def _dump_rank(self) -> int:
        return self.layout.rank
