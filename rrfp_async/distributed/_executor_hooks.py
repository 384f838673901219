"""The optional hooks a ``DistributedStage`` reads from its executor.

An executor of a :class:`~rrfp_async.DistributedStage` needs only ``execute``
(:class:`~rrfp_async.Executor`), and may implement the loop's optional hooks
(``rrfp_async.loop``: ``set_output_hook``, ``step_failed``, ``settle``, ``step_results``,
``shared_parameters``). The distributed stage reads a few more, declared here, each a
protocol of one member so that an executor implements any subset; the stage checks each
with ``isinstance`` and, without it, does what the docstring says. ``TorchStageExecutor``
implements them all.

A hook must be a real attribute of the executor or its class: on Python >= 3.12
``isinstance`` does not see names that only ``__getattr__`` supplies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

__all__ = [
    "EmulatingExecutor",
    "EventWaitingExecutor",
    "ModulesExecutor",
    "SeedAdoptingExecutor",
    "SeedGivenExecutor",
    "SeededExecutor",
    "StreamOrderingExecutor",
    "TieSpecExecutor",
    "executor_seed",
]


@runtime_checkable
class SeededExecutor(Protocol):
    """Optional: an executor that draws its tasks' random streams from a seed."""

    @property
    def rng_seed(self) -> int | None:
        """The seed of the tasks' random streams (``task_seed``). The plan check compares
        it across ranks (the TP ranks of a stage must draw the same dropout masks); without
        it (or None) there is no seed to compare."""


@runtime_checkable
class SeedGivenExecutor(Protocol):
    """Optional: an executor that tells a seed it was given from its default one."""

    @property
    def rng_seed_given(self) -> bool:
        """Whether ``rng_seed`` was given by the user. False: it is the default, which the
        ranks agree on in the plan check (the first rank's is adopted, through
        :class:`SeedAdoptingExecutor`), so ``DistributedStage(verify_plan=False)`` with TP
        refuses it. Without it the seed counts as given."""


@runtime_checkable
class SeedAdoptingExecutor(Protocol):
    """Optional: an executor whose default seed becomes the job's."""

    def adopt_seed(self, seed: int, /) -> None:
        """Draw the tasks' random streams from ``seed``, the job's seed. The plan check calls
        it on a rank whose seed is the default (:class:`SeedGivenExecutor`), with that of the
        lowest global rank whose seed is the default too, so that unseeded processes agree.
        Without it the executor keeps its own seed."""


@runtime_checkable
class ModulesExecutor(Protocol):
    """Optional: an executor that shows its stage modules."""

    @property
    def modules(self) -> object:
        """Virtual stage -> ``torch.nn.Module`` (a ``Mapping``). Before the first training
        step, with ``check_ties``, the stage looks in them for parameters shared across ranks
        that no tie declares; without it (or when it is no mapping) that check is skipped."""


@runtime_checkable
class StreamOrderingExecutor(Protocol):
    """Optional: an executor whose tasks end when their kernels are enqueued (CUDA)."""

    def order_after_step(self) -> None:
        """Make the device's default stream wait for this step's work (no host wait). Called
        after the step's last task, before the tied and DP gradient reductions and before
        ``run_step`` returns; without it the stage assumes a task's work is done when it
        completes."""


@runtime_checkable
class EmulatingExecutor(Protocol):
    """Optional: an executor that can add emulated GPU time (``EmulatedCost``)."""

    @property
    def emulate(self) -> object:
        """The emulated cost, or None. When not None, traces say that GPU time is emulated
        (unless ``DistributedStage(emulated_gpu_time=...)`` says otherwise); without it they
        do not."""


@runtime_checkable
class EventWaitingExecutor(Protocol):
    """Optional: an executor that orders its compute after a received tensor's event."""

    @property
    def waits_for_events(self) -> bool:
        """True: the p2p channel hands each device payload over with its receive's event at
        once, and the executor's compute stream waits on that event
        (``_streams.wait_ready``). Without it (or False) a payload is handed over once its
        event completed (waited for off the loop). Read when the stage is built."""


@runtime_checkable
class TieSpecExecutor(Protocol):
    """Optional: an executor whose modules hold parameters tied across stages."""

    @property
    def shared_spec(self) -> Mapping[str, tuple[tuple[int, str], ...]]:
        """Tie name -> its ``(virtual stage, parameter name)`` members, on every rank alike.
        Read when the stage is built: the ties' groups and the plan check's ties digest come
        from it (with ``shared_parameters()``, ``loop.TiedExecutor``, giving this rank's
        copies). Without it the executor declares no ties."""


def executor_seed(executor: object) -> tuple[int | None, bool]:
    """``(rng_seed, default)`` of ``executor``: its seed (None without
    :class:`SeededExecutor`) and whether it is the default one (False without
    :class:`SeedGivenExecutor`)."""
    seed = executor.rng_seed if isinstance(executor, SeededExecutor) else None
    given = executor.rng_seed_given if isinstance(executor, SeedGivenExecutor) else True
    return seed, not given
