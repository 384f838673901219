"""The synchronous face's bridge: an event loop on a thread of its own (anyio's blocking portal).

Design note
-----------
Most PyTorch training loops are synchronous. The sync face is not a second implementation of
a step: it *bridges* to the one async implementation. ``SyncPortal`` runs an event loop on a
thread of its own (``anyio.from_thread.start_blocking_portal`` on the asyncio backend, with
uvloop's loop when installed), and ``call`` hands a coroutine function to that loop and
blocks until it is done. The coroutine's own exception comes back unwrapped (anyio re-raises
the object the coroutine raised), so ``except rr.PeerError`` catches the same thing in both
faces.

The loop lives as long as its owner's ``with`` block (``DistributedStage``) or until
``close()`` (``LocalPipeline``), not per call: a stage's channel threads hand their
messages to the loop the stage was opened on, so every step of it must run there.

An interrupt (Ctrl-C) while the caller waits cancels the coroutine on the portal's loop and
waits until it has unwound before it propagates, so what runs next on that loop (a stage's
close at the end of its ``with`` block) never overlaps a half-cancelled step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from .._errors import ClosedError
from ._runner import loop_factory

__all__ = ["SyncPortal"]

T = TypeVar("T")
P = ParamSpec("P")


class SyncPortal:
    """An event loop on its own thread that synchronous code hands coroutines to.

    Args:
        use_uvloop: Run uvloop's loop when installed (else asyncio's default loop).
    """

    def __init__(self, *, use_uvloop: bool = True) -> None:
        factory = loop_factory(use_uvloop)
        options: dict[str, Any] = {} if factory is None else {"loop_factory": factory}
        self._stack = contextlib.ExitStack()
        self._portal: BlockingPortal | None = self._stack.enter_context(
            start_blocking_portal("asyncio", options)
        )

    @property
    def closed(self) -> bool:
        """Whether ``close`` has run."""
        return self._portal is None

    def call(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``await fn(*args, **kwargs)`` on the portal's loop; block until it is done.

        Returns:
            What ``fn`` returns.

        Raises:
            ClosedError: The portal is closed.
            RuntimeError: Called from the portal's own loop thread (it would wait for itself).
            BaseException: Whatever ``fn`` raised, as it was raised.
        """
        portal = self._portal
        if portal is None:
            raise ClosedError("this synchronous face's event loop thread is closed")
        unwound = threading.Event()

        async def run() -> T:
            try:
                return await fn(*args, **kwargs)
            finally:
                unwound.set()

        fut = portal.start_task_soon(run)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():  # interrupted while waiting: cancel it there, let it unwind
                fut.cancel()
                unwound.wait()
            raise

    def close(self) -> None:
        """Stop the loop (after what runs on it has finished) and join its thread. Idempotent."""
        if self._portal is None:
            return
        self._portal = None
        self._stack.close()
