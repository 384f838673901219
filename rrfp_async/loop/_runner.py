"""``rrfp_async.run``: run a coroutine on a fresh loop (uvloop when available)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when asked for and installed (not on Windows), else None (asyncio's
    default loop).

    A uvloop that is installed but fails to start (a broken build, a libuv that cannot
    get its file descriptors) does not stop the job: the factory logs a warning that names
    the error and gives asyncio's default loop instead.
    """
    if not use_uvloop or sys.platform == "win32":
        return None
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return None

    def new_loop() -> asyncio.AbstractEventLoop:
        try:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except Exception as e:
            logging.getLogger("rrfp_async").warning(
                "uvloop failed to start (%r): running on asyncio's default event loop", e
            )
            return asyncio.new_event_loop()
        return loop

    return new_loop


def run(
    main: Coroutine[Any, Any, T] | Callable[[], Awaitable[T]],
    *,
    use_uvloop: bool = True,
    debug: bool | None = None,
) -> T:
    """Run ``main`` (a coroutine, or a function returning an awaitable) to completion.

    Built on ``asyncio.Runner(loop_factory=...)``: it creates its own loop, sets no global
    event-loop policy and closes the loop afterwards.

    Args:
        main: The coroutine (or coroutine function) to run.
        use_uvloop: Use uvloop when installed.
        debug: asyncio debug mode.

    Returns:
        What ``main`` returns.
    """

    async def _call() -> T:
        return await main()  # type: ignore[operator]

    coro = main if asyncio.iscoroutine(main) else _call()
    with asyncio.Runner(debug=debug, loop_factory=loop_factory(use_uvloop)) as runner:
        return runner.run(coro)
