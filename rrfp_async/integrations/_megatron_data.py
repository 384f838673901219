"""Data read in microbatch order under the megatron drop-in, whatever order the tasks run in.

Design note
-----------
Data is read in microbatch order whatever order the tasks run in: the F of microbatch ``m``
on chunk ``c`` gets an iterator whose ``next()`` returns the ``m``-th item of chunk ``c``'s
data iterator, reading the items before it first (and keeping them for their own Fs). A
rank whose ``forward_step_func`` never calls ``next`` (Megatron-LM's middle stages) reads
nothing, as under Megatron.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .._errors import PlanError

__all__ = ["InOrder", "Microbatch", "OneItem"]


class InOrder:
    """One chunk's ``data_iterator`` read in microbatch order, whatever order the Fs ask in."""

    def __init__(self, source: Iterator[Any] | None) -> None:
        self.source = source
        self.items: dict[int, Any] = {}
        self.read = 0
        self.lock = threading.Lock()

    def item(self, m: int) -> Any:
        assert self.source is not None
        with self.lock:
            while self.read <= m:
                self.items[self.read] = next(self.source)
                self.read += 1
            return self.items.pop(m)


class OneItem:
    """The iterator one F's ``forward_step_func`` gets: its own microbatch, once."""

    __slots__ = ("_done", "_mb", "_src")

    def __init__(self, src: InOrder, mb: int) -> None:
        self._src, self._mb, self._done = src, mb, False

    def __iter__(self) -> OneItem:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise PlanError(
                f"microbatch {self._mb}: forward_step_func called next(data_iterator) twice;"
                " the readiness-first schedule gives each microbatch's forward exactly one"
                " item of the data iterator (one next() per microbatch, as Megatron's"
                " get_batch does)"
            )
        self._done = True
        return self._src.item(self._mb)


class Microbatch:
    """What ``ctx.microbatches[m]`` holds: microbatch ``m``'s data iterator of each chunk."""

    __slots__ = ("iterators", "mb")

    def __init__(self, sources: Sequence[InOrder], mb: int) -> None:
        self.mb = mb
        self.iterators: list[Iterator[Any] | None] = [
            None if s.source is None else OneItem(s, mb) for s in sources
        ]
