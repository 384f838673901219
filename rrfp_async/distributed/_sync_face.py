"""``DistributedStage``'s synchronous face: ``with stage:`` and ``stage.run_step_sync``.

One implementation, two faces (anyio's blocking portal): ``with`` starts an event loop on a
thread of its own (``SyncPortal``) and opens the stage there with ``__aenter__``;
``run_step_sync`` runs ``run_step`` on that loop and blocks until it ends; the end of the
block closes the stage there and stops the thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from .._errors import ClosedError, InterruptedStepError
from ..loop import StepStats, SyncPortal
from ..policies import StepSchedule
from . import _state_dump as state_dump
from ._stage_fields import StageFields

__all__ = ["SyncFace"]

_CLOSE_WAIT = 60.0
"""How long ``close`` waits for a stage's close on another thread's loop (its channels
wait up to 30 s for the peers' CLOSE)."""


class SyncFace(StageFields):
    """``DistributedStage``'s synchronous face (a part: see ``_stage_fields``)."""

    async def __aenter__(self) -> Self:
        raise NotImplementedError

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        raise NotImplementedError

    def _close_blocking(self, *, failed: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Close the stage from synchronous code, however it was opened; idempotent (a stage
        that is not open is left as it is).

        ``with`` / ``async with`` close the stage at the end of their block; this is for an
        owner whose stage has no block: the drop-ins' schedules (when they are closed or
        garbage-collected), the hooks that close what is still open before
        ``torch.distributed.destroy_process_group`` and at interpreter exit (see
        ``_lifetime``). A stage opened with ``with`` closes as at the end of the block; one
        opened with ``async with`` on a loop that still runs closes there (this call waits);
        one whose loop has ended closes its channels on this thread.

        Raises:
            ClosedError: Called on the event loop thread of a stage opened there with
                ``async with`` (it would wait for itself): there, leave the block.
        """
        if self._state != "open":
            return
        if self._portal is not None:
            self.__exit__(None, None, None)
            return
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                raise ClosedError(
                    f"{self._who()}: close() was called on the event loop the stage runs on;"
                    " there, leave its `async with` block (or `await stage.__aexit__(...)`)"
                )
            fut = asyncio.run_coroutine_threadsafe(self.__aexit__(None, None, None), loop)
            fut.result(timeout=_CLOSE_WAIT)
            return
        self._close_blocking(failed=False)

    def __enter__(self) -> Self:
        """Open the stage for a synchronous training loop: start an event loop on a thread
        of its own (anyio's blocking portal; uvloop when installed) and open the stage on
        it; ``run_step_sync`` then runs steps there, and the end of the ``with`` block
        closes the stage and stops the thread.

        Raises:
            ClosedError: The stage was opened before.
            PlanError: Another open stage of this process uses the same p2p group.
        """
        if self._state != "new":
            raise ClosedError(f"{self._who()}: a DistributedStage is opened once ({self._state})")
        state_dump.install()  # (here: __aenter__ runs on the portal's thread)
        portal = SyncPortal()
        try:
            portal.call(self.__aenter__)
        except BaseException:
            portal.close()
            raise
        self._portal = portal
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        portal, self._portal = self._portal, None
        if portal is None:  # not opened with ``with``
            return
        try:
            portal.call(self.__aexit__, exc_type, exc, tb)
        finally:
            portal.close()

    def run_step_sync(
        self,
        microbatches: Sequence[Any],
        *,
        step: int | None = None,
        schedule: StepSchedule | None = None,
        train: bool = True,
    ) -> StepStats:
        """``run_step`` for synchronous code, inside ``with DistributedStage(...) as stage:``:
        the step runs on the stage's event loop thread and this call blocks until it ends.

        Args:
            microbatches: The step's microbatches (any number).
            step: The step number (default: one more than the last).
            schedule: A schedule for this step.
            train: False for a forward-only step.

        Returns:
            This rank's stats.

        Raises:
            ClosedError: The stage is not open with ``with`` (not yet, no more, or with
                ``async with``: there, ``await stage.run_step(...)``).
            PlanError, StepTimeoutError, PeerError: As ``run_step`` raises them (the same
                objects, not wrapped).
            BaseException: What a module raised on the compute thread when it was no
                ``Exception`` (``KeyboardInterrupt``): ``run_step`` fails the step with
                ``InterruptedStepError``, this re-raises the original.
        """
        portal = self._portal
        if portal is None:
            if self._state == "open":
                how = (
                    "it was opened with `async with`: there, run steps with"
                    " `await stage.run_step(...)`"
                )
            else:
                how = "it is not open yet" if self._state == "new" else "it was closed"
            raise ClosedError(
                f"{self._who()}: run_step_sync runs steps inside"
                f" `with DistributedStage(...) as stage:` (on that block's event loop"
                f" thread); {how}"
            )
        try:
            return portal.call(
                self.run_step, microbatches, step=step, schedule=schedule, train=train
            )
        except InterruptedStepError as e:
            # The step failed on every rank and the loop thread lives on; the caller gets
            # what its module raised (a KeyboardInterrupt stays one).
            raise e.original from None
