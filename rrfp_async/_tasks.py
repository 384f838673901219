"""The schedule IR: tasks, the pipeline topology and the dependency graph of one step.

Everything here is plain, immutable data with pure functions; every other layer imports it.

Text form of a task (the same as torch.distributed.pipelining's actions)::

    2F3   virtual stage 2, forward,                microbatch 3
    0B1   virtual stage 0, full backward,          microbatch 1
    5I0   virtual stage 5, backward for the input, microbatch 0
    5W0   virtual stage 5, backward for weights,   microbatch 0
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple, TypeAlias

from ._check import check_bool, check_count, check_type, describe
from ._errors import HintError, PlanError

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "Kind",
    "Placement",
    "StepPlan",
    "Task",
    "Topology",
    "activation_delta",
    "format_tasks",
    "parse_tasks",
]

Kind: TypeAlias = Literal["F", "B", "I", "W"]
"""Task kind: ``F`` forward, ``B`` full backward, ``I`` input-gradient, ``W`` weight-gradient."""

FORWARD: Kind = "F"
BACKWARD: Kind = "B"
BACKWARD_INPUT: Kind = "I"
BACKWARD_WEIGHT: Kind = "W"

Placement: TypeAlias = Literal["interleaved", "vshape"]

_TASK_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class Task(NamedTuple):
    """One unit of work of a pipeline step: one pass of one microbatch on one virtual stage.

    A task is a plain, hashable value (a named tuple: hashing and comparison run at C
    speed, which keeps the simulator fast). Its text form is ``{stage}{kind}{microbatch}``,
    e.g. ``2F3``; ``Task.parse`` reads it back.

    Attributes:
        stage: The *virtual* stage, ``0 .. P*V - 1``: one model chunk on one pipeline rank
            (rank x chunk), not a pipeline rank. ``Topology.rank_of(stage)`` is the rank that
            runs it; stage and rank coincide only with one chunk per rank (V = 1).
        kind: ``"F"``, ``"B"``, ``"I"`` or ``"W"``.
        mb: The microbatch index.
    """

    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    def __repr__(self) -> str:
        return f"Task({self.stage}{self.kind}{self.mb})"

    @classmethod
    def parse(cls, text: str) -> Task:
        """Parse the compact text form, e.g. ``"2F3"``.

        Raises:
            HintError: The text is not of the form ``{stage}{F|B|I|W}{microbatch}`` (a
                ``ValueError``).
        """
        m = _TASK_RE.match(text) if isinstance(text, str) else None
        if m is None:
            raise HintError(
                f"cannot parse task {describe(text)}: expected"
                " '{stage}{F|B|I|W}{microbatch}', e.g. '2F3'"
            )
        kind: Kind = m.group(2)  # type: ignore[assignment]
        return cls(int(m.group(1)), kind, int(m.group(3)))


def format_tasks(tasks: Iterable[Task]) -> str:
    """The compact text form of a task sequence, space separated (``"0F0 0F1 0B0"``)."""
    return " ".join(map(str, tasks))


def parse_tasks(text: str) -> list[Task]:
    """Parse a whitespace- or comma-separated sequence of tasks (inverse of ``format_tasks``).

    Raises:
        HintError: ``text`` is not a string, or a token is not a task.
    """
    if not isinstance(text, str):
        raise HintError(f"parse_tasks needs a string such as '0F0 0F1', got {describe(text)}")
    return [Task.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Placement of virtual stages on pipeline ranks: P ranks x V chunks per rank.

    Two words, two things. A *pipeline rank* (``0 .. P-1``) is one position along the
    pipeline, run by one process (or one TP group); ``stages`` counts them (the
    pipeline-parallel size). A *virtual stage* (``0 .. P*V - 1``) is one model chunk on one
    rank (rank x chunk); it is what ``Task.stage`` names and ``num_virtual`` counts. Rank
    ``r`` runs the V virtual stages ``stages_of(r)``; virtual stage ``v`` runs on rank
    ``rank_of(v)``.

    Interleaved placement (Megatron, torch): virtual stage ``v`` lives on rank ``v % P``.
    V-shape placement (zero-bubble ZB-V): chunk ``c`` goes down the ranks when ``c`` is even
    and back up when it is odd, so the last virtual stage lands on rank 0.

    Attributes:
        stages: Number of pipeline ranks P (>= 1), not of virtual stages (``num_virtual``).
        chunks: Number of model chunks (virtual stages) per rank V (>= 1).
        placement: ``"interleaved"`` (default) or ``"vshape"``.
    """

    stages: int
    chunks: int = 1
    placement: Placement = "interleaved"

    def __post_init__(self) -> None:
        check_count("stages", self.stages)
        check_count("chunks", self.chunks)
        if not isinstance(self.placement, str) or self.placement not in ("interleaved", "vshape"):
            raise PlanError(
                f"placement must be 'interleaved' or 'vshape', got {describe(self.placement)}"
            )

    @property
    def num_virtual(self) -> int:
        """Number of virtual stages, P * V."""
        return self.stages * self.chunks

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The rank of every virtual stage, indexed by virtual stage (``rank_of`` as a
        table, for loops that look it up per task)."""
        return self._rank_of

    @cached_property
    def _rank_of(self) -> tuple[int, ...]:
        p = self.stages
        out = []
        for v in range(self.num_virtual):
            c, r = divmod(v, p)
            if self.placement == "vshape" and c % 2 == 1:
                r = p - 1 - r
            out.append(r)
        return tuple(out)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs virtual stage ``stage``."""
        return self._rank_of[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages of ``rank``, in chunk order."""
        return tuple(v for v, r in enumerate(self._rank_of) if r == rank)


_DELTA = {"F": 1, "B": -1, "I": -1, "W": 0}


def activation_delta(kind: Kind) -> int:
    """How a task of ``kind`` changes its rank's in-flight activation count.

    A forward stashes one activation (+1); the backward that consumes it (``B``, or ``I``
    when the backward is split) frees it (-1); ``W`` holds no extra activation (0). This is
    the accounting of the admission bound.
    """
    return _DELTA[kind]


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The tasks of one step and their dependencies.

    Dependencies: ``F(m,v)`` after ``F(m,v-1)``; ``B(m,v)`` (or ``I(m,v)``) after ``F(m,v)``
    and after ``B(m,v+1)`` (or ``I(m,v+1)``); ``W(m,v)`` after ``I(m,v)``. A *data*
    dependency carries a tensor (activation or gradient) and crosses ranks when the two
    stages live on different ranks; the others are local.

    With ``ordered_weights`` (split backward only), ``W(m,v)`` also follows ``W(m-1,v)``: the
    weight gradients of a stage are accumulated in microbatch order whatever order the other
    tasks run in, so parameter gradients are bitwise independent of the dispatch order.

    Attributes:
        topology: The rank x chunk placement.
        microbatches: Number of microbatches M (>= 1).
        split_backward: When true the backward is split into ``I`` and ``W`` tasks.
        ordered_weights: Run each stage's ``W`` tasks in microbatch order.
        forward_only: A forward-only (evaluation) step: ``F`` tasks only, nothing stashed
            for a backward (see ``StepSchedule.forward_only``).
    """

    topology: Topology
    microbatches: int
    split_backward: bool = False
    ordered_weights: bool = False
    forward_only: bool = False
    # Memo of producers/consumers: hint generators, validation and the stage programs ask
    # for them thousands of times per step schedule.
    _producers: dict[Task, tuple[Task, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _consumers: dict[Task, tuple[Task, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _tasks_of: dict[int, tuple[Task, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    _graph: list[TaskGraph] = field(
        default_factory=list, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        check_type("topology", self.topology, Topology, "a Topology")
        check_count("microbatches", self.microbatches)
        check_bool("split_backward", self.split_backward)
        check_bool("ordered_weights", self.ordered_weights)
        check_bool("forward_only", self.forward_only)
        if self.ordered_weights and not self.split_backward:
            raise PlanError("ordered_weights needs split_backward=True (W tasks to order)")
        if self.forward_only and self.split_backward:
            raise PlanError("a forward_only plan has no backward to split (split_backward=True)")

    @property
    def stages(self) -> int:
        """Number of pipeline ranks P, not of virtual stages (that is ``num_virtual``)."""
        return self.topology.stages

    @property
    def num_virtual(self) -> int:
        """Number of virtual stages P * V."""
        return self.topology.num_virtual

    @property
    def backward_kind(self) -> Kind:
        """``"I"`` when the backward is split, else ``"B"``."""
        return BACKWARD_INPUT if self.split_backward else BACKWARD

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The task kinds of this plan."""
        if self.forward_only:
            return ("F",)
        return ("F", "I", "W") if self.split_backward else ("F", "B")

    def rank_of(self, task: Task) -> int:
        """The pipeline rank that runs ``task``."""
        return self.topology._rank_of[task.stage]

    def tasks_of(self, rank: int) -> list[Task]:
        """Every task of ``rank`` in a canonical order (stage, kind, microbatch)."""
        got = self._tasks_of.get(rank)
        if got is None:  # memo: validation, the hints and the bound each ask per rank
            got = self._tasks_of[rank] = tuple(
                Task(v, k, m)
                for v in self.topology.stages_of(rank)
                for k in self.kinds
                for m in range(self.microbatches)
            )
        return list(got)

    def all_tasks(self) -> Iterator[Task]:
        """Every task of the step, rank by rank."""
        for r in range(self.stages):
            yield from self.tasks_of(r)

    def data_producer(self, task: Task) -> Task | None:
        """The task whose output (activation or gradient) ``task`` consumes, if any.

        The first stage's forward reads the microbatch and the last stage's backward reads
        the loss, so they have no data producer.
        """
        v, k, m = task
        if k == "F":
            return Task(v - 1, "F", m) if v > 0 else None
        if k in ("B", "I"):
            return Task(v + 1, self.backward_kind, m) if v < self.num_virtual - 1 else None
        return None

    def local_producer(self, task: Task) -> Task | None:
        """The same-stage task ``task`` follows: ``F`` before ``B``/``I``, ``I`` before ``W``."""
        v, k, m = task
        if k in ("B", "I"):
            return Task(v, "F", m)
        if k == "W":
            return Task(v, "I", m)
        return None

    def producers(self, task: Task) -> tuple[Task, ...]:
        """All tasks ``task`` depends on."""
        deps = self._producers.get(task)
        if deps is None:
            # (local producer, data producer), those that exist, in that order
            lp, dp = self.local_producer(task), self.data_producer(task)
            if lp is None:
                deps = () if dp is None else (dp,)
            else:
                deps = (lp,) if dp is None else (lp, dp)
            if self.ordered_weights and task.kind == "W" and task.mb > 0:
                deps += (Task(task.stage, "W", task.mb - 1),)
            self._producers[task] = deps
        return deps

    def data_consumer(self, task: Task) -> Task | None:
        """The task that consumes ``task``'s output tensor, if any (inverse of data_producer)."""
        v, k, m = task
        if k == "F":
            return Task(v + 1, "F", m) if v < self.num_virtual - 1 else None
        if k in ("B", "I"):
            return Task(v - 1, k, m) if v > 0 else None
        return None

    def consumers(self, task: Task) -> tuple[Task, ...]:
        """All tasks that depend on ``task``."""
        got = self._consumers.get(task)
        if got is not None:
            return got
        v, k, m = task
        out: list[Task] = []
        c = self.data_consumer(task)
        if c is not None:
            out.append(c)
        if k == "F":
            if not self.forward_only:
                out.append(Task(v, self.backward_kind, m))
        elif k == "I":
            out.append(Task(v, "W", m))
        elif k == "W" and self.ordered_weights and m + 1 < self.microbatches:
            out.append(Task(v, "W", m + 1))
        got = self._consumers[task] = tuple(out)
        return got

    def contains(self, task: Task) -> bool:
        """Whether ``task`` belongs to this step."""
        return (
            0 <= task.stage < self.num_virtual
            and task.kind in self.kinds
            and 0 <= task.mb < self.microbatches
        )

    @property
    def num_tasks(self) -> int:
        """Total number of tasks in the step."""
        return self.num_virtual * self.microbatches * len(self.kinds)

    @property
    def graph(self) -> TaskGraph:
        """The step's tasks numbered ``0 .. num_tasks - 1`` and its dependency graph as flat
        lists over those numbers (built once, then cached): what the planning code (list
        scheduling, hint checks, the lower bound, the stage programs) runs on."""
        if not self._graph:
            self._graph.append(TaskGraph(self))
        return self._graph[0]


class TaskGraph:
    """A step's tasks as integers and its dependency graph as lists indexed by them.

    Task ``(v, k, i)`` is number ``kind_base[k] + v * m + i`` (kinds in ``plan.kinds``
    order): the forwards come first, virtual stage by virtual stage, then the backwards
    (``B`` or ``I``), then the ``W`` tasks. Every list holds the same values, in the same
    order, as the plan's per-task methods (``producers``, ``consumers``, ``data_producer``,
    ``data_consumer``, ``rank_of``, ``tasks_of``); a test holds them equal on random plans.
    The planning code runs on these numbers: list indexing instead of hashing a ``Task``
    per lookup (dicts of 10^5 tuples outgrow the caches) made it 2.0x faster at 64 x 512
    and 2.3x at 128 x 1024 (hint, checks, programs and lower bound together; BENCHMARKS.md).

    Attributes:
        tasks: The task of each number.
        index: The number of each task.
        rank: The pipeline rank of each number.
        producers: The numbers each task depends on (``StepPlan.producers``' order).
        consumers: The numbers that depend on each task (``StepPlan.consumers``' order).
        data_producer: The number whose output each task consumes, or -1.
        data_consumer: The number that consumes each task's output, or -1.
        by_rank: Each rank's numbers in ``StepPlan.tasks_of`` order.
        kind_base: The number of ``Task(0, kind, 0)`` for each kind of the plan.
        num_forward: How many forwards (numbers ``0 .. num_forward - 1``).
        num_backward: How many ``B``/``I`` tasks (the numbers after the forwards).
    """

    __slots__ = (
        "by_rank",
        "consumers",
        "data_consumer",
        "data_producer",
        "index",
        "kind_base",
        "num_backward",
        "num_forward",
        "producers",
        "rank",
        "tasks",
    )

    def __init__(self, plan: StepPlan) -> None:
        nv, m = plan.num_virtual, plan.microbatches
        kinds = plan.kinds
        cell = nv * m
        self.kind_base: dict[Kind, int] = {k: j * cell for j, k in enumerate(kinds)}
        self.tasks: tuple[Task, ...] = tuple(
            Task(v, k, i) for k in kinds for v in range(nv) for i in range(m)
        )
        n = len(self.tasks)
        # One int object per number, shared by every list and tuple below (a number above
        # 256 is an object of its own each time it is computed: 28 bytes per reference).
        num = list(range(n))
        self.index: dict[Task, int] = dict(zip(self.tasks, num, strict=True))
        stage_rank = plan.topology.stage_ranks
        self.rank: list[int] = [stage_rank[v] for _ in kinds for v in range(nv) for _ in range(m)]
        self.num_forward = cell
        self.num_backward = 0 if plan.forward_only else cell
        prods: list[tuple[int, ...]] = [()] * n
        cons: list[tuple[int, ...]] = [()] * n
        dprod = [-1] * n
        dcons = [-1] * n
        last = nv - 1
        b = cell  # the first B/I number
        w = 2 * cell  # the first W number
        split = plan.split_backward
        ordered = plan.ordered_weights
        fwd_only = plan.forward_only
        for v in range(nv):
            row = v * m
            for i in range(m):
                f = row + i
                # F(v, i): after F(v-1, i); feeds F(v+1, i) and its own backward.
                if v > 0:
                    prev = num[f - m]
                    prods[f] = (prev,)
                    dprod[f] = prev
                if v < last:
                    nxt = num[f + m]
                    dcons[f] = nxt
                    cons[f] = (nxt,) if fwd_only else (nxt, num[b + f])
                elif not fwd_only:
                    cons[f] = (num[b + f],)
                if fwd_only:
                    continue
                # B/I(v, i): after F(v, i) and B/I(v+1, i); feeds B/I(v-1, i) and W(v, i).
                bi = b + f
                if v < last:
                    up = num[bi + m]
                    prods[bi] = (num[f], up)
                    dprod[bi] = up
                else:
                    prods[bi] = (num[f],)
                if v > 0:
                    down = num[bi - m]
                    dcons[bi] = down
                    cons[bi] = (down, num[w + f]) if split else (down,)
                elif split:
                    cons[bi] = (num[w + f],)
                if split:
                    # W(v, i): after I(v, i) (and W(v, i-1) with ordered weights).
                    wi = w + f
                    if ordered and i > 0:
                        prods[wi] = (num[bi], num[wi - 1])
                    else:
                        prods[wi] = (num[bi],)
                    if ordered and i + 1 < m:
                        cons[wi] = (num[wi + 1],)
        self.producers: list[tuple[int, ...]] = prods
        self.consumers: list[tuple[int, ...]] = cons
        self.data_producer: list[int] = dprod
        self.data_consumer: list[int] = dcons
        self.by_rank: tuple[tuple[int, ...], ...] = tuple(
            tuple(
                num[self.kind_base[k] + v * m + i]
                for v in plan.topology.stages_of(r)
                for k in kinds
                for i in range(m)
            )
            for r in range(plan.stages)
        )
