"""``rrfp_async.run``: run a coroutine on a fresh loop (uvloop when available)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory(use_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when asked for and installed (not on Windows), else None
    (asyncio's default loop)."""
    if not use_uvloop or sys.platform == "win32":
        return None
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


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
