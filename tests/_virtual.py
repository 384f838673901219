"""Test helper: run a coroutine on a fresh virtual-time loop (simulated, instant)."""

from __future__ import annotations

from typing import Any

from rrfp_async.sim import VirtualEventLoop


def run_virtual(coro: Any) -> Any:
    """Run ``coro`` to completion on a new ``VirtualEventLoop``; close it after."""
    loop = VirtualEventLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
