"""Dispatch of a stage loop: which ready task runs next, and running it.

A part of :class:`~rrfp_async.loop.StageLoop` (see the design note in ``_loop_fields``): the
dispatch loop of a stage that decides for itself (no TP, or the TP leader, which publishes
each decision and looks one ahead), the check of the policy's choice, and ``_execute``,
which runs one task on the executor and hands its output on. The design note of the loop is
right above it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from .._errors import PolicyError, RRFPError
from .._tasks import Task
from ..policies import chooses_ready_head
from ._executors import check_awaitable
from ._loop_delivery import MessageDelivery
from ._loop_fields import Coordinator
from ._records import ExecutedTask
from ._state import NO_DATA, StepState

__all__ = ["Dispatch"]

# ``ExecutedTask(task, start, end)`` without the named tuple's Python ``__new__`` (one per
# task).
_executed = functools.partial(tuple.__new__, ExecutedTask)


class Dispatch(MessageDelivery):
    """The dispatch of :class:`~rrfp_async.loop.StageLoop` (a mixin of it)."""

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

    async def _decide_and_run(self, st: StepState, coord: Coordinator | None) -> None:
        policy = self.policy
        view = self._view
        obs = self._obs
        order = st.prog.order
        pre = -1  # a look-ahead decision already published for the next dispatch
        reason = functools.partial(st.stall_reason, self.policy_name)
        look = None
        if coord is not None and chooses_ready_head(policy):

            def look(seq: int, running: int) -> None:
                nonlocal pre
                if self._st is not st or st.decisions != seq or pre >= 0:
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
                        self.fail(e)
                        return
                    if obs is not None:
                        obs.tp_decision(self, order[h], st.decisions, True)
                    pre = h

        while st.left:
            if self._failure is not None:
                raise self._failure
            if pre >= 0:
                pos, pre = pre, -1
                if obs is not None:
                    obs.decision(self, order[pos], view.ready, self._now() - st.last_end)
                await self._execute(st, pos, look)
                continue
            if not st.admitted():
                await self._wait(reason)
                continue
            st.deciding = True
            try:
                task = await policy(view)
            except RRFPError:
                raise
            except asyncio.CancelledError as e:
                cur = asyncio.current_task()
                if cur is None or cur.cancelling():
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
            pos = self._check_choice(st, task)
            if coord is not None:
                coord.publish(st.step, st.decisions, task)
                if obs is not None:
                    obs.tp_decision(self, task, st.decisions, True)
            if obs is not None:
                obs.decision(self, task, view.ready, self._now() - st.last_end)
            await self._execute(st, pos, look)

    def _check_choice(self, st: StepState, task: object) -> int:
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
                f" {task!r}, which {why}; ready: {[str(t) for t in self._view.ready]}",
                policy=self.policy_name,
                rank=self.rank,
                step=st.step,
                task=task,
            )
        return pos

    async def _execute(
        self, st: StepState, pos: int, started: Callable[[int, int], None] | None = None
    ) -> None:
        prog = st.prog
        task = prog.order[pos]
        st.decisions += 1
        if pos != st.ledger.head:
            st.deviations += 1
        st.ledger.start_at(pos)
        st.started[pos] = 1
        st.ready.remove(pos)
        st.version += 1
        st.left -= 1
        data = st.inbox[pos]
        st.inbox[pos] = NO_DATA
        if data is NO_DATA:
            data = None
        obs = self._obs
        if obs is not None:
            obs.task_start(self, task)
        t0 = self._now()
        rec = self.recent
        if rec is not None:
            rec.append((t0, "start", task))
        if started is not None:
            # Runs once the executor has handed the task to its compute thread and yields:
            # a look-ahead broadcast must not delay the task's own start.
            asyncio.get_running_loop().call_soon(started, st.decisions, pos)
        st.running = pos
        try:
            if self._exec_async:
                out = await self.executor.execute(task, data, st.ctx)
            else:  # see check_executor: a plain callable must hand back an awaitable
                aw = self.executor.execute(task, data, st.ctx)
                check_awaitable(aw, self.executor, task, st.ctx)
                out = await aw
        except Exception:
            st.running = -1  # it failed: it no longer runs (a cancelled one was running)
            raise
        st.running = -1
        t1 = self._now()
        if rec is not None:
            rec.append((t1, "end", task))
        st.last_end = t1
        st.ledger.finish_at(pos)
        st.finished[pos] = 1
        st.ends[pos] = t1
        st.starts[pos] = t0
        st.version += 1
        st.executed.append(_executed((task, t0, t1)))
        if obs is not None:
            obs.task_end(self, task, t0, t1)
        if self._hooks is not None:
            self._hooks.on_task_end(task, t1 - t0)
        dl = prog.data_local[pos]
        if dl >= 0:
            st.inbox[dl] = out
        remote = prog.data_remote[pos]
        if remote is not None and not self._eager:
            self.endpoint.send(remote[0], st.step, remote[1], out)
        for nxt in prog.local_next[pos]:
            self._satisfy(st, nxt)
