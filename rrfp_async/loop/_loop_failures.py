"""Step-failure bookkeeping of a stage loop: how a step fails, and what a failed step leaves.

A part of :class:`~rrfp_async.loop.StageLoop` (see the design note in ``_loop_fields``).

Design note
-----------
A failed step must not poison the next one, and must fail everywhere or nowhere. So the
stage keeps, per step number: the steps that failed (or were cancelled) here (``_dead``:
their late messages are dropped, and the number is not run again), the steps that failed on
another rank before they started here (``_aborted``, from the channel's ABORT: such a step
fails the moment it starts), and the ABORTs of steps that had already ended well here
(``late_failures``: the end-of-step agreement fails those). ``fail`` ends the running step
(or the next one) by waking the stage's waiter with the error; only a broken channel (a
``ChannelError``) stays set for every later step (``run_step`` clears any other).

A step that ends while one of its tasks is still on the executor waits for it (``_settle``,
bounded and shielded), so that nothing of that step lands after the caller's
``zero_grad``; and a TP rank whose step failed still takes part in the step's sequence check
(``_post_failed_sequence``), so that the decision group's collectives stay matched.
"""

from __future__ import annotations

import asyncio

import anyio

from .._errors import PeerStepError, PlanError
from ._executors import SettlingExecutor
from ._loop_fields import FailedSequencePoster
from ._loop_introspect import StageIntrospection
from ._state import StepState

__all__ = ["StepFailures"]


class StepFailures(StageIntrospection):
    """The step-failure bookkeeping of :class:`~rrfp_async.loop.StageLoop` (a mixin of it)."""

    def fail(self, exc: BaseException) -> None:
        """End the current (or next) step with ``exc`` (a broken channel, a deadlock)."""
        if self._failure is None:
            self._failure = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)
            self.blocked = False

    def step_aborted(self, step: int, exc: BaseException) -> None:
        """Step ``step`` failed on another rank (the channel's ABORT; ``exc`` says where and
        why): fail it here now if it runs, or the moment it starts if it has not started;
        drop its messages either way. A step that already ended well here cannot fail any
        more: ``exc`` is kept in ``late_failures``."""
        st = self._st
        if st is not None and st.step == step:
            self.fail(exc)
        elif step in self._dead:
            return  # it failed here too
        elif (st is None and step >= self._next_step) or (st is not None and step > st.step):
            self._aborted[step] = exc
            self._dead.add(step)
            self._early.pop(step, None)
        else:
            self.late_failures.append(exc)

    def check_step_number(self, step: int) -> None:
        """Refuse to run ``step`` again after it failed here (its late messages are dropped
        by that number); a step that failed on another rank first is not refused (it fails).

        Raises:
            PlanError: ``step`` failed here before.
        """
        if step in self._dead and step not in self._aborted:
            raise PlanError(
                f"rank {self.rank}: step {step} failed here before and its late messages are"
                " dropped; run the retry under a new step number (the default)"
            )

    def aborted(self, step: int) -> BaseException | None:
        """Why step ``step`` failed on another rank before it started here (None if not)."""
        return self._aborted.get(step)

    def _forget_failed_steps(self) -> None:
        """The channel dropped every message still in flight (a local pipeline does after a
        failed step): a failed step's number may be run again."""
        self._dead.clear()

    def _computing(self) -> StepState | None:
        """The running step's state while one of its tasks is on the executor, else None."""
        st = self._st
        return st if st is not None and st.running >= 0 else None

    async def _settle(self, st: StepState, exc: BaseException) -> None:
        """The step ends with ``exc`` while a task runs on the executor (it was cancelled,
        or its watchdog fired): wait for that task to end before ``run_step`` raises, so
        that nothing of this step (a gradient) lands after the caller's ``zero_grad``.

        The wait is bounded (``settle_timeout``: a task that hangs must not turn a cancel
        into a hang) and shielded: a cancel scope that cancels again (anyio's do, every
        loop iteration) cannot cut it short. A task still running after the bound is
        named in a note on ``exc``.
        """
        ex = self.executor
        if not isinstance(ex, SettlingExecutor):
            return
        task = st.prog.order[st.running]
        inner = asyncio.ensure_future(ex.settle())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        # anyio's scopes cancel again at every await (level-triggered): its shield keeps
        # them off (no spinning while the task computes); asyncio's cancel comes once.
        with anyio.CancelScope(shield=True):
            while not inner.done():
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait((inner,), timeout=left)
                except asyncio.CancelledError:
                    continue  # cancelled again (asyncio): the wait goes on until the bound
        if not inner.done():
            inner.cancel()
            exc.add_note(
                f"rank {self.rank} step {st.step}: task {task} was still running on the"
                f" executor {self.settle_timeout} s after the step ended; what it writes (a"
                " gradient) may land after the next zero_grad"
            )
        elif not inner.cancelled() and inner.exception() is not None:
            err = inner.exception()
            exc.add_note(f"rank {self.rank} step {st.step}: waiting for {task} raised {err!r}")

    def _post_failed_sequence(self, step: int, exc: BaseException) -> None:
        """A step that failed here before its TP sequence check: take part in the check
        anyway, without waiting (the coordinator's ``post_failed_sequence``), so that every
        TP rank posts it exactly once per step (the decision group's collectives stay
        matched) and a TP peer whose step went on learns there that it failed here."""
        if self.coordinator is None or not self.verify_sequences or self._verified == step:
            return
        self._verified = step
        coord = self.coordinator
        if isinstance(coord, FailedSequencePoster):
            # Where it failed first, when another rank told this one (only a PeerStepError
            # carries an origin).
            origin = exc.origin if isinstance(exc, PeerStepError) else None
            coord.post_failed_sequence(step, origin)
