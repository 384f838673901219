"""Running one task of a stage: the executor call, the admission ledger, the hand-off of the
task's output, and the wait for a task still running when its step fails.

Design note
-----------
The stage runs one task at a time, like a GPU compute stream: ``execute`` marks the task
started (the admission ledger counts it in flight), awaits the executor while messages keep
arriving, then marks it finished and hands its output on: to a local consumer's inbox, and
through the channel to a remote one. When both the executor and the endpoint allow it
(``OutputHookExecutor``, ``ThreadsafeEndpoint.threadsafe_send``), a remote output leaves from
the compute thread the moment it exists (``send_output``), not when the loop resumes.

A step that ends while one of its tasks is still on the executor waits for it (``settle``,
bounded and shielded), so that nothing of that step lands after the caller's ``zero_grad``.

:class:`TaskRunner` owns the executor, the endpoint and how outputs leave; the step's state
and the ready set it updates are the :class:`~rrfp_async.loop._step_run.StepRun`'s.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import anyio

from .._tasks import Task
from ..channels import Endpoint, ThreadsafeEndpoint
from ..policies import PolicyBase
from ._executors import Executor, OutputHookExecutor, SettlingExecutor, check_awaitable
from ._records import ExecutedTask
from ._state import NO_DATA, StepState
from ._step_run import StepRun

__all__ = ["TaskRunner"]

# ``ExecutedTask(task, start, end)`` without the named tuple's Python ``__new__`` (one per
# task).
_executed = functools.partial(tuple.__new__, ExecutedTask)


class TaskRunner:
    """Runs the tasks of one stage on its executor and hands their outputs on.

    Args:
        rank: The stage's pipeline rank (for messages).
        executor: Runs the tasks (checked by the stage: ``exec_async`` says whether its
            ``execute`` is a coroutine function).
        endpoint: Where remote outputs go.
        run: The running step (its state, ready set, observer and clock).
        exec_async: Whether ``executor.execute`` is a coroutine function.
        hooks: The policy's lifecycle hooks (``on_task_end``), or None.
        settle_timeout: How long a failed step waits for its task still on the executor,
            in seconds of the loop's clock.
    """

    __slots__ = (
        "_exec_async",
        "eager",
        "endpoint",
        "executor",
        "hooks",
        "rank",
        "run",
        "settle_timeout",
    )

    def __init__(
        self,
        rank: int,
        *,
        executor: Executor,
        endpoint: Endpoint,
        run: StepRun,
        exec_async: bool = True,
        hooks: PolicyBase | None = None,
        settle_timeout: float = 30.0,
    ) -> None:
        self.rank = rank
        self.executor = executor
        self.endpoint = endpoint
        self.run = run
        self._exec_async = exec_async
        self.hooks = hooks
        self.settle_timeout = settle_timeout
        # Outputs leave from the compute thread when both sides allow it (see Executor).
        if isinstance(executor, OutputHookExecutor):  # this stage's hook, or none (not a stale one)
            #: Whether remote outputs leave from the compute thread (``send_output``).
            self.eager = isinstance(endpoint, ThreadsafeEndpoint) and bool(endpoint.threadsafe_send)
            executor.set_output_hook(self.send_output if self.eager else None)
        else:
            self.eager = False

    def send_output(self, task: Task, out: Any, step: int) -> None:
        """The executor's output hook, on its compute thread: send a remote output now.

        Reads only data that is fixed while the task runs (the step's program). The output
        of a step that is no longer running (it failed while the task computed) is dropped.
        """
        st = self.run.state
        if st is None or st.step != step:
            return
        remote = st.prog.data_remote[st.prog.pos[task]]
        if remote is not None:
            self.endpoint.send(remote[0], st.step, remote[1], out)

    async def execute(
        self, st: StepState, pos: int, started: Callable[[int, int], None] | None = None
    ) -> None:
        """Run the task at ``pos`` of step ``st`` (ready and admitted) and hand its output
        on; ``started(decisions, pos)`` is called once the executor has it."""
        run = self.run
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
        obs = run.obs
        if obs is not None:
            obs.task_start(task)
        now = run.now
        t0 = now()
        rec = run.recent
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
        t1 = now()
        if rec is not None:
            rec.append((t1, "end", task))
        st.last_end = t1
        st.ledger.finish_at(pos)
        st.finished[pos] = 1
        st.ends[pos] = t1
        st.starts[pos] = t0
        st.version += 1
        st.executed.append(_executed((task, t0, t1)))
        obs = run.obs  # None now if the observer raised while the task ran
        if obs is not None:
            obs.task_end(task, t0, t1)
        if self.hooks is not None:
            self.hooks.on_task_end(task, t1 - t0)
        dl = prog.data_local[pos]
        if dl >= 0:
            st.inbox[dl] = out
        remote = prog.data_remote[pos]
        if remote is not None and not self.eager:
            self.endpoint.send(remote[0], st.step, remote[1], out)
        for nxt in prog.local_next[pos]:
            run.satisfy(st, nxt)

    async def settle(self, st: StepState, exc: BaseException) -> None:
        """The step ends with ``exc`` while a task runs on the executor (it was cancelled,
        or its watchdog fired): wait for that task to end before ``run_step`` raises, so
        that nothing of this step (a gradient) lands after the caller's ``zero_grad``.

        The wait is bounded (``settle_timeout``: a task that hangs must not turn a cancel
        into a hang) and shielded: a cancel scope that cancels again (anyio's do, every
        loop iteration) cannot cut it short. A task still running after the bound is
        named in a note on ``exc``.
        """
        ex = self.executor
        if not isinstance(ex, SettlingExecutor):
            return
        task = st.prog.order[st.running]
        inner = asyncio.ensure_future(ex.settle())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        # anyio's scopes cancel again at every await (level-triggered): its shield keeps
        # them off (no spinning while the task computes); asyncio's cancel comes once.
        with anyio.CancelScope(shield=True):
            while not inner.done():
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait((inner,), timeout=left)
                except asyncio.CancelledError:
                    continue  # cancelled again (asyncio): the wait goes on until the bound
        if not inner.done():
            inner.cancel()
            exc.add_note(
                f"rank {self.rank} step {st.step}: task {task} was still running on the"
                f" executor {self.settle_timeout} s after the step ended; what it writes (a"
                " gradient) may land after the next zero_grad"
            )
        elif not inner.cancelled() and inner.exception() is not None:
            err = inner.exception()
            exc.add_note(f"rank {self.rank} step {st.step}: waiting for {task} raised {err!r}")
