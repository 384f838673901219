"""Data read in microbatch order under the megatron drop-in, whatever order the tasks run in.

Design note
-----------
Data is read in microbatch order whatever order the tasks run in: the F of microbatch ``m``
on chunk ``c`` gets an iterator whose ``next()`` returns the ``m``-th item of chunk ``c``'s
data iterator, reading the items before it first (and keeping them for their own Fs). A
rank whose ``forward_step_func`` never calls ``next`` (Megatron-LM's middle stages) reads
nothing, as under Megatron. The one exception: where the drop-in learns from the run, the
rank that holds stage 0 (tensor rank 0) reads its first chunk's items of the step before
the step starts (``peek``), to read their sizes (``_megatron_learning``); each forward
still gets its own item, once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .._errors import PlanError

__all__ = ["InOrder", "Microbatch", "OneItem"]


class InOrder:
    """One chunk's ``data_iterator`` read in microbatch order, whatever order the Fs ask in.

    The step's ``Microbatch`` objects tell it how many microbatches read it
    (:meth:`expect`), so that an iterator that runs dry is refused with the count it needed:
    its ``StopIteration`` must not leave ``next()`` (it would end the caller's loop early,
    or, once it reaches a coroutine, become PEP 479's bare ``RuntimeError``). A generator
    whose body lets an inner iterator's ``StopIteration`` out (PEP 479 turns it into
    ``RuntimeError: generator raised StopIteration``, whose ``__cause__`` it is) ran dry
    too, and is refused alike.
    """

    def __init__(self, source: Iterator[Any] | None, *, chunk: int | None = None) -> None:
        self.source = source
        self.items: dict[int, Any] = {}
        self.read = 0
        self.lock = threading.Lock()
        self.chunk = chunk
        self.microbatches = 0  # the step's num_microbatches, as far as expect() was told
        self.inside = False  # it ended by a StopIteration out of a generator's body (PEP 479)

    def expect(self, mb: int, chunk: int | None) -> None:
        """Microbatch ``mb`` of the step reads this iterator (chunk ``chunk``'s, None when
        the call gave one iterator, not a list per chunk)."""
        self.microbatches = max(self.microbatches, mb + 1)
        if self.chunk is None:
            self.chunk = chunk

    def item(self, m: int) -> Any:
        assert self.source is not None
        with self.lock:
            while self.read <= m:
                self._next(m)
            return self.items.pop(m)

    def peek(self, m: int) -> list[Any]:
        """The step's first ``m`` items, read now and kept for their forwards (the drop-in
        reads the step's sizes off them before it plans the step). PlanError: the iterator
        ran dry first (the forward that asks for the missing item raises it again)."""
        assert self.source is not None
        self.expect(m - 1, self.chunk)
        with self.lock:
            while self.read < m:
                self._next(self.read)
            return [self.items[i] for i in range(m)]

    def _next(self, m: int) -> None:
        """Read the next item for the forward of microbatch ``m`` (under the lock)."""
        assert self.source is not None
        try:
            self.items[self.read] = next(self.source)
        except StopIteration:
            raise self._dry(m) from None
        except RuntimeError as e:  # PEP 479: a generator's body let a StopIteration out
            if not isinstance(e.__cause__, StopIteration):
                raise
            self.inside = True  # (a later next() of the finished generator says only "stop")
            raise self._dry(m) from e
        self.read += 1

    def _dry(self, m: int) -> PlanError:
        n = max(self.microbatches, m + 1)
        which = "data_iterator" if self.chunk is None else f"data_iterator[{self.chunk}]"
        how = (
            " (a generator whose body let an inner iterator's StopIteration out, which"
            " PEP 479 turns into 'RuntimeError: generator raised StopIteration': end it with"
            " return, or loop with for)"
            if self.inside
            else ""
        )
        return PlanError(
            f"{which} ran out after {self.read} of num_microbatches={n} microbatches{how}"
            f" (microbatch {self.read} found it empty; the forward of microbatch {m} asked):"
            f" give it at least num_microbatches={n} items per forward_backward call (one"
            " next() per microbatch, as Megatron's get_batch does), e.g. an iterator over a"
            " loader that does not end, or num_microbatches = the items left"
        )


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
        for c, s in enumerate(sources):
            if s.source is not None:
                s.expect(mb, c if len(sources) > 1 else None)
        self.iterators: list[Iterator[Any] | None] = [
            None if s.source is None else OneItem(s, mb) for s in sources
        ]
