"""A stage's synchronous face: ``with stage:`` and ``stage.run_step_sync``.

One implementation, two faces (anyio's blocking portal): ``BlockingFace`` holds an event
loop on a thread of its own (``SyncPortal``) and runs the async stage's coroutines there —
``__aenter__`` when the ``with`` block opens, ``run_step`` for each ``run_step_sync``,
``__aexit__`` when the block ends, after which the thread stops. It knows nothing of the
stage but the coroutine functions it is handed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._errors import InterruptedStepError
from .._resources import is_fd_shortage, is_thread_shortage, no_fds_error, no_thread_error
from ..loop import SyncPortal
from . import _state_dump as state_dump

__all__ = ["BlockingFace"]

T = TypeVar("T")


class BlockingFace:
    """The portal that runs an async stage for synchronous callers.

    Args:
        portal: The event loop thread (see ``open``).
    """

    def __init__(self, portal: SyncPortal) -> None:
        self._portal = portal

    @classmethod
    def open(
        cls, aenter: Callable[[], Awaitable[object]], who: str = "DistributedStage"
    ) -> BlockingFace:
        """Start an event loop on a thread of its own (uvloop when installed) and run
        ``aenter`` there; the face that runs the stage's steps on it.

        Raises:
            ResourceError: The loop's thread cannot be started, or the loop has no file
                descriptor (this process is at its limit); the message names it and the fix.
            BaseException: What ``aenter`` raised (the thread is stopped first).
        """
        state_dump.install()  # (from the caller's thread: the signal handler needs the main one)
        try:
            portal = SyncPortal()
        except (RuntimeError, OSError) as e:  # no thread, or no descriptor for its loop
            if is_thread_shortage(e):
                raise no_thread_error(who, "the stage's event loop thread", e) from e
            if is_fd_shortage(e):
                raise no_fds_error(who, "the stage's event loop") from e
            raise
        try:
            portal.call(aenter)
        except BaseException:
            portal.close()
            raise
        return cls(portal)

    def call(self, fn: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the face's loop and block until it ends; what it
        raised is raised to the caller (the same object). A step interrupted by a non-``Exception``
        of a module (``InterruptedStepError``: the step failed on every rank, the loop
        thread lives on) raises what the module raised (a ``KeyboardInterrupt`` stays one).
        """
        try:
            return self._portal.call(fn, *args, **kwargs)
        except InterruptedStepError as e:
            raise e.original from None

    def close(self, aexit: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``aexit(*args)`` on the face's loop, then stop its thread (also when it
        raised)."""
        try:
            self._portal.call(aexit, *args)
        finally:
            self._portal.close()
