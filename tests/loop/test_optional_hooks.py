"""The optional hooks of the loop's contracts (executors, observers, coordinators, event
loops, policies): an object with a hook has it called, one without it works as before.

Each hook is declared as a protocol (``rrfp_async.loop``, ``rrfp_async.policies``); these
tests hold both sides of each: the call with the hook, the old behaviour without it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import rrfp_async as rr
import rrfp_async.policies
from rrfp_async import Task
from rrfp_async.channels import LocalChannel
from rrfp_async.loop import (
    ActiveObserver,
    FailedObserver,
    OutputHookExecutor,
    SettlingExecutor,
    StepFailedExecutor,
    StepResultsExecutor,
    TiedExecutor,
)
from rrfp_async.loop._coordinator import SequenceCheck
from rrfp_async.loop._stage_loop import _clock_of
from rrfp_async.observability import MultiObserver
from rrfp_async.policies import (
    NamedPolicy,
    ReadyHeadPolicy,
    chooses_ready_head,
    policy_name,
)
from tests._virtual import run_virtual

pytestmark = pytest.mark.timeout(60)


def _schedule(stages: int = 1, m: int = 2) -> rr.StepSchedule:
    plan = rr.StepPlan(topology=rr.Topology(stages=stages), microbatches=m)
    return rr.StepSchedule.build(plan, "gpipe")


class Plain:
    """An executor with ``execute`` only: every output is its input."""

    def __init__(self) -> None:
        self.ran: list[tuple[int, Task]] = []

    async def execute(self, task: Task, data: Any, ctx: rr.TaskContext) -> Any:
        self.ran.append((ctx.step, task))
        return data


def _stage(executor: Any, **kw: Any) -> rr.StageLoop:
    kw.setdefault("endpoint", LocalChannel(1).endpoint(0))
    return rr.StageLoop(0, schedule=_schedule(), executor=executor, **kw)


# ---------------------------------------------------------------- executors


class WithResults(Plain):
    def step_results(self, step: int) -> tuple[dict[int, float], dict[int, Any]]:
        return {0: 1.5 + step}, {1: "out"}


def test_step_results_become_the_stats_losses_and_outputs() -> None:
    assert isinstance(WithResults(), StepResultsExecutor)
    stats = run_virtual(_stage(WithResults()).run_step([0, 1], step=2))
    assert stats.losses is not None and stats.losses[0] == 3.5
    assert stats.losses[1] != stats.losses[1]  # a microbatch the hook does not name: NaN
    assert stats.outputs == (None, "out")


def test_without_step_results_the_stats_have_no_losses() -> None:
    assert not isinstance(Plain(), StepResultsExecutor)
    stats = run_virtual(_stage(Plain()).run_step([0, 1]))
    assert stats.losses is None and stats.outputs is None


class Breaks(Plain):
    """Raises in 0F1 of step 0 only."""

    async def execute(self, task: Task, data: Any, ctx: rr.TaskContext) -> Any:
        if ctx.step == 0 and task == Task.parse("0F1"):
            raise RuntimeError("task broke")
        return await super().execute(task, data, ctx)


class BreaksAndForgets(Breaks):
    def __init__(self) -> None:
        super().__init__()
        self.failed_steps: list[int] = []

    def step_failed(self, step: int) -> None:
        self.failed_steps.append(step)


@pytest.mark.parametrize("cls", [Breaks, BreaksAndForgets])
def test_step_failed_is_called_once_per_failed_step_and_optional(cls: type[Breaks]) -> None:
    ex = cls()
    assert isinstance(ex, StepFailedExecutor) == (cls is BreaksAndForgets)
    stage = _stage(ex)
    with pytest.raises(RuntimeError, match="task broke"):
        run_virtual(stage.run_step([0, 1], step=0))
    run_virtual(stage.run_step([0, 1], step=1))  # the next step runs, hook or not
    assert sorted(t for s, t in ex.ran if s == 1) == sorted(
        Task.parse(x) for x in ("0F0", "0F1", "0B1", "0B0")
    )
    if isinstance(ex, BreaksAndForgets):
        assert ex.failed_steps == [0]


class Hangs(Plain):
    """Its first task never ends."""

    async def execute(self, task: Task, data: Any, ctx: rr.TaskContext) -> Any:
        await asyncio.Event().wait()


class HangsAndSettles(Hangs):
    def __init__(self) -> None:
        super().__init__()
        self.settled = 0

    async def settle(self) -> None:
        self.settled += 1


@pytest.mark.parametrize("cls", [Hangs, HangsAndSettles])
def test_a_cancelled_step_settles_the_executor_when_it_can(cls: type[Hangs]) -> None:
    ex = cls()
    assert isinstance(ex, SettlingExecutor) == (cls is HangsAndSettles)
    stage = _stage(ex)

    async def main() -> None:
        await asyncio.wait_for(stage.run_step([0, 1]), 1.0)

    with pytest.raises(TimeoutError):
        run_virtual(main())
    if isinstance(ex, HangsAndSettles):
        assert ex.settled == 1


class TiedStage(Plain):
    """Stage ``k`` sets its copy's gradient to ``k + 1`` in its backward of microbatch 0."""

    def __init__(self, k: int, tie: bool) -> None:
        super().__init__()
        self.k = k
        self.p = torch.nn.Parameter(torch.zeros(1))
        if tie:
            self.shared_parameters = lambda: {"w": [self.p]}

    async def execute(self, task: Task, data: Any, ctx: rr.TaskContext) -> Any:
        if task.kind == "B" and task.mb == 0:
            self.p.grad = torch.full((1,), float(self.k + 1))
        return data


@pytest.mark.parametrize("tie", [True, False])
def test_tied_parameters_are_reduced_only_when_declared(tie: bool) -> None:
    exs = [TiedStage(0, tie), TiedStage(1, tie)]
    assert all(isinstance(e, TiedExecutor) == tie for e in exs)
    pipe = rr.LocalPipeline(_schedule(stages=2, m=1), exs)
    run_virtual(pipe.run_step([0]))
    got = [float(e.p.grad) for e in exs]  # type: ignore[arg-type]
    assert got == ([3.0, 3.0] if tie else [1.0, 2.0])


class _Endpoint:
    """A channel endpoint; ``threadsafe`` adds the ``threadsafe_send`` capability."""

    def __init__(self, threadsafe: bool | None) -> None:
        self._inner = LocalChannel(1).endpoint(0)
        self.rank = 0
        self.inflight = 0
        if threadsafe is not None:
            self.threadsafe_send = threadsafe

    def bind(self, sink: Any) -> None:
        self._inner.bind(sink)

    def send(self, dst: int, step: int, task: Task, payload: Any) -> None:
        self._inner.send(dst, step, task, payload)


class Hooked(Plain):
    output_hook: Any = "a stale hook of another stage"

    def set_output_hook(self, hook: Any, /) -> None:
        self.output_hook = hook


@pytest.mark.parametrize("threadsafe", [True, False, None])
def test_the_output_hook_is_set_only_when_the_endpoint_sends_threadsafely(
    threadsafe: bool | None,
) -> None:
    ex = Hooked()
    assert isinstance(ex, OutputHookExecutor)
    stage = _stage(ex, endpoint=_Endpoint(threadsafe))
    if threadsafe:
        # This stage's own hook, not the stale one:
        assert callable(ex.output_hook) and stage.eager_outputs
    else:
        assert ex.output_hook is None and not stage.eager_outputs  # never a stale one
    run_virtual(stage.run_step([0, 1]))


def test_an_executor_without_an_output_hook_gets_none() -> None:
    ex = Plain()
    stage = _stage(ex, endpoint=_Endpoint(True))
    assert not hasattr(ex, "output_hook") and not stage.eager_outputs
    run_virtual(stage.run_step([0, 1]))
    assert len(ex.ran) == 4


# ---------------------------------------------------------------- observers


class Counting:
    """An observer that counts its transitions (no ``active``, no ``failed``)."""

    def __init__(self) -> None:
        self.calls = 0
        self.dumps: list[str] = []

    def _count(self, *args: Any) -> None:
        self.calls += 1

    step_start = message = ready = decision = task_start = task_end = _count
    stall = tp_decision = step_end = _count


class Inactive(Counting):
    active = False


class SeesFailures(Counting):
    def failed(self, stage: Any, exc: BaseException, dump: str) -> None:
        self.dumps.append(dump)


def test_an_inactive_observer_is_not_called_one_without_active_is() -> None:
    off, on = Inactive(), Counting()
    assert isinstance(off, ActiveObserver) and not isinstance(on, ActiveObserver)
    run_virtual(_stage(Plain(), observer=off).run_step([0, 1]))
    run_virtual(_stage(Plain(), observer=on).run_step([0, 1]))
    assert off.calls == 0 and on.calls > 0


@pytest.mark.parametrize("cls", [Counting, SeesFailures])
def test_failed_gets_the_dump_and_is_optional(cls: type[Counting]) -> None:
    obs = cls()
    assert isinstance(obs, FailedObserver) == (cls is SeesFailures)
    with pytest.raises(RuntimeError, match="task broke") as got:
        run_virtual(_stage(Breaks(), observer=obs).run_step([0, 1], step=0))
    assert not any("observer" in n for n in getattr(got.value, "__notes__", ()))
    if isinstance(obs, SeesFailures):
        assert len(obs.dumps) == 1 and "rank 0" in obs.dumps[0]


def test_multi_observer_reads_the_hooks_of_each_observer() -> None:
    off, on, sees = Inactive(), Counting(), SeesFailures()
    multi = MultiObserver(off, on, sees)
    assert multi.active and multi._live == [on, sees]
    assert not MultiObserver(off).active
    with pytest.raises(RuntimeError, match="task broke"):
        run_virtual(_stage(Breaks(), observer=multi).run_step([0, 1], step=0))
    assert off.calls == 0 and on.calls > 0 and len(sees.dumps) == 1


# ---------------------------------------------------------------- coordinators


class _Poster:
    def __init__(self) -> None:
        self.posted: list[tuple[int, int | None]] = []

    def post_failed_sequence(self, step: int, origin: int | None) -> None:
        self.posted.append((step, origin))


@pytest.mark.parametrize(
    ("exc", "origin"),
    [
        (rr.PeerStepError("elsewhere", step=3, origin=5, cause="boom"), 5),
        (RuntimeError("here"), None),
    ],
)
def test_a_failed_step_posts_its_sequence_check_with_the_origin(
    exc: BaseException, origin: int | None
) -> None:
    coord = _Poster()
    check = SequenceCheck()
    check.post_failed(coord, 3, exc)
    check.post_failed(coord, 3, exc)
    assert coord.posted == [(3, origin)]  # once per step


def test_a_coordinator_without_post_failed_sequence_posts_nothing() -> None:
    check = SequenceCheck()
    check.post_failed(object(), 3, RuntimeError("here"))
    assert check.posted == 3


# ---------------------------------------------------------------- event loops


def test_the_stage_clock_is_the_loops_only_when_it_is_virtual() -> None:
    virtual = SimpleNamespace(virtual_clock=True, time=lambda: 42.0)
    assert _clock_of(virtual)() == 42.0  # type: ignore[arg-type]
    for loop in (SimpleNamespace(virtual_clock=False, time=None), SimpleNamespace(time=None)):
        assert _clock_of(loop) is time.monotonic  # type: ignore[arg-type]


# ---------------------------------------------------------------- policies


async def _first(view: rr.ReadyView) -> Task:
    return view.ready[0]


def test_a_policys_name_attribute_names_it_else_its_qualname() -> None:
    async def chooser(view: rr.ReadyView) -> Task:
        return view.ready[0]

    assert not isinstance(chooser, NamedPolicy)
    assert policy_name(chooser).endswith("chooser")
    chooser.name = "mine"  # type: ignore[attr-defined]
    assert isinstance(chooser, NamedPolicy) and policy_name(chooser) == "mine"
    chooser.name = ""  # type: ignore[attr-defined]
    assert policy_name(chooser).endswith("chooser")  # empty: the qualname

    class Base(rr.PolicyBase):
        async def __call__(self, view: rr.ReadyView, /) -> Task:
            return view.ready[0]

    assert policy_name(Base()).endswith("Base")


def test_chooses_ready_head_is_declared_or_false() -> None:
    assert chooses_ready_head(rr.policies.get_policy("readiness_first"))
    assert isinstance(rr.policies.get_policy("strict"), ReadyHeadPolicy)
    assert not chooses_ready_head(_first)  # a plain function: no
    assert not chooses_ready_head(functools.partial(rr.policies.get_policy("readiness_first")))

    class Base(rr.PolicyBase):
        async def __call__(self, view: rr.ReadyView, /) -> Task:
            return view.ready[0]

    class Head(Base):
        chooses_ready_head = True

    assert not chooses_ready_head(Base()) and chooses_ready_head(Head())
