"""Executors: what a stage does to run one task.

An executor has one coroutine method, ``execute(task, data, ctx) -> output``. ``data`` is the
task's input: the microbatch for a first-stage forward, the received activation for a
forward, the received gradient for a backward (None on the last stage, whose backward starts
from the loss) and None for ``W``. The output is the tensor sent on (activation or input
gradient), or None.

``CostModelExecutor`` only lets time pass: it awaits each task's duration on the running
loop's clock, which is virtual in a simulation and real in a local pipeline.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .._check import describe
from .._costs import CostModel, Durations, Microbatch
from .._errors import PlanError
from .._tasks import StepPlan, Task

__all__ = [
    "CostModelExecutor",
    "Executor",
    "OutputHook",
    "OutputHookExecutor",
    "SettlingExecutor",
    "StepFailedExecutor",
    "StepResultsExecutor",
    "TaskContext",
    "TiedExecutor",
    "check_awaitable",
    "check_executor",
]


@dataclass(frozen=True, slots=True)
class TaskContext:
    """Where a task runs.

    Attributes:
        rank: The pipeline rank.
        step: The step number.
        plan: The step plan.
        microbatches: The step's microbatches as given to ``run_step``.
    """

    rank: int
    step: int
    plan: StepPlan
    microbatches: Sequence[Any]


OutputHook = Callable[[Task, Any, int], None]
"""``(task, output, step) -> None``: called on an executor's compute thread as soon as
``task``'s output of step ``step`` (``ctx.step``) exists (see ``Executor``)."""


@runtime_checkable
class Executor(Protocol):
    """Runs the tasks of one stage.

    ``execute`` is the whole contract. An executor may also implement optional hooks, each
    declared as a protocol of its own below (the stage checks for each with ``isinstance``
    and does without it): :class:`OutputHookExecutor` (``set_output_hook``),
    :class:`StepFailedExecutor` (``step_failed(step)``), :class:`SettlingExecutor`
    (``async settle()``), :class:`StepResultsExecutor` (``step_results(step)``) and
    :class:`TiedExecutor` (``shared_parameters()``).
    """

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        """Run ``task`` on ``data``; return the tensor to send on (or None)."""


# The executor's optional hooks. Each is a protocol of one member, so that an executor may
# implement any subset; the stage tests ``isinstance(executor, Hook)`` (a method set to None
# counts as absent, as it did when the stage probed for it) and behaves exactly as before
# without it. A hook must be a real attribute of the executor or its class: on Python >= 3.12
# ``isinstance`` does not see names that only ``__getattr__`` supplies.


@runtime_checkable
class OutputHookExecutor(Protocol):
    """Optional: an executor that computes on a thread of its own and may send from there.

    When the stage is built it calls ``set_output_hook`` with its send function when its
    endpoint sends thread-safely (``channels.ThreadsafeEndpoint``), else with None (so that
    a hook of an earlier stage never stays). The executor then calls ``hook(task, output,
    ctx.step)`` on its compute thread right after the output exists and before its own
    completion hand-off: the message leaves without waiting for the event loop to take the
    completion (one thread hop less on every message's path). ``execute`` still returns the
    output. The step number lets the stage drop the output of a step that failed (or was
    cancelled) while the task computed. Without the method every output is sent from the
    loop thread once ``execute`` returned.
    """

    def set_output_hook(self, hook: OutputHook | None, /) -> None:
        """Call ``hook`` with each output on the compute thread from now on (None: don't)."""


@runtime_checkable
class StepFailedExecutor(Protocol):
    """Optional: an executor that keeps state per step (stashed activations)."""

    def step_failed(self, step: int, /) -> None:
        """Step ``step`` failed (or was cancelled) on this stage: drop what was kept for it
        instead of refusing the next step. Called on the loop thread, once per failed step,
        before the stage waits for a task still computing (``settle``)."""


@runtime_checkable
class SettlingExecutor(Protocol):
    """Optional: an executor whose tasks run on a compute thread of its own."""

    async def settle(self) -> None:
        """Wait until the task being computed (if any) has ended.

        A step cancelled or failed while a task runs on a compute thread (a timeout, a cancel
        scope, Ctrl-C) awaits it before ``run_step`` raises (at most
        ``StageLoop.settle_timeout`` seconds), so that no gradient of the cancelled step
        lands after the caller's ``zero_grad``. Without it the step raises at once."""


@runtime_checkable
class StepResultsExecutor(Protocol):
    """Optional: an executor that knows the losses and outputs of the last stage."""

    def step_results(self, step: int, /) -> tuple[Mapping[int, float], Mapping[int, Any]]:
        """``(losses, outputs)`` of ``step`` by microbatch on this rank (empty mappings on a
        rank without them). Called once per step, on the rank of the last stage, when the
        step ends: they become ``StepStats.losses`` and ``StepStats.outputs`` (None
        without the hook, or when a mapping is empty; a microbatch missing from
        ``losses`` reads NaN)."""


@runtime_checkable
class TiedExecutor(Protocol):
    """Optional: an executor whose modules hold parameters tied to another stage's."""

    def shared_parameters(self) -> Mapping[str, Sequence[Any]]:
        """Tie name -> this executor's distinct parameter objects in that tie. Read after the
        backward tasks of a training step: ``LocalPipeline`` sums the gradients of each tie's
        copies, ``DistributedStage`` all-reduces them over the tie's ranks. Without it the
        executor has no ties."""


def check_executor(executor: object, rank: int) -> bool:
    """Check that ``executor`` can run rank ``rank``'s tasks; True if its ``execute`` is a
    coroutine function.

    What can be seen without running a task is checked now: ``execute`` exists, is callable
    and accepts ``(task, data, ctx)``. An ``execute`` that is callable but no coroutine
    function is still accepted: a decorated ``async def`` (``torch.no_grad()`` wraps one in a
    plain function) or a function that returns a future are valid, and nothing short of
    calling it tells them from a plain ``def`` that returns None. The stage then checks
    each call's result is awaitable (:func:`check_awaitable`); a coroutine function costs
    nothing per task.

    Raises:
        PlanError: ``execute`` is missing, None, not callable or takes other arguments.
    """
    want = "an executor needs a method `async def execute(self, task, data, ctx)`"
    if isinstance(executor, type):
        raise PlanError(
            f"executor of rank {rank}: got the class {executor.__qualname__}, not an instance"
            f" of it; {want}"
        )
    execute = getattr(executor, "execute", None)
    if execute is None or not callable(execute):
        what = "has no execute method" if execute is None else f"has execute = {describe(execute)}"
        raise PlanError(f"executor of rank {rank} {describe(executor)} {what}; {want}")
    try:
        sig = inspect.signature(execute)
    except (TypeError, ValueError):  # a builtin without a signature: take it on trust
        sig = None
    if sig is not None:
        try:
            sig.bind(None, None, None)
        except TypeError as e:
            params = ", ".join(sig.parameters)
            raise PlanError(
                f"executor of rank {rank} {describe(executor)}: execute({params}) cannot be"
                f" called as execute(task, data, ctx) ({e}); {want}"
            ) from None
    if inspect.iscoroutinefunction(execute):
        return True
    call = getattr(type(execute), "__call__", None)  # noqa: B004 - an object with async __call__
    return not (inspect.isfunction(execute) or inspect.ismethod(execute)) and (
        call is not None and inspect.iscoroutinefunction(call)
    )


def check_awaitable(result: object, executor: object, task: Task, ctx: TaskContext) -> None:
    """Raise ``PlanError`` unless ``result``, what a non-coroutine ``execute`` returned for
    ``task``, can be awaited (see :func:`check_executor`)."""
    if not inspect.isawaitable(result):
        raise PlanError(
            f"executor of rank {ctx.rank} {describe(executor)}: execute({task}) in step"
            f" {ctx.step} returned {describe(result)}, not an awaitable; execute must be a"
            " coroutine function (async def execute(self, task, data, ctx)) or return an"
            " awaitable"
        )


class CostModelExecutor:
    """An executor that only lets each task's duration pass on the loop clock.

    Args:
        durations: Fixed durations for every step, a callable ``(step, microbatches) ->
            Durations`` evaluated once per step, or a ``CostModel`` whose realized durations
            (seeded by ``seed`` and the step number) price each step's microbatches (which
            must then be ``Microbatch`` objects).
        seed: Seed of the realized jitter when ``durations`` is a ``CostModel``.

    A step fails with ``PlanError`` when its durations do not fit it: fixed ones of another
    shape, or a callable that returns anything but ``Durations`` of the step's shape (a
    dict, a list); the message names the callable and how to build ``Durations``.
    """

    def __init__(
        self,
        durations: Durations | CostModel | Callable[[int, Sequence[Any]], Durations],
        *,
        seed: int = 0,
    ) -> None:
        self._source = durations
        self._seed = seed
        # The durations of a step depend on its number (the seed), its plan and its
        # microbatches, so that is the key: one executor shared by two pipelines running
        # steps of the same number but other sizes (or microbatches) must not hand one the
        # other's durations. Microbatches are compared by identity (they may be tensors),
        # and each entry keeps its sequence alive so that an id is never reused under it.
        # A few entries: pipelines that share the executor interleave their tasks.
        self._cache: list[tuple[int, StepPlan, Sequence[Any], Durations]] = []

    _CACHED = 8

    def durations_for(self, step: int, plan: StepPlan, microbatches: Sequence[Any]) -> Durations:
        """The durations this executor uses in ``step`` (computed once per step, plan and
        microbatches)."""
        cache = self._cache
        if cache:  # the common case first: the step that ran the last task
            s, p, mbs, d = cache[0]
            if s == step and mbs is microbatches and p is plan:
                return d
        for i, (s, p, mbs, d) in enumerate(cache):
            if s == step and mbs is microbatches and (p is plan or p == plan):
                cache.insert(0, cache.pop(i))
                return d
        src = self._source
        if isinstance(src, Durations):
            d = src
            want = (plan.num_virtual, plan.microbatches)
            if d.shape != want:
                raise PlanError(
                    f"step {step}: this CostModelExecutor's fixed durations are for"
                    f" {d.shape[0]} virtual stages x {d.shape[1]} microbatches, the step has"
                    f" {want[0]} x {want[1]}; price steps of other sizes with a CostModel or a"
                    " function (step, microbatches) -> Durations"
                )
        elif isinstance(src, CostModel):
            if not all(isinstance(m, Microbatch) for m in microbatches):
                raise PlanError("a CostModel executor needs Microbatch objects to price")
            d = src.realize(plan, microbatches, seed=hash((self._seed, step)) & 0xFFFFFFFF)
        else:
            d = src(step, microbatches)
            _check_returned(src, d, step, plan)
        self._cache.insert(0, (step, plan, microbatches, d))
        del self._cache[self._CACHED :]
        return d

    async def execute(self, task: Task, data: Any, ctx: TaskContext, /) -> Any:
        """Await ``task``'s duration; pass no tensor on."""
        d = self.durations_for(ctx.step, ctx.plan, ctx.microbatches).of(task)
        if d <= 0:
            await asyncio.sleep(0)
            return None
        # ``asyncio.sleep(d)`` inlined, step for step (the same timer at the same time, the
        # same future, the same callbacks): one coroutine frame less per simulated task.
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        h = loop.call_at(loop.time() + d, _set_result_unless_cancelled, fut, None)
        try:
            await fut
        except BaseException:
            h.cancel()  # cancelled while sleeping: the timer must not stay scheduled
            raise
        # Woken by the timer itself: it already ran, so cancelling it (as sleep's
        # ``finally`` does) would change nothing.
        return None


def _check_returned(fn: object, d: object, step: int, plan: StepPlan) -> None:
    """Refuse what a durations function returned unless it is ``Durations`` of the step's
    shape (a dict, say, would fail later as ``'dict' object has no attribute 'of'``)."""
    want = (plan.num_virtual, plan.microbatches)
    if isinstance(d, Durations) and d.shape == want:
        return
    got = f"Durations of {d.shape[0]} x {d.shape[1]}" if isinstance(d, Durations) else describe(d)
    name = getattr(fn, "__qualname__", None) or describe(fn)
    raise PlanError(
        f"step {step}: CostModelExecutor's durations function {name} returned {got};"
        f" it must return rr.Durations for the step's {want[0]} virtual stages x {want[1]}"
        " microbatches: rr.Durations.from_arrays(plan, forward=[[seconds per microbatch]"
        " per virtual stage]) (the backward 2x by default), or rr.Durations({'F': ..., 'B':"
        " ..., 'I': ..., 'W': ...}) for the four kinds' tables"
    )


def _set_result_unless_cancelled(fut: asyncio.Future[None], result: None) -> None:
    # asyncio.sleep's timer callback (``asyncio.futures._set_result_unless_cancelled``).
    if not fut.cancelled():
        fut.set_result(result)
