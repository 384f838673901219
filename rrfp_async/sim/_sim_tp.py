"""TP coordination in the simulator, and the model of its cost as a function of TP degree.

Design note: what a simulated TP group pays
-------------------------------------------
A real stage of TP degree ``t`` is ``t`` processes that run one task sequence: the leader's
policy decides and sends each decision to the ``t - 1`` followers (``DecisionChannel``),
and a follower starts a task only once that decision has arrived. Inside the task the TP
collectives make every member wait for the last one, so a task starts, for the whole
group, at ``max(leader's dispatch, decision + latency)``. The simulator keeps one
``StageLoop`` per stage (the members are symmetric: they see the same inputs at the same
times), and models the followers faithfully on the virtual clock:

* each stage loop is a TP leader: its coordinator (``SimCoordinator``) is handed every
  decision by the real ``StageLoop`` code, *including the look-ahead*, which publishes the
  next decision while the current task runs when the hinted task is (or will be) ready;
* the stage's executor (``TPExecutor``) starts the task's compute only at ``decision +
  latency``: a decision taken when the leader's compute frees up delays the task by the
  full latency, one sent ahead is free once the running task outlasts it;
* a decision the followers *deduce* costs no latency: under a policy that
  ``chooses_ready_head``, the hint's next task when it is ready with local inputs only
  (``StageLoop``'s "Deduced TP decisions"); the coordinator marks it when it is published
  (the stage's hint head, no input message) and the executor starts it at once;
* every stage ends the step with the end-of-step check, ``check`` seconds after its last
  task (the makespan includes it).

With ``latency == check == 0`` nothing is installed: the step is exactly today's.

The model: ``TPTerm``
---------------------
A per-decision or per-step term as a function of the TP degree, ``a + b * f(tp)`` with
``f = log2`` (tree-like: a broadcast, an all-gather's rounds) or ``f(tp) = tp - 1`` (the
leader sends to each follower in turn), least-squares fitted to measurements
(``fit_tp_term``, both forms, the smaller residual wins) and cross-checked by
leave-one-out (``leave_one_out``). The defaults (``TP_DECISION_LATENCY``, ``TP_STEP_CHECK``)
were fitted to ``rrfp-async bench overhead --section tp`` (gloo on loopback, CPU processes
sharing few cores: BENCHMARKS.md#tp-coordination-the-curve): a pessimistic figure for a GPU
cluster, where the same exchange runs on idle cores.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._check import check_int, check_real
from .._errors import PlanError
from .._tasks import Task
from ..loop import Executor

__all__ = [
    "TP_DECISION_LATENCY",
    "TP_STEP_CHECK",
    "SimCoordinator",
    "TPDecision",
    "TPExecutor",
    "TPTerm",
    "attach",
    "fit_tp_term",
    "leave_one_out",
    "resolve_tp",
    "tp_executors",
]

Form = Literal["log2", "linear"]
_FORMS: tuple[Form, ...] = ("log2", "linear")


def _f(form: Form, tp: float) -> float:
    return math.log2(tp) if form == "log2" else tp - 1.0


@dataclass(frozen=True, kw_only=True)
class TPTerm:
    """A coordination cost in seconds as a function of the TP degree: ``a + b * f(tp)``,
    ``f = log2`` or ``f(tp) = tp - 1``; zero at TP 1 (nothing to coordinate), never negative.

    Attributes:
        form: ``"log2"`` or ``"linear"``.
        a: Seconds at ``f = 0``.
        b: Seconds per unit of ``f``.
        residual: Root-mean-square residual of the fit it came from (seconds), if fitted.
    """

    form: Form
    a: float
    b: float
    residual: float = 0.0

    def __post_init__(self) -> None:
        if self.form not in _FORMS:
            raise PlanError(f"TPTerm.form must be one of {_FORMS}, got {self.form!r}")

    def __call__(self, tp: int) -> float:
        """Seconds at TP degree ``tp`` (0 for ``tp <= 1``)."""
        if tp <= 1:
            return 0.0
        return max(0.0, self.a + self.b * _f(self.form, tp))

    def __str__(self) -> str:
        f = "log2(tp)" if self.form == "log2" else "(tp - 1)"
        return f"{1e6 * self.a:.0f} µs + {1e6 * self.b:.0f} µs x {f}"


def _lstsq(form: Form, points: Sequence[tuple[int, float]]) -> TPTerm:
    xs = [_f(form, tp) for tp, _ in points]
    ys = [y for _, y in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    res = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys, strict=True)) / n)
    return TPTerm(form=form, a=a, b=b, residual=res)


def fit_tp_term(
    points: Sequence[tuple[int, float]], form: Form | None = None
) -> tuple[TPTerm, TPTerm | None]:
    """Least-squares fit of ``a + b * f(tp)`` to ``(tp, seconds)`` points.

    Args:
        points: At least two measurements at two or more distinct TP degrees.
        form: Fit only this form (None: both).

    Returns:
        ``(chosen, other)``: with ``form=None`` the form with the smaller RMS residual and
        the other one (for the report); else the asked form and None.

    Raises:
        PlanError: Fewer than two distinct TP degrees.
    """
    if len({tp for tp, _ in points}) < 2:
        raise PlanError(f"fit_tp_term needs two or more distinct TP degrees, got {points}")
    if form is not None:
        return _lstsq(form, points), None
    log2, linear = _lstsq("log2", points), _lstsq("linear", points)
    return (log2, linear) if log2.residual <= linear.residual else (linear, log2)


def leave_one_out(
    points: Sequence[tuple[int, float]], form: Form | None = None
) -> list[tuple[int, float, float]]:
    """For each point: fit on the others (``fit_tp_term``, same ``form``), predict it.

    Returns:
        ``(tp, measured, predicted)`` per point (needs three or more distinct degrees).
    """
    out = []
    for i, (tp, y) in enumerate(points):
        rest = [p for j, p in enumerate(points) if j != i]
        term, _ = fit_tp_term(rest, form)
        out.append((tp, y, term(tp)))
    return out


# Fitted to `rrfp-async bench overhead --section tp` (TP 1, 2, 4, 8; the fit, its
# leave-one-out check and the figures: BENCHMARKS.md#tp-coordination-the-curve): the
# followers' first-task delay, a decision that could not be sent ahead, linear in tp - 1;
# and the end of the step with the sequence check folded into the decisions, too noisy below
# TP 8 to fit, so linear in tp - 1 through zero. Pass tp_latency= / tp_check= to override.
TP_DECISION_LATENCY = TPTerm(form="linear", a=32e-6, b=322e-6)
"""Default latency of one TP decision in the simulator (seconds, by TP degree)."""
TP_STEP_CHECK = TPTerm(form="linear", a=0.0, b=100e-6)
"""Default end-of-step cost of TP coordination in the simulator (seconds, by TP degree)."""


def resolve_tp(tp: int, latency: float | None, check: float | None) -> tuple[int, float, float]:
    """Check ``simulate``'s TP arguments; fill the defaults from the fitted model.

    Raises:
        PlanError: ``tp`` not an int >= 1, or a latency that is not a finite number >= 0.
    """
    tp = check_int("tp", tp, minimum=1)
    if latency is None:
        latency = TP_DECISION_LATENCY(tp)
    latency = check_real("tp_latency", latency, minimum=0.0)
    if check is None:
        check = TP_STEP_CHECK(tp)
    check = check_real("tp_check", check, minimum=0.0)
    if tp == 1:
        return 1, 0.0, 0.0
    return tp, latency, check


@dataclass(frozen=True)
class TPDecision:
    """One coordinated task of a simulated TP group: the leader took the decision at
    ``decided`` (virtual seconds), the group started the task at ``start`` (no earlier
    than ``decided + latency``: the followers had to receive it; or, when ``deduced``, at
    the leader's dispatch: the followers deduced the decision without receiving it)."""

    task: Task
    decided: float
    start: float
    deduced: bool = False


class SimCoordinator:
    """The coordinator of a simulated TP group: the stage loop is its leader; each
    decision it ``publish``es is stamped with the virtual time (what ``TPExecutor`` waits
    for). Followers are not separate loops: see the module's design note."""

    is_leader = True

    def __init__(self) -> None:
        self.decided: dict[Task, float] = {}
        self.deduced: set[Task] = set()  # decisions the followers deduce (no latency)
        self.log: list[TPDecision] = []
        self._clock: Any = None
        self.stage: Any = None  # the stage loop that leads (``attach``)

    def begin_step(self, step: int, decisions: int) -> None:
        self.decided.clear()
        self.deduced.clear()
        self.log.clear()
        self._clock = asyncio.get_running_loop().time

    def publish(self, step: int, seq: int, task: Task) -> None:
        self.decided[task] = self._clock()
        stage = self.stage
        # The followers' condition (``StageLoop.deduces``): the head, no input message.
        # Ready there too: they are symmetric to the leader (see the design note).
        if stage is not None and stage.deduces(task):
            self.deduced.add(task)

    async def receive(self, step: int, seq: int) -> Task:  # pragma: no cover - leader only
        raise PlanError("a simulated TP group has no follower loops")

    async def end_step(self) -> None:
        return None

    async def verify_sequence(self, step: int, executed: Sequence[Task]) -> None:
        return None


class TPExecutor:
    """Wraps a stage's executor: a task's compute starts no earlier than its decision plus
    ``latency`` (virtual seconds), as the followers of a TP group start it."""

    def __init__(self, inner: Executor, coordinator: SimCoordinator, latency: float) -> None:
        self.inner = inner
        self.coordinator = coordinator
        self.latency = latency

    async def execute(self, task: Task, data: Any, ctx: Any, /) -> Any:
        loop = asyncio.get_running_loop()
        coord = self.coordinator
        decided = coord.decided.get(task)
        if decided is None:
            raise PlanError(f"simulated TP: {task} ran without a decision (a StageLoop bug)")
        if task in coord.deduced:  # the followers started it without the decision
            coord.log.append(TPDecision(task, decided, loop.time(), deduced=True))
            return await self.inner.execute(task, data, ctx)
        wait = decided + self.latency - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        coord.log.append(TPDecision(task, decided, loop.time()))
        return await self.inner.execute(task, data, ctx)


def tp_executors(
    inner: Executor, stages: int, latency: float
) -> tuple[list[TPExecutor], list[SimCoordinator]]:
    """One ``TPExecutor`` around ``inner`` and one ``SimCoordinator`` per stage."""
    coords = [SimCoordinator() for _ in range(stages)]
    return [TPExecutor(inner, c, latency) for c in coords], coords


def attach(stages: Sequence[Any], coords: Sequence[SimCoordinator]) -> None:
    """Tell each coordinator the stage loop it leads (built with it as its ``coordinator``:
    ``LocalPipeline(coordinators=)``, see the design note): the real look-ahead and publish
    code then runs on the virtual clock."""
    for stage, coord in zip(stages, coords, strict=True):
        coord.stage = stage
