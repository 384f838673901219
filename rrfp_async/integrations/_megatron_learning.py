"""What the megatron drop-in learns from the run (``MegatronLearning``).

Design note
-----------
The same learning as the torch drop-in's (``_torch_learning``'s design note: each step's
sizes read on one rank and broadcast, each forward's activation bytes and each task's time
measured, exchanged after the step and fitted alike on every rank, each step of varying
sizes then planned with the cost-aware hint within the bytes the fixed order holds on it),
with what differs under Megatron:

* **Where the sizes are.** Megatron gives a step no microbatches: ``forward_step_func``
  reads them from the data iterator inside each forward, and only where it needs them
  (Megatron-LM's ``get_batch`` reads on the first and last stages, on tensor rank 0, and
  broadcasts to the other tensor ranks). So the rank of pipeline stage 0 and tensor rank 0
  (``source``) reads the step's items of its first chunk's iterator before the step
  (``InOrder.peek``; each forward still gets its own item, once) and reads their sizes
  (``item_sizes``: the tokens of the first tensors of each item). An item with no tensor,
  or no iterator on that rank, gives no sizes: the step runs Megatron's order.
* **The fixed order** of the steps planned before the fits are ready, and of the steps of
  one size, is Megatron's own (``megatron_order``), so a job of fixed sequence length runs
  exactly what it ran before (and after two such steps reads no sizes again). The default
  byte budget is what 1F1B (interleaved 1F1B with chunks) holds on the step's
  microbatches: Megatron's order at its default ``microbatch_group_size_per_vp_stage`` (the
  pipeline size) is that order, task for task (``tests/integrations/test_megatron_learning``
  checks it); with another group size Megatron's interleaved order may hold more, and the
  budget stays 1F1B's (less memory than Megatron's, never more).
* **Data parallelism**: the replicas learn together and each plans its own call, as under
  the torch drop-in (``_torch_learning``'s design note). Not with interleaved chunks: there
  each chunk's gradient sync (``grad_sync_func``, on the data-parallel group) starts after
  its last backward, so the replicas must finish their chunks in the same order, which
  Megatron's order run readiness-first keeps (its backwards in the hint's order) and per
  replica plans would not; learning is off there.
* **When it is on**: training calls (a forward-only call runs Megatron's forward-only
  order and learns nothing), and no other choice of memory (``activation_bytes=``,
  ``memory_factor=``) or of order (a ``hint=``; ``policy="strict"`` keeps Megatron's
  order, bit for bit), unless ``memory_budget=`` asks for bytes; ``sizes=False`` switches
  it off. What was learned
  belongs to the model chunks it was learned on: a call with other chunks (another model)
  starts afresh, as does a call after ``close()``.
* **Randomness**: Megatron's dropout draws from the global generators (and its CUDA RNG
  tracker's named states) in the order the forwards run, and the learned plan may run a
  stage's forwards in another order than Megatron's. So the forwards are watched
  (``_draws``' design note): where any rank's training forward drew, learning stops
  before a step is planned by it, a ``RuntimeWarning`` says so once, and every call runs
  Megatron's order readiness-first (each stage's forwards in microbatch order: each
  microbatch draws what it draws under Megatron).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .._costs import Durations
from .._errors import PlanError
from .._memory import MemoryBudget
from .._tasks import StepPlan
from ..distributed import LearnedBytes, LearnedDurations, ProcessLayout, TorchStageExecutor
from ..loop import StepStats
from ..policies import StepSchedule
from ._draws import DrawWatch
from ._megatron_data import InOrder
from ._torch_learning import StepLearning, item_sizes

__all__ = ["MegatronLearning", "learns"]


def learns(
    *,
    sizes: bool | None,
    hint: Any,
    policy: Any,
    memory_factor: float | None,
    activation_bytes: Any,
    memory_budget: MemoryBudget | None,
) -> bool:
    """Whether the drop-in learns from the run, by its arguments (the data-parallel size is
    checked at the first call). PlanError: ``sizes`` neither None, True nor False."""
    if sizes is not None and not isinstance(sizes, bool):
        raise PlanError(
            f"sizes must be True, False or None (learn from the run where nothing else was"
            f" chosen), got {sizes!r}"
        )
    if sizes is False or activation_bytes is not None or memory_factor is not None:
        return False
    return memory_budget is not None or (hint is None and policy != "strict")


class MegatronLearning:
    """The learning of one forward-backward function: one ``StepLearning`` per set of model
    chunks (see the design note).

    Args:
        hint: The user's hint (None: the cost-aware default).
        memory_budget: The user's ``memory_budget`` (None: the fixed order's bytes).
        learn_costs: Learn the tasks' times (no ``durations=`` declared).
        measure_all: Measure every training step's bytes (``measure_activations=True``).
    """

    def __init__(
        self,
        *,
        hint: Any,
        memory_budget: MemoryBudget | None,
        learn_costs: bool,
        measure_all: bool,
    ) -> None:
        self._hint = "breadth_first_weighted" if hint is None else hint
        self._budget = memory_budget
        self._learn_costs = learn_costs
        self._measure_all = measure_all
        self._key: Any = None
        self._learning: StepLearning | None = None

    @property
    def learned_bytes(self) -> LearnedBytes | None:
        """The activation bytes learned so far (None before the first training call)."""
        return None if self._learning is None else self._learning.learned_bytes

    @property
    def learned_durations(self) -> LearnedDurations | None:
        """The task times learned so far (None before the first training call, or with
        declared ``durations=``)."""
        return None if self._learning is None else self._learning.learned_durations

    def reset(self) -> None:
        """Forget what was learned (``close()``: the next call starts afresh)."""
        self._key, self._learning = None, None

    def schedule(
        self,
        *,
        layout: ProcessLayout,
        models: Sequence[Any],
        executor: TorchStageExecutor,
        plan: StepPlan,
        fixed: Any,
        key: Any,
        data: InOrder,
        durations: Durations | None,
        draws: DrawWatch | None = None,
    ) -> StepSchedule | None:
        """This training call's schedule (a collective on every rank), or None where the
        drop-in does not learn (interleaved chunks over data-parallel replicas).

        Args:
            layout: The call's process layout.
            models: The call's model chunks on this rank.
            executor: The drop-in's executor (it measures the bytes).
            plan: The call's plan (its microbatch count).
            fixed: Megatron's order (a hint source) for the steps run in the fixed order.
            key: What else the fixed order depends on (the call's groups, its group size).
            data: The first chunk's data iterator, read in microbatch order.
            durations: The declared durations of the step, if any.
            draws: The watch of the training forwards' random draws (``_draws``), if any.
        """
        if layout.dp != 1 and plan.topology.chunks > 1:
            if self._budget is not None:
                raise PlanError(
                    f"memory_budget is a byte budget: the megatron drop-in learns the step's"
                    f" bytes with one model chunk per rank or one pipeline replica, and this"
                    f" job interleaves {plan.topology.chunks} chunks over {layout.dp}"
                    " data-parallel replicas: pass activation_bytes=plan -> rr.ActivationBytes"
                    " too (or bound the count with memory_factor=)"
                )
            return None
        replica = next(
            d for d, plane in enumerate(layout.grid) if any(layout.rank in row for row in plane)
        )
        full = (key, plan.topology, tuple(id(m) for m in models))
        if self._learning is None or full != self._key:
            self._learning = StepLearning(
                None,
                executor,
                plan=plan,
                hint=self._hint,
                memory_budget=self._budget,
                learn_costs=self._learn_costs,
                source=layout.grid[replica][0][0],
                measure_all=self._measure_all,
                fixed=fixed,
                read=item_sizes,
                replica=replica,
                replicas=layout.dp,
                draws=draws,
            )
            self._key = full
        learning = self._learning
        m = plan.microbatches
        items: list[Any] = [None] * m
        if dist.get_rank() == learning.source and learning.reads_sizes and data.source is not None:
            # A dry iterator gives no sizes (the forward that finds it dry raises).
            with contextlib.suppress(PlanError):
                items = data.peek(m)
        got = learning.schedule(items, durations)
        return None if learning.off is not None else got

    @property
    def off(self) -> str | None:
        """Why learning stopped (the forwards drew random numbers), or None."""
        return None if self._learning is None else self._learning.off

    def observe(self, stats: StepStats) -> None:
        """After a training call: exchange and fit what it measured (a collective)."""
        if self._learning is not None:
            self._learning.observe(stats, True)
