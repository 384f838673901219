"""The dispatcher of a TP follower: running the leader's decisions, and deducing them.

:class:`Follower` runs the decisions its leader publishes on the coordinator, in order, each
once it is ready on this rank; a decision it can compute itself ("Deduced TP decisions", below) it
starts without waiting for the leader's row, and checks the row when it comes.
"""

from __future__ import annotations

import collections
import functools

from .._errors import DivergenceError
from .._tasks import Task
from ..policies import ReadyView
from ._coordinator import Coordinator, DecisionPeek, LeaderNamed
from ._state import StepState
from ._step_run import StepRun
from ._task_runner import TaskRunner

__all__ = ["Follower", "deducible"]


# Deduced TP decisions
# --------------------
# A follower need not wait for a decision it can compute itself. Under a policy that
# always runs the next hinted task when it is ready (``chooses_ready_head``, every
# built-in one), decision k is the head of the hint (the first task not started yet)
# whenever that task is ready on the leader when it decides. If the head is ready on this rank
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


def deducible(st: StepState, pos: int) -> bool:
    """Whether a follower, deducing, would take the task at ``pos`` as the leader's next
    decision without its row: it is the hint's head and has no input message (whether it
    is ready is the caller's question)."""
    return pos == st.ledger.head and st.prog.src_rank[pos] < 0


class Follower:
    """Runs a step's tasks in the order its TP leader decides.

    Args:
        rank: The stage's pipeline rank (for messages).
        policy_name: The policy's name (for stall reasons).
        view: The policy's view of the stage (observers' ``decision`` events list its
            ready tasks).
        run: The running step: its state, the waits, the observer.
        runner: Runs each task.
    """

    __slots__ = ("deduced", "policy_name", "rank", "run", "runner", "view")

    def __init__(
        self, rank: int, *, policy_name: str, view: ReadyView, run: StepRun, runner: TaskRunner
    ) -> None:
        self.rank = rank
        self.policy_name = policy_name
        self.view = view
        self.run = run
        self.runner = runner
        #: Decisions started without waiting for the leader (deduced), over every step.
        self.deduced = 0

    async def dispatch(self, st: StepState, coord: Coordinator, deduce: bool) -> None:
        """Run the leader's decisions of step ``st`` in order, each once it is ready on this rank.

        With ``deduce``, a decision this rank can deduce is not waited for (see "Deduced TP
        decisions" above): its task starts at once, and the leader's row for it is checked
        when it has arrived (at the latest before the step's sequence check)."""
        run = self.run
        execute = self.runner.execute
        obs = run.obs
        view = self.view
        has_decision = coord.has_decision if isinstance(coord, DecisionPeek) else None
        st.leader = coord.leader if isinstance(coord, LeaderNamed) else None
        reason = functools.partial(st.stall_reason, self.policy_name)
        prog = st.prog
        order = prog.order
        unconfirmed: collections.deque[tuple[int, Task]] = collections.deque()
        while st.left:
            if run.failure is not None:
                raise run.failure
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
                # Deduced: the leader's decision st.decisions is the head (above).
                task = order[h]
                unconfirmed.append((st.decisions, task))
                self.deduced += 1
                st.deduced += 1
                if obs is not None:  # its tp_decision event: when its row is read (_confirm)
                    obs.decision(task, view.ready, run.now() - st.last_end)
                await execute(st, h)
                continue
            while unconfirmed:  # the leader's rows come in order: the deduced ones first
                seq, task = unconfirmed.popleft()
                self._confirm(st, seq, task, await coord.receive(st.step, seq))
            st.leader_wait = st.decisions
            try:
                if obs is not None and (has_decision is None or not has_decision(st.step)):
                    obs.stall(reason())
                task = await coord.receive(st.step, st.decisions)
            finally:
                st.leader_wait = -1
            if obs is not None:
                obs.tp_decision(task, st.decisions, False)
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
                    await run.wait(reason)
            finally:
                st.decided = -1
            if obs is not None:
                obs.decision(task, view.ready, run.now() - st.last_end)
            await execute(st, pos)
        while unconfirmed:  # every row checked before the step's sequence check
            seq, task = unconfirmed.popleft()
            self._confirm(st, seq, task, await coord.receive(st.step, seq))

    def _confirm(self, st: StepState, seq: int, deduced: Task, got: Task) -> None:
        """The leader's decision ``seq`` must be the task this follower deduced."""
        obs = self.run.obs
        if obs is not None:
            obs.tp_decision(got, seq, False)
        if got != deduced:
            raise DivergenceError(
                f"rank {self.rank} step {st.step}: this TP follower deduced decision {seq} as"
                f" {deduced} (the next hinted task, ready with local inputs only, which a"
                f" policy that chooses the ready head must choose), but the TP leader decided"
                f" {got}: the TP ranks run different policies, or their states diverged"
            )
