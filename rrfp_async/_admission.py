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
"""

from __future__ import annotations

from collections.abc import Sequence

from ._tasks import Task, activation_delta

__all__ = ["AdmissionLedger", "hint_peak"]


def hint_peak(order: Sequence[Task]) -> int:
    """The most activations in flight when ``order`` runs strictly, start to end."""
    c = peak = 0
    for t in order:
        c += activation_delta(t.kind)
        peak = max(peak, c)
    return peak


class AdmissionLedger:
    """In-flight activation accounting of one rank for one step, against a safe order.

    Tasks are named by their position in the hint. The caller calls ``start_at(k)`` when the
    task at position ``k`` is dispatched and ``finish_at(k)`` when it completes;
    ``admissible_at(k)`` (or ``admissible(task)``, or ``filter_admissible`` for a whole ready
    list) says whether dispatching it now keeps the step safe.

    Args:
        order: The rank's hint (the safe sequence); it must fit ``bound`` when run in order.
        bound: The admission bound (most activations in flight at once).
        pos: Task -> position in ``order``, when the caller has it already.
    """

    __slots__ = ("_delta", "_head", "_pos", "_started", "bound", "inflight", "peak")

    def __init__(self, order: Sequence[Task], bound: int, pos: dict[Task, int] | None = None):
        self._pos = pos if pos is not None else {t: i for i, t in enumerate(order)}
        self._delta = [activation_delta(t.kind) for t in order]
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

    def reserve_before(self, k: int) -> int:
        """The most activations the unstarted hint positions before ``k`` still add when
        they run in order (their deltas' largest prefix sum, at least 0). A forward at ``k``
        is admissible exactly when ``inflight + 1 + reserve_before(k) <= bound``: this is
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
        if self._delta[k] > 0:
            self.inflight += 1
            if self.inflight > self.peak:
                self.peak = self.inflight
        if k == self._head:
            n = len(self._started)
            h = k + 1
            while h < n and self._started[h]:
                h += 1
            self._head = h

    def finish_at(self, k: int) -> None:
        """Record that the task at hint position ``k`` completed (frees its activation)."""
        if self._delta[k] < 0:
            self.inflight -= 1
