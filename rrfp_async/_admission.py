"""Admission of forwards under an in-flight activation bound, deadlock-free by construction.

Design note
-----------
A readiness-first rank may run a task out of its hint order. Two things can then go wrong
with memory: (1) it stashes more activations than the fixed order would, and (2) it fills
its bound with forwards that cannot complete, while the task that would unblock the
pipeline (say, a later-chunk forward of an earlier microbatch in an interleaved schedule)
waits for a slot that never frees: a deadlock.

The ledger prevents both with a banker's-algorithm check against the hint. The hint is a
*safe sequence*: validated to fit the bound when run in order, and, across ranks, free of
waiting cycles. The ledger keeps the invariant

    inflight + max prefix sum of the remaining hint's deltas  <=  bound

(delta: +1 for a forward, -1 for the backward that frees it, 0 for W). While it holds, the
remaining hint can still be run strictly from here, on every rank, so the step can always
finish. A backward never breaks it. A forward at hint position k keeps it exactly when

    inflight + 1 + max prefix sum of the remaining hint strictly before k  <=  bound,

so that is the admission test. The hint's next task always passes it, so strict execution
is never refused, and a readiness-first dispatcher can never deadlock on a valid hint.

The scan runs from the first unstarted hint position to k and stops at the first forward
that fails (the prefix maximum only grows with k, so no later forward can pass); what is
left of the ready list then only contributes its backwards.

Bytes: weighted deltas
----------------------
With ``weights`` (``_memory.position_weights``: a forward adds the bytes it stashes, the
backward that frees them subtracts the same number, ``W`` 0) the ledger bounds in-flight
*bytes*, and the same argument holds with each +1 / -1 replaced by the weight:

* *Admission keeps the invariant.* Let ``w`` be the forward's bytes at position k and
  ``m`` the largest prefix sum of the unstarted positions before k. Starting it moves
  ``w`` from the remaining hint into ``inflight``. A prefix of the remaining hint that ends
  before k gains ``w`` (its sum plus the new inflight is ``inflight + w + m`` at most: the
  admission test ``inflight + w + m <= bound``); a prefix that passes k loses ``w`` from its
  sum as much as ``inflight`` gains, so its total is unchanged (it held before).
* *The hint's next task always passes.* At the head, ``m = 0``, and ``inflight + w`` is
  the invariant's own prefix through the head: ``<= bound``.
* *A backward never breaks it.* It is charged when it completes (``finish_at``): while
  it runs its bytes stay in ``inflight``, which only overstates; once it ends, ``inflight``
  and the remaining hint's sums lose the same bytes.
* *What is physically held never exceeds the bound*: ``inflight + w <= inflight + w + m``.

So a valid hint whose strict peak fits the budget can never deadlock under
readiness-first, however the weights differ; the test is a hypothesis property in
``tests/test_admission_bytes.py``. Weights are whole bytes (ints): the sums are exact. The
scan no longer stops at the first forward that fails (a later, smaller forward may fit);
it stops when ``inflight + m`` alone exceeds the bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import attrgetter

from ._tasks import Task, activation_delta

__all__ = ["AdmissionLedger", "hint_peak"]


def hint_peak(order: Sequence[Task]) -> int:
    """The most activations in flight when ``order`` runs strictly, start to end (a count;
    ``_memory.weighted_peak`` gives bytes)."""
    return max(accumulate(map(_DELTAS.__getitem__, map(_kind, order)), initial=0))


_DELTAS = {k: activation_delta(k) for k in ("F", "B", "I", "W")}
_kind = attrgetter("kind")


class AdmissionLedger:
    """In-flight activation accounting of one rank for one step, against a safe order.

    Tasks are named by their position in the hint. The caller calls ``start_at(k)`` when the
    task at position ``k`` is dispatched and ``finish_at(k)`` when it completes;
    ``admissible_at(k)`` (or ``admissible(task)``, or ``filter_admissible`` for a whole ready
    list) says whether dispatching it now keeps the step safe.

    Args:
        order: The rank's hint (the safe sequence); it must fit ``bound`` when run in order.
        bound: The admission bound: most activations in flight at once, or with
            ``weights`` most bytes.
        pos: Task -> position in ``order``, when the caller has it already.
        weights: Each position's change of the in-flight bytes (``position_weights``), or
            None to count activations (+1 / -1).

    Attributes:
        inflight: What is in flight now (activations, or bytes with ``weights``).
        peak: The most that was in flight at once in this step.
        count: Activations in flight now (as ``inflight`` without ``weights``).
        peak_count: The most activations in flight at once.
        bytes: Whether the ledger counts bytes (``weights`` were given).
    """

    __slots__ = (
        "_delta",
        "_head",
        "_kind",
        "_pos",
        "_started",
        "bound",
        "bytes",
        "count",
        "inflight",
        "peak",
        "peak_count",
    )

    def __init__(
        self,
        order: Sequence[Task],
        bound: int,
        pos: dict[Task, int] | None = None,
        weights: Sequence[int] | None = None,
    ):
        self._pos = pos if pos is not None else {t: i for i, t in enumerate(order)}
        if weights is None:
            self._delta = [activation_delta(t.kind) for t in order]
        else:
            if len(weights) != len(order):
                raise ValueError(f"{len(weights)} weights for {len(order)} hint positions")
            self._delta = list(weights)
        self.bytes = weights is not None
        self._kind = [activation_delta(t.kind) for t in order] if self.bytes else self._delta
        self.count = 0
        self.peak_count = 0
        self._started = bytearray(len(order))  # 1 once dispatched
        self._head = 0
        self.bound = bound
        self.inflight = 0
        self.peak = 0

    @property
    def head(self) -> int:
        """Hint position of the first task not yet started."""
        return self._head

    def admissible_at(self, k: int) -> bool:
        """Whether the task at hint position ``k`` may start now."""
        return bool(self.filter_admissible((k,)))

    def filter_admissible(self, ready: Sequence[int]) -> list[int]:
        """The admissible positions among ``ready`` (sorted ascending), in one pass."""
        if self.bytes:
            return self._filter_weighted(ready)
        out: list[int] = []
        delta = self._delta
        bound = self.bound
        c = self.inflight + 1
        if c > bound:
            return [k for k in ready if delta[k] <= 0]
        started = self._started
        s = m = 0
        j = self._head
        for i, k in enumerate(ready):
            if delta[k] <= 0:
                out.append(k)
                continue
            while j < k:
                if not started[j]:
                    s += delta[j]
                    if s > m:
                        m = s
                j += 1
            if c + m > bound:
                # m only grows with k: no later forward is admissible either.
                out.extend([x for x in ready[i + 1 :] if delta[x] <= 0])
                break
            out.append(k)
        return out

    def _filter_weighted(self, ready: Sequence[int]) -> list[int]:
        """``filter_admissible`` with byte weights (see the design note)."""
        out: list[int] = []
        delta = self._delta
        bound = self.bound
        base = self.inflight
        started = self._started
        s = m = 0
        j = self._head
        for i, k in enumerate(ready):
            d = delta[k]
            if d <= 0:
                out.append(k)
                continue
            while j < k:
                if not started[j]:
                    s += delta[j]
                    if s > m:
                        m = s
                j += 1
            if base + m > bound:  # no forward at or after k fits: only backwards remain
                out.extend([x for x in ready[i + 1 :] if delta[x] <= 0])
                break
            if base + d + m <= bound:
                out.append(k)
        return out

    def fits_next(self, k: int) -> bool:
        """Whether a forward at position ``k`` alone fits what is in flight now (the
        reserve for the hint's earlier tasks aside): for diagnostics."""
        return self.inflight + max(0, self._delta[k]) <= self.bound

    def size_at(self, k: int) -> int:
        """What the task at position ``k`` adds in flight (1 or its bytes for a forward,
        negative for the backward that frees, 0 otherwise)."""
        return self._delta[k]

    def reserve_before(self, k: int) -> int:
        """The most activations the unstarted hint positions before ``k`` still add when
        they run in order (their deltas' largest prefix sum, at least 0). A forward at ``k``
        is admissible exactly when ``inflight + size_at(k) + reserve_before(k) <= bound``: this is
        the room the ledger keeps for the hint's earlier tasks (for diagnostics)."""
        s = m = 0
        for j in range(self._head, k):
            if not self._started[j]:
                s += self._delta[j]
                m = max(m, s)
        return m

    def admissible(self, task: Task) -> bool:
        """Whether ``task`` may start now (see the module's design note)."""
        return self.admissible_at(self._pos[task])

    def start_at(self, k: int) -> None:
        """Record that the task at hint position ``k`` was dispatched."""
        self._started[k] = 1
        d = self._delta[k]
        if d > 0:
            self.inflight += d
            if self.inflight > self.peak:
                self.peak = self.inflight
        if self._kind[k] > 0:
            self.count += 1
            if self.count > self.peak_count:
                self.peak_count = self.count
        if k == self._head:
            n = len(self._started)
            h = k + 1
            while h < n and self._started[h]:
                h += 1
            self._head = h

    def finish_at(self, k: int) -> None:
        """Record that the task at hint position ``k`` completed (frees its activation)."""
        d = self._delta[k]
        if d < 0:
            self.inflight += d
        if self._kind[k] < 0:
            self.count -= 1
