"""The TP follower of a stage loop: running the leader's decisions, and deducing them.

A part of :class:`~rrfp_async.loop.StageLoop` (see the design note in ``_loop_fields``): a
TP follower runs the decisions its leader publishes on the coordinator, in order, each once
it is ready here; a decision it can compute itself ("Deduced TP decisions", below) it starts
without waiting for the leader's row, and checks the row when it comes.
"""

from __future__ import annotations

import collections
import functools

from .._errors import DivergenceError
from .._tasks import Task
from ..policies import chooses_ready_head
from ._loop_dispatch import Dispatch
from ._loop_fields import Coordinator, DecisionPeek, LeaderNamed
from ._state import StepState

__all__ = ["TPFollower"]


class TPFollower(Dispatch):
    """The TP follower of :class:`~rrfp_async.loop.StageLoop` (a mixin of it)."""

    # Deduced TP decisions
    # --------------------
    # A follower need not wait for a decision it can compute itself. Under a policy that
    # always runs the next hinted task when it is ready (``chooses_ready_head``, every
    # built-in one), decision k is the head of the hint (the first task not started yet)
    # whenever that task is ready on the leader when it decides. If the head is ready here
    # and *all its inputs are local* (no message: ``src_rank < 0``; a first stage's
    # forward, a last stage's backward after its forward, a ``W`` after its ``I``), it is
    # ready on the leader too: both ran the same decisions 0..k-1, so the head is the same
    # task, and its producers, all among those decisions, have ended on the leader (or it
    # is the leader's running task, and the look-ahead publishes the head then). The head
    # is always admitted (the safe sequence). So the follower starts it at once; the
    # leader's row for decision k is still read and compared (``_confirm``: a
    # ``DivergenceError`` if it differs), without waiting while more can be deduced, and
    # before the step's sequence check at the latest. Tasks with a remote input are never
    # deduced: whether the message has arrived differs between the TP ranks.

    async def _follow(self, st: StepState, coord: Coordinator) -> None:
        """TP follower: run the leader's decisions in order, each once it is ready here.

        A decision this rank can deduce is not waited for (see "Deduced TP decisions"
        above): its task starts at once, and the leader's row for it is checked when it has
        arrived (at the latest before the step's sequence check)."""
        obs = self._obs
        view = self._view
        has_decision = coord.has_decision if isinstance(coord, DecisionPeek) else None
        st.leader = coord.leader if isinstance(coord, LeaderNamed) else None
        reason = functools.partial(st.stall_reason, self.policy_name)
        prog = st.prog
        order = prog.order
        deduce = self.deduces_tp
        unconfirmed: collections.deque[tuple[int, Task]] = collections.deque()
        while st.left:
            if self._failure is not None:
                raise self._failure
            # Check the deduced decisions whose rows have arrived (no wait).
            while unconfirmed and has_decision is not None and has_decision(st.step):
                seq, task = unconfirmed.popleft()
                self._confirm(st, seq, task, await coord.receive(st.step, seq))
            h = st.ledger.head
            if (
                deduce
                and h < len(order)
                and st.missing[h] == 0
                and prog.src_rank[h] < 0
                and st.ledger.admissible_at(h)
            ):
                # Deduced: the leader's decision st.decisions is the head (below).
                task = order[h]
                unconfirmed.append((st.decisions, task))
                self.tp_deduced += 1
                st.deduced += 1
                if obs is not None:  # its tp_decision event: when its row is read (_confirm)
                    obs.decision(self, task, view.ready, self._now() - st.last_end)
                await self._execute(st, h)
                continue
            while unconfirmed:  # the leader's rows come in order: the deduced ones first
                seq, task = unconfirmed.popleft()
                self._confirm(st, seq, task, await coord.receive(st.step, seq))
            st.leader_wait = st.decisions
            try:
                if obs is not None and (has_decision is None or not has_decision(st.step)):
                    obs.stall(self, reason())
                task = await coord.receive(st.step, st.decisions)
            finally:
                st.leader_wait = -1
            if obs is not None:
                obs.tp_decision(self, task, st.decisions, False)
            pos = prog.pos.get(task)
            if pos is None or st.started[pos]:
                why = "already ran here" if pos is not None else "is not a task of this rank"
                raise DivergenceError(
                    f"rank {self.rank} step {st.step}: the TP leader's decision {st.decisions}"
                    f" is {task}, which {why}"
                )
            st.decided = pos
            try:
                while pos not in st.admitted():
                    if st.missing[pos] == 0:
                        raise DivergenceError(
                            f"rank {self.rank} step {st.step}: the TP leader chose {task},"
                            f" which is ready here but {st.admission_refusal(pos)}: the ranks'"
                            " states diverged"
                        )
                    await self._wait(reason)
            finally:
                st.decided = -1
            if obs is not None:
                obs.decision(self, task, view.ready, self._now() - st.last_end)
            await self._execute(st, pos)
        while unconfirmed:  # every row checked before the step's sequence check
            seq, task = unconfirmed.popleft()
            self._confirm(st, seq, task, await coord.receive(st.step, seq))

    @property
    def deduces_tp(self) -> bool:
        """Whether this stage, as a TP follower, deduces decisions: ``deduce_tp`` and a
        policy that ``chooses_ready_head`` (see "Deduced TP decisions")."""
        return self.deduce_tp and chooses_ready_head(self.policy)

    def _confirm(self, st: StepState, seq: int, deduced: Task, got: Task) -> None:
        """The leader's decision ``seq`` must be the task this follower deduced."""
        if self._obs is not None:
            self._obs.tp_decision(self, got, seq, False)
        if got != deduced:
            raise DivergenceError(
                f"rank {self.rank} step {st.step}: this TP follower deduced decision {seq} as"
                f" {deduced} (the next hinted task, ready with local inputs only, which a"
                f" policy that chooses the ready head must choose), but the TP leader decided"
                f" {got}: the TP ranks run different policies, or their states diverged"
            )
