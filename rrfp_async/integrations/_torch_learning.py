"""What the torch drop-in learns from the run: each step's sizes, then its forwards'
activation bytes and its tasks' times (``StepLearning``).

Design note
-----------
The cost-aware hint within a byte budget needs, before each step, every microbatch's
activation bytes and task times on every stage, alike on every rank (the ranks must plan the
same hint). The user's program gives torch's schedule none of that; it gives the step's
microbatches, and only to some ranks: torch's rule is positional inputs to the first stage,
targets to the last, keyword inputs to every stage.

* **Sizes.** With ``sizes=`` the user names each microbatch's features on every rank. With
  no argument (the default, *auto*), the rank that holds stage 0 reads them off the
  microbatches it was given (``chunk_sizes``: the tokens of the first ``SLOTS`` tensors
  among its positional, then keyword inputs; an integer tensor counts its elements, a
  floating one its rows along the last dimension), and one broadcast of an ``M x (SLOTS +
  1)`` float64 tensor on the learning group gives them to every rank before the step (a
  column says whether any size was read). The bytes are fitted as a full polynomial of
  degree 2 in the sizes read (``_PRODUCTS``: every product of two, not only the first
  size's square): which size is the model's sequence length is not known, and where a
  model concatenates its inputs into one sequence (image patches, then text) its length is
  a sum of them, and its attention's square term holds their cross product. Sizes never
  read are 0, their columns all zero, so they need no more steps to fit (a one-input model
  fits ``1, tokens, tokens**2`` as before). Without ``memory_budget=``, a step whose
  microbatches are all the same size (torch's own chunking of one batch) is planned as the
  fixed order plans it: nothing is measured and nothing exchanged (its one size teaches the
  fits nothing a varying step does not); after ``UNIFORM_START`` such steps from the start
  no more sizes are read (no broadcast: a job of fixed shapes pays nothing from then on).
* **Bytes and times.** A step with varying sizes is measured on every rank (the executor's
  saved-tensor meter, ``measure_activations``); after it, ``LearnedBytes`` and
  ``LearnedDurations`` exchange the measured tables on the learning group and fit every
  stage alike on every rank. Once every fit is ready, one varying step in ``LEARN_EVERY``
  is measured and learned from (the others pay neither the meter nor the exchange); the
  choice depends only on what every rank knows alike (the step count, the fits' readiness).
  Once every stage's fit is ready, a step is planned with the predicted bytes (its
  budget by default what the fixed order holds on those bytes) and, when no
  ``durations=`` were declared, the predicted times (so the default hint orders heavy
  microbatches first); before that, with the count bound and the declared durations (the
  first steps).
* **Data parallelism.** Each replica's pipeline plans its own step (replicas see other
  data), but every choice above must be the same on every rank of the job: the plan check
  compares the plan and the hint's name across the whole job, and a rank whose plan key
  changes alone waits in its all-gather alone. So the learning group is the job's, and
  the job's microbatches are every replica's, replica by replica: the sizes are summed
  over the job (each replica's rows filled by its stage-0 rank, zeros elsewhere; one
  all-reduce instead of the broadcast), the measured tables are renumbered into them
  (replica ``d``'s microbatch ``i`` is ``d * M + i``) and fitted once for the job (every
  replica's data, the same fits everywhere), a step is of one size only when every
  replica's microbatches are, and each replica plans with its own sizes.
* **One size.** A job whose microbatches all have one size (torchtitan's, packed to its
  ``seq_len``) never identifies a fit: its rows are one row. With a ``memory_budget=`` it
  still takes the learning path, and once that one size was measured its bytes are known
  exactly (every forward of a stage keeps what the measured ones kept: the model's
  per-token fallback at the size it was measured at), so a step of that size is planned in
  those bytes (a budget in bytes applies; a factor scales the fixed order's measured
  bytes) and counts as fitted (measured one step in ``LEARN_EVERY``). Its times need no
  fit: microbatches of one size order alike.
* **When it is on.** Auto learning needs a ``loss_fn`` (training steps), and no other
  choice of memory (``activation_bytes=``, ``memory_factor=``) or of order (a ``hint=``;
  ``policy="strict"`` without a hint keeps torch's fixed order, bit for bit) unless a
  ``memory_budget=`` asks for bytes. ``sizes=False`` switches it off.
* **Randomness** (the drop-ins that keep the peer's random draws: ``draws=``, see
  ``_draws``). Before the sizes, one all-reduce (MAX) of three numbers on the learning
  group: each rank's flag (did a training forward draw?) and its step's microbatch count
  (and its negative: ranks that disagree skip the sizes, whose tables would differ in size,
  and the step's plan check names the mistake). Where any rank's forwards drew, learning
  stops on every rank alike before the step is planned: ``off`` says why, and every later
  step runs the fixed order (nothing more is read or exchanged).

Costs on the step's path: the broadcast (one small gloo collective before each step), the
prediction and the plan's build, and on the steps it learns from the meter's hooks on
each forward and the two all-gathers after the step; ``scripts/learning_cost.py`` measures
them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .._activation_model import ActivationModel, FeatureFn
from .._check import is_sequence
from .._costs import Durations
from .._errors import PlanError
from .._memory import ActivationBytes, MemoryBudget
from .._tasks import StepPlan, Task
from ..distributed import LearnedBytes, LearnedDurations, TorchStageExecutor
from ..loop import StepStats
from ..policies import StepSchedule
from ._draws import DrawWatch
from ._torch_step_inputs import Chunk

__all__ = ["SLOTS", "SizesFn", "StepLearning", "chunk_sizes", "item_sizes"]

SizesFn = Callable[[StepPlan, Sequence[Any]], Sequence[Mapping[str, float]]]

SLOTS = 4
"""Tensor inputs of a microbatch whose sizes auto learning reads (the first ones)."""
_NAMES = ("tokens", *(f"input{i}" for i in range(1, SLOTS)))
LEARN_EVERY = 8
"""Once every fit is ready, one varying step in this many is measured and learned from."""
UNIFORM_START = 2
"""Auto learning stops reading sizes after this many first steps of one size each."""


def _product(a: str, b: str) -> FeatureFn:
    return lambda f: f[a] * f[b]


# The fit's columns beyond ``1``, each size and ``tokens**2`` (its own): every other product
# of two sizes read (the design note says why).
_PRODUCTS: dict[str, FeatureFn] = {
    (f"{a}**2" if a == b else f"{a}*{b}"): _product(a, b)
    for i, a in enumerate(_NAMES)
    for b in _NAMES[i:]
    if (a, b) != ("tokens", "tokens")
}


def _tokens(t: torch.Tensor) -> float:
    """Tokens of a tensor: every element of an integer tensor (token ids), every row along
    the last dimension of a floating one (``[batch, seq, hidden]`` -> ``batch * seq``)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return float(t.numel() // t.shape[-1]) if t.dim() and t.shape[-1] else 0.0
    return float(t.numel())


def item_sizes(item: Any) -> list[float]:
    """The sizes auto learning reads off one microbatch of any structure: the tokens of the
    first ``SLOTS`` tensors among its leaves (``torch.utils._pytree``'s order: a dict's in
    insertion order), 0 where there are fewer (a Megatron data iterator's item)."""
    sizes = [_tokens(x) for x in tree_leaves(item) if isinstance(x, torch.Tensor)][:SLOTS]
    return sizes + [0.0] * (SLOTS - len(sizes))


def chunk_sizes(chunk: Chunk) -> list[float]:
    """The sizes auto learning reads off one torch microbatch: the tokens of its first
    ``SLOTS`` tensors, positional inputs first, then keyword inputs by name (0 where there
    are fewer)."""
    return item_sizes([list(chunk.args), [chunk.kwargs[k] for k in sorted(chunk.kwargs)]])


def _given(features: object) -> Mapping[str, float]:
    """A microbatch's features as this step's sizes gave them (the learners' reader)."""
    assert isinstance(features, Mapping)
    return features


class StepLearning:
    """Each step's sizes, and the bytes and times learned from the run (see the design note).

    Args:
        sizes: The user's ``sizes=`` function, or None for auto learning (the sizes read on
            the rank of stage 0 and broadcast).
        executor: The schedule's executor (it measures the bytes).
        plan: The schedule's base plan (``n_microbatches``).
        hint: The hint source (a name, or what ``hint_source`` made of torch's schedule).
        memory_budget: The user's ``memory_budget`` (None: the fixed order's bytes).
        learn_costs: Learn the tasks' times too (no ``durations=`` declared).
        source: With auto learning, the global rank that holds stage 0.
        measure_all: Keep the meter on for every step (the user asked for every step's
            bytes), not only for the steps learned from.
        fixed: The hint of the steps planned before the fits are ready and of the steps of
            one size (default: ``hint``; the Megatron drop-in: Megatron's own order).
        read: With auto learning, one microbatch's sizes on the rank of stage 0 (default:
            ``chunk_sizes``, torch's microbatches).
        replica: With auto learning, this rank's data-parallel replica (``source`` is the
            rank of stage 0 of that replica's pipeline).
        replicas: The job's data-parallel replicas (the design note: "Data parallelism").
        draws: With auto learning, the watch of this rank's training forwards (the design
            note: "Randomness"), or None where the forwards' draws do not depend on their
            order (per-task random streams).
    """

    def __init__(
        self,
        sizes: SizesFn | None,
        executor: TorchStageExecutor,
        *,
        plan: StepPlan,
        hint: Any,
        memory_budget: MemoryBudget | None,
        learn_costs: bool,
        source: int,
        measure_all: bool = False,
        fixed: Any = None,
        read: Callable[[Any], list[float]] = chunk_sizes,
        replica: int = 0,
        replicas: int = 1,
        draws: DrawWatch | None = None,
    ) -> None:
        if not 0 <= replica < replicas:
            raise PlanError(f"replica {replica} of {replicas}: 0 <= replica < replicas")
        if draws is not None and sizes is not None:
            raise PlanError("draws= needs auto learning (the flag goes where sizes are read)")
        self._draws = draws
        if draws is not None:
            draws.on = True  # (this learning owns the watch now)
        self._off: str | None = None
        self._replica, self._replicas = replica, replicas
        self._measure_all = measure_all
        self._fn = sizes
        self._executor = executor
        self._plan = plan
        self._budget = memory_budget
        self._learn_costs = learn_costs
        self._source = source
        self._reader = read
        self._fixed = fixed is not None
        # The fixed order's schedule (steps of one size, and the first steps when the budget
        # is in absolute bytes) and the byte-budgeted one (steps of varying sizes).
        factor = memory_budget if isinstance(memory_budget, float) else None
        self._count_base = StepSchedule.build(
            plan, hint if fixed is None else fixed, memory_factor=factor
        )
        self._byte_base = StepSchedule.build(
            plan, hint, activation_bytes=ActivationBytes.uniform(plan), memory_budget=memory_budget
        )
        self._group: Any = None
        self._bytes: LearnedBytes | None = None
        self._costs: LearnedDurations | None = None
        self._sizes: list[dict[str, float]] | None = None  # the job's, when it learns
        self._varying = 0  # steps of varying sizes so far
        self._steps = 0  # steps planned so far
        self._reading = True  # auto: whether the sizes are still read (broadcast) each step
        # The one size measured so far (None: none yet, or several: ``_sizes_varied``).
        self._measured_size: tuple[tuple[str, float], ...] | None = None
        self._sizes_varied = False

    @property
    def auto(self) -> bool:
        """Whether the sizes are read off the microbatches (no ``sizes=``)."""
        return self._fn is None

    @property
    def source(self) -> int:
        """The global rank that reads the sizes (auto learning)."""
        return self._source

    @property
    def reads_sizes(self) -> bool:
        """Whether the next step's sizes are read (auto learning stops after ``UNIFORM_START``
        first steps of one size each); the same answer on every rank."""
        return self._reading

    @property
    def off(self) -> str | None:
        """Why learning stopped (the forwards drew random numbers: the design note's
        "Randomness"), or None while it is on; the same on every rank."""
        return self._off

    @property
    def learned_bytes(self) -> LearnedBytes | None:
        """The bytes learned so far (None before the first step)."""
        return self._bytes

    @property
    def learned_durations(self) -> LearnedDurations | None:
        """The task times learned so far (None before the first step, or with declared
        ``durations=``)."""
        return self._costs

    def open(self) -> None:
        """At the first step, on every rank (a collective): the learning group."""
        if self._group is not None:
            return
        self._group = dist.new_group(backend="gloo")
        extra = _PRODUCTS if self.auto else None
        self._bytes = LearnedBytes(
            self._group, ActivationModel(extra_features=extra), features=_given
        )
        if self._learn_costs:  # (attention's time is quadratic in the length too)
            self._costs = LearnedDurations(self._group, features=_given, extra_features=extra)

    def _read(self, plan: StepPlan, chunks: Sequence[Any]) -> list[dict[str, float]] | None:
        """This step's sizes on every rank (None: no size could be read): every replica's
        microbatches, replica by replica (``replicas x len(chunks)``)."""
        if self._fn is not None:
            got = self._fn(plan, chunks)
            if not is_sequence(got) or len(got) != len(chunks):
                raise PlanError(
                    f"sizes(plan, microbatches) must return one mapping per microbatch"
                    f" ({len(chunks)}), got {type(got).__name__}"
                )
            return [dict(f) for f in got]
        m = len(chunks)
        watch = self._draws
        if watch is not None:
            # Whether any rank's forwards drew, and the step's microbatches on every rank:
            # fixed-size, so that ranks that disagree (a plan check will say so) do not
            # exchange tables of different sizes.
            head = torch.tensor([1.0 if watch.drew else 0.0, m, -m], dtype=torch.float64)
            dist.all_reduce(head, op=dist.ReduceOp.MAX, group=self._group)
            if head[0] > 0:
                self._stop("the model draws random numbers in its training forward (dropout)")
                return None
            if head[1] != -head[2]:
                return None  # (the step's plan check fails on every rank)
        table = torch.zeros((self._replicas * m, SLOTS + 1), dtype=torch.float64)
        mine = table[self._replica * m : (self._replica + 1) * m]
        if dist.get_rank() == self._source:
            try:
                rows = [self._reader(c) for c in chunks]
            except Exception as e:  # the peers wait in the broadcast: never raise before it
                warnings.warn(
                    f"rrfp_async: the step's sizes could not be read off its microbatches"
                    f" ({type(e).__name__}: {e}); the step runs the fixed order (pass"
                    " sizes= to give them)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                rows = []
            if any(any(r) for r in rows):
                mine[:, 0] = 1.0
                mine[:, 1:] = torch.tensor(rows, dtype=torch.float64)
        if self._replicas == 1:
            dist.broadcast(table, src=self._source, group=self._group)
        else:  # each replica's rows come from its source alone (the others add zeros)
            dist.all_reduce(table, group=self._group)
        if not bool(table[:, 0].all()):
            return None
        return [dict(zip(_NAMES, row[1:], strict=True)) for row in table.tolist()]

    def _stop(self, why: str) -> None:
        """Stop learning for good, on every rank alike (the same collective seen)."""
        self._off = why
        self._reading = False
        if self._draws is not None:
            self._draws.on = False

    def schedule(self, chunks: Sequence[Any], durations: Durations | None) -> StepSchedule:
        """The schedule of a step of ``chunks`` (on every rank; the first call is a
        collective): planned with the learned bytes and times once they are fitted. With
        auto learning only the rank of stage 0 reads ``chunks`` (the others may pass any
        sequence of the step's length)."""
        self.open()
        m = len(chunks)
        count = self._count_base.for_microbatches(m)
        every = self._read(count.plan, chunks) if self._reading else None
        self._steps += 1
        # (every replica's sizes: the choices below are the same on every rank of the job)
        if every is None or (self.auto and self._budget is None and _uniform(every)):
            if self.auto and self._budget is None and self._varying == 0 and self._off is None:
                # Steps of one size from the start (torch's chunking of one batch): stop
                # reading sizes, the same choice on every rank (the same broadcasts seen).
                self._reading = self._steps < UNIFORM_START
                if not self._reading and self._draws is not None:
                    self._draws.on = False  # (the fixed order from now on: nothing to watch)
            self._sizes = None
            self._executor.measure_activations(self._measure_all)
            return count if durations is None else count.with_durations(durations)
        assert self._bytes is not None
        sizes = every[self._replica * m : (self._replica + 1) * m]
        one_size = self._one_size(every)
        learn = self._varying % LEARN_EVERY == 0 or not (one_size or self._fitted(count.plan))
        self._varying += 1
        self._sizes = every if learn else None
        self._executor.measure_activations(learn or self._measure_all)
        if durations is None and self._costs is not None:
            durations = self._costs.predict(count.plan, sizes)
        predicted = self._bytes.predict(count.plan, sizes)
        if predicted is None and one_size:
            model = self._bytes.model
            predicted = ActivationBytes(
                [model.predict_many(v, sizes) for v in range(count.plan.num_virtual)]
            )
        if predicted is None and (self._fixed or not isinstance(self._budget, (float, type(None)))):
            # Not fitted yet, and a fixed order of its own or a budget in bytes: the fixed
            # order (and its memory) until it is.
            return count if durations is None else count.with_durations(durations)
        nbytes = predicted if predicted is not None else ActivationBytes.uniform(count.plan)
        return self._byte_base.for_microbatches(m).with_durations(
            durations, activation_bytes=nbytes
        )

    def _one_size(self, sizes: Sequence[Mapping[str, float]]) -> bool:
        """Whether every size measured so far, and every microbatch of this step, is one
        size (the design note's "One size": its bytes are known; the same answer on every
        rank)."""
        one = self._measured_size
        return (
            one is not None and not self._sizes_varied and all(_size_key(s) == one for s in sizes)
        )

    def _fitted(self, plan: StepPlan) -> bool:
        """Whether every fit is ready (the same answer on every rank: the same data)."""
        assert self._bytes is not None
        return self._bytes.ready(plan) and (self._costs is None or self._costs.ready(plan))

    def observe(self, stats: StepStats, train: bool) -> None:
        """After a step: exchange and fit what it measured (a collective on every rank,
        after the step), when the step was one to learn from."""
        sizes, self._sizes = self._sizes, None
        if sizes is None or not train or self._bytes is None:
            return
        # The job's microbatches, replica by replica: this replica's are ``off + i``.
        plan = replace(self._plan, microbatches=len(sizes))
        off = self._replica * (len(sizes) // self._replicas)
        measured = {(v, off + i): b for (v, i), b in self._executor.activation_bytes().items()}
        self._bytes.observe(plan, sizes, measured)
        for key in map(_size_key, sizes):
            if self._measured_size is None:
                self._measured_size = key
            self._sizes_varied |= key != self._measured_size
        if self._costs is not None:
            ran = [
                _Ran(e.task._replace(mb=e.task.mb + off), e.start, e.end) for e in stats.executed
            ]
            self._costs.observe(plan, sizes, ran)


@dataclass(frozen=True)
class _Ran:
    """A task as it ran, renumbered among the job's microbatches (``RanTask``)."""

    task: Task
    start: float
    end: float


def _size_key(size: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(size.items()))


def _uniform(sizes: Sequence[Mapping[str, float]]) -> bool:
    return all(s == sizes[0] for s in sizes)
