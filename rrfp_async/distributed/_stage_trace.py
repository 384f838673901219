"""A stage's per-step trace files (``trace_dir``): a ``TraceRecorder`` beside the stage's
observer, each step written when it ends (the state dumps: ``_state_dump``).

``StageTrace`` owns the trace directory, the recorder and whether the trace says that GPU
time is emulated; a write that fails is logged and never fails the step (invariant 8).

A failed step is the evidence a user needs most: it is written the moment the stage learns
of the failure, before anything else can wait (telling the peers aside), with what this
rank saw of it (the tasks it ran and started, its messages) and a ``Failure`` row (the
error, when, the tasks still running) that marks the file failed. Each file names its
pipeline's ranks (``pipeline``), so that a reader of the survivors' files names the ranks
whose files never came.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from .._errors import PlanError
from ..loop import StageObserver
from ..observability import (
    MultiObserver,
    TraceData,
    TraceRecorder,
    chrome_trace,
    rank_trace_path,
    write_trace,
)
from ..policies import StepSchedule
from ._executor_hooks import EmulatingExecutor

__all__ = ["StageTrace"]

_log = logging.getLogger(__name__)


class StageTrace:
    """Records a stage's steps and writes each to ``trace_dir`` (see ``DistributedStage``'s
    ``trace_dir``); without a directory it records nothing.

    Args:
        trace_dir: Where the files go (created when the stage is built); None: no traces.
        emulated_gpu_time: What the files say of their times (None: what the executor
            says, see ``EmulatingExecutor``).
        executor: The stage's executor.
        rank: This process's global rank (the file's name).
        peers: Pipeline rank -> global rank, of this pipeline (the recorder's rows).
        who: This rank, for messages.

    Raises:
        PlanError: ``emulated_gpu_time`` is not a bool or None, or ``trace_dir`` cannot be
            created.
    """

    def __init__(
        self,
        trace_dir: str | Path | None,
        *,
        emulated_gpu_time: bool | None,
        executor: object,
        rank: int,
        peers: Mapping[int, int],
        who: str,
    ) -> None:
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        if emulated_gpu_time is not None and not isinstance(emulated_gpu_time, bool):
            raise PlanError(f"emulated_gpu_time must be a bool or None, got {emulated_gpu_time!r}")
        self.emulated = (
            isinstance(executor, EmulatingExecutor) and executor.emulate is not None
            if emulated_gpu_time is None
            else emulated_gpu_time
        )
        self._rank = rank
        self._who = who
        self._pipeline = sorted(set(peers.values()))
        self._recorder: TraceRecorder | None = None
        if self.trace_dir is not None:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PlanError(
                    f"rank {rank}: cannot create trace_dir {str(trace_dir)!r}: {e}"
                ) from None
            self._recorder = TraceRecorder(dict(peers))

    def observer(self, observer: StageObserver | None) -> StageObserver | None:
        """The observer the stage gets: ``observer``, with the recorder beside it when
        there is a trace directory."""
        if self._recorder is None:
            return observer
        return MultiObserver(observer, self._recorder)

    def begin_step(self) -> None:
        """A step starts: each file holds one step."""
        if self._recorder is not None:
            self._recorder.data = TraceData()

    def write(
        self,
        step: int,
        schedule: StepSchedule,
        *,
        policy: str,
        failure: BaseException | None = None,
        at: float | None = None,
    ) -> None:
        """Write this step's recording (nothing without a trace directory): a step that
        ended well to ``rank{r}.json``, a failed one (``failure``: its error; ``at``: when,
        on the stage clock, default now) to ``failed-rank{r}.json``, marked failed by a
        ``Failure`` row, so that a failure never overwrites the last good step (after a
        rank died, the survivors' and the dead rank's ``rank*.json`` still hold the same
        step, and merge). A write that fails is logged and never fails the step."""
        if self._recorder is None or self.trace_dir is None:
            return
        title = f"{self._who}, step {step}"
        path = rank_trace_path(self.trace_dir, self._rank, failed=failure is not None)
        try:
            if failure is not None:
                when = time.monotonic() if at is None else at
                self._recorder.failure(self._rank, step, when, failure)
                title += f" (failed: {type(failure).__name__})"
            write_trace(
                path,
                chrome_trace(
                    self._recorder.data,
                    clock="real",
                    emulated=self.emulated,
                    policy=policy,
                    hint=schedule.hint_name,
                    title=title,
                    pipeline=self._pipeline,
                ),
            )
        except Exception as e:
            _log.warning(
                "%s: could not write its trace of step %d to %s: %r", self._who, step, path, e
            )
