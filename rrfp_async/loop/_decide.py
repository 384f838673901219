"""The dispatcher of a stage that decides: alone, or as the TP leader with its look-ahead.

:class:`Decider` asks the policy which ready task runs next, checks the choice, and runs it
(:class:`~rrfp_async.loop._task_runner.TaskRunner`); given a coordinator it leads a TP
group: it publishes each decision, and one ahead when it can (the look-ahead, below). A TP
follower's dispatcher is :class:`~rrfp_async.loop._follow.Follower`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import types

from .._errors import PolicyError, RRFPError, StepTimeoutError
from .._tasks import Task
from ..policies import Policy, ReadyView, chooses_ready_head
from ._coordinator import Coordinator
from ._state import StepState
from ._step_run import StepRun
from ._task_runner import TaskRunner

__all__ = ["Decider", "watchdog_error"]


class Decider:
    """Runs a step's tasks in the order its policy chooses (alone, or as TP leader).

    Args:
        rank: The stage's pipeline rank (for messages).
        policy_name: The policy's name (for messages and stall reasons).
        view: The policy's view of the stage.
        run: The running step: its state, the waits, the observer.
        runner: Runs each chosen task.
    """

    __slots__ = ("policy_name", "rank", "run", "runner", "view")

    def __init__(
        self, rank: int, *, policy_name: str, view: ReadyView, run: StepRun, runner: TaskRunner
    ) -> None:
        self.rank = rank
        self.policy_name = policy_name
        self.view = view
        self.run = run
        self.runner = runner

    # Design note
    # -----------
    # A stage owns a *ready set*: the tasks of its rank whose inputs have all arrived and that
    # have not started. It changes only on events, never by polling:
    #
    # * a message arrives (``deliver``, called by the channel on the loop thread), or
    # * one of the stage's own tasks finishes (which satisfies its same-rank dependents).
    #
    # The loop body is: wait until some ready task is admitted -> ask the policy coroutine which
    # one to run -> run it on the executor and await its completion -> hand its output to the
    # consumer (locally, or through the channel). The stage runs one task at a time, like a GPU
    # compute stream; messages keep arriving while a task runs because the executor awaits.
    #
    # Admission (``AdmissionLedger``) keeps in-flight activations within the bound and makes
    # out-of-order dispatch deadlock-free against a valid hint. A policy can still misbehave (wait
    # for something that never comes); a *monitor* that sees every stage of a process (the local
    # pipeline) then raises ``DeadlockError`` with a rank x task grid, and a step watchdog
    # (``step_timeout``) bounds every other wait.
    #
    # Everything a stage starts belongs to the caller's task: the stage never creates orphan
    # tasks and takes over nothing global, so it runs inside any asyncio loop.
    #
    # TP look-ahead. A follower can only start a task once the leader's decision for it has
    # arrived; a decision taken when the leader's compute frees up reaches the followers one
    # broadcast later, and inside TP collectives the leader then waits for them: one
    # broadcast per task on the critical path. But a policy that always runs the next
    # hinted task when it is ready (every built-in one: ``chooses_ready_head``) would choose
    # exactly that task at the end of the current one if it is ready already now (or will be
    # by then: its only missing input is the running task's output), since nothing can
    # outrank it and the head is always admitted. So the leader publishes it as
    # the next decision as soon as the current task is on its compute thread, and the
    # broadcast travels while everybody computes.

    async def dispatch(self, st: StepState, policy: Policy, coord: Coordinator | None) -> None:
        """Run every task of step ``st``, each the one ``policy`` chooses among the ready
        and admitted; with ``coord``, publish each decision to the TP followers."""
        run = self.run
        execute = self.runner.execute
        view = self.view
        obs = run.obs  # the step's guard: it goes quiet, never away, if the observer raises
        order = st.prog.order
        pre = -1  # a look-ahead decision already published for the next dispatch
        reason = functools.partial(st.stall_reason, self.policy_name)
        look = None
        if coord is not None and chooses_ready_head(policy):

            def look(seq: int, running: int) -> None:
                nonlocal pre
                if run.state is not st or st.decisions != seq or pre >= 0:
                    return  # the next decision was taken already (an executor that never yielded)
                h = st.ledger.head
                # Ready now, or ready the moment the running task ends (its only missing input
                # is that task's output: a last stage's B after its F, a W after its I).
                if h < len(order) and (
                    st.missing[h] == 0 or (st.missing[h] == 1 and h in st.prog.local_next[running])
                ):
                    try:
                        coord.publish(st.step, st.decisions, order[h])
                    except Exception as e:  # a loop callback: fail the step, not the loop
                        run.fail(e)
                        return
                    if obs is not None:
                        obs.tp_decision(order[h], st.decisions, True)
                    pre = h

        while st.left:
            if run.failure is not None:
                raise run.failure
            if pre >= 0:
                pos, pre = pre, -1
                if obs is not None:
                    obs.decision(order[pos], view.ready, run.now() - st.last_end)
                await execute(st, pos, look)
                continue
            if not st.admitted():
                await run.wait(reason)
                continue
            st.deciding = True
            try:
                task = await policy(view)
            except RRFPError:
                raise
            except asyncio.CancelledError as e:
                cur = asyncio.current_task()
                if cur is None or cur.cancelling():
                    st.policy_at = suspended_at(e.__traceback__)  # (the watchdog's message)
                    raise  # the step itself is being cancelled
                raise PolicyError(
                    f"policy {self.policy_name!r} on rank {self.rank} step {st.step} raised"
                    " asyncio.CancelledError, though nothing cancelled the step",
                    policy=self.policy_name,
                    rank=self.rank,
                    step=st.step,
                ) from e
            except Exception as e:
                raise PolicyError(
                    f"policy {self.policy_name!r} raised on rank {self.rank} step {st.step}: {e!r}",
                    policy=self.policy_name,
                    rank=self.rank,
                    step=st.step,
                ) from e
            # (Only on a return: a step that fails in the policy's turn, a timeout among
            # them, keeps it for its dump.)
            st.deciding = False
            pos = self.check_choice(st, task)
            if coord is not None:
                coord.publish(st.step, st.decisions, task)
                if obs is not None:
                    obs.tp_decision(task, st.decisions, True)
            if obs is not None:
                obs.decision(task, view.ready, run.now() - st.last_end)
            await execute(st, pos, look)

    def check_choice(self, st: StepState, task: object) -> int:
        """The position of the policy's choice ``task``, which must be ready and admitted.

        Raises:
            PolicyError: It is not.
        """
        pos: int | None = st.prog.pos.get(task) if isinstance(task, Task) else None
        if pos is None or pos not in st.admitted():
            if pos is None:
                why = "is not a task of this rank"
            elif st.started[pos]:
                why = "already ran"
            elif st.missing[pos]:
                why = "is not ready (its inputs have not all arrived)"
            else:
                why = f"is held back by admission: {st.admission_refusal(pos)}"
            raise PolicyError(
                f"policy {self.policy_name!r} on rank {self.rank} step {st.step} returned"
                f" {task!r}, which {why}; ready: {[str(t) for t in self.view.ready]}",
                policy=self.policy_name,
                rank=self.rank,
                step=st.step,
                task=task,
            )
        return pos


_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def suspended_at(tb: types.TracebackType | None) -> str:
    """Where a cancelled policy coroutine was suspended, from its ``CancelledError``'s
    traceback (the policy's frames, below the decider's): its innermost frame outside
    asyncio's own modules, as ``name (file:line)``; "" when there is none."""
    where = ""
    tb = tb.tb_next if tb is not None else None  # (the first frame is the decider's)
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_ASYNCIO_DIR):
            where = f"{code.co_name} ({os.path.basename(code.co_filename)}:{tb.tb_lineno})"
        tb = tb.tb_next
    return where


def _head_waits_for_a_message(st: StepState) -> bool:
    """Whether the hinted task (the first not started) waits for a message of another rank."""
    head = st.ledger.head
    return 0 <= head < len(st.prog.order) and st.prog.src_rank[head] >= 0 and not st.arrived[head]


def watchdog_error(
    rank: int, st: StepState, policy_name: str, timeout: float, dump: str
) -> StepTimeoutError:
    """The step watchdog's error for step ``st`` of stage ``rank`` (``timeout`` s passed).

    When it fired in the policy's turn (awaited, not returned: ``st.deciding``), the policy
    is the cause, and the message opens with it (``StepTimeoutError.policy`` says so, for
    the rank's peers: see ``FailureKind.POLICY``), unless the policy was waiting on the
    ready set (``ReadyView.wait_until_ready`` / ``wait_for_change``) while the hinted task's
    message had not come: then it waited for a peer as the hint's own order would (the peer
    stopped, say; ``readiness_first`` runs a backward only in its hinted turn), and the
    message says that the step made no progress (a distributed stage opens it with what the
    step waited for)."""
    if st.deciding and not (st.view_wait and _head_waits_for_a_message(st)):
        at = f": {st.policy_at}" if st.policy_at else ""
        head = (
            f"rank {rank} step {st.step}: the policy {policy_name!r} did not return a decision"
            f" for {timeout} s (its coroutine was still running{at}, awaiting something that"
            " did not come; the watchdog cancelled it)"
        )
        return StepTimeoutError(f"{head}\n{dump}", policy=policy_name)
    head = f"rank {rank} step {st.step}: no progress to the end of the step within {timeout} s"
    return StepTimeoutError(f"{head}\n{dump}")
