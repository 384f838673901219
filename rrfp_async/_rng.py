"""Random streams per task: what makes dropout independent of the dispatch order.

Design note
-----------
A readiness-first stage runs its forwards in whatever order their inputs arrive. Every
draw from torch's global generators (a dropout mask, ``torch.rand`` inside a forward) takes
the next numbers of one process-wide sequence, so which microbatch gets which mask would
depend on that order, and, since every rank seeded alike starts from the same state, the
stages of a pipeline would draw the same sequence. So each forward runs on a stream of its
own, derived from ``(seed, step, stage, microbatch)`` alone: the executor saves the
generators' states (the CPU one and those of the CUDA devices the stage lives on), seeds
them with :func:`task_seed`, runs the forward and puts the saved states back, the shape of
``torch.random.fork_rng`` at a fraction of its price (``fork_rng`` + ``torch.manual_seed``
visit every device type; the figures: BENCHMARKS.md#notes-from-the-runtimes-docstrings).
The stream is re-derived per task, never continued: Megatron's ``CudaRNGStatesTracker``
forks *named* streams that carry on from call to call, and a stream that carries on is
exactly what depends on the order. The saved states are put back so that whatever the
caller draws between steps (its data, its augmentations) does not depend on the order
either. A single-process loop reproduces a pipeline's draws with :func:`task_rng` around
each stage's forward of each microbatch.

Seeds: CUDA's Philox generator takes all 64 bits of a task's seed; the CPU's mt19937 only
the low 32. The low 32 bits are a mix of ``(seed, step)`` plus ``stage << 20 | microbatch``
(mod 2**32), so within a step no two tasks share a stream on any device; across steps two
tasks' CPU streams coincide with probability 2**-32 per pair (CUDA: 2**-64).

Threads: torch's generators belong to the process, not to a thread. Two compute threads of
one process (the executors of a ``LocalPipeline``) forking them at the same time would draw
from each other's streams, so an executor holds ``TASK_RNG_LOCK`` while a task runs. In one
process per rank (``DistributedStage``) nobody else takes it. Code of the caller that draws
from the global generators on another thread *while* a step runs still races with the
step's forwards, as it would with any two users of one generator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ._errors import PlanError

__all__ = [
    "MAX_MICROBATCHES",
    "MAX_STAGES",
    "TASK_RNG_LOCK",
    "cuda_indices",
    "fork_seeded",
    "step_key",
    "task_key",
    "task_rng",
    "task_seed",
]

TASK_RNG_LOCK = threading.RLock()
"""Held by an executor while a task runs on the global generators (see the design note)."""

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
MAX_STAGES = 1 << 12
"""Virtual stages a task stream can tell apart."""
MAX_MICROBATCHES = 1 << 20
"""Microbatches of one step a task stream can tell apart."""


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def task_seed(seed: int, step: int, stage: int, microbatch: int) -> int:
    """The 64-bit seed of one task's random stream (see the design note).

    Args:
        seed: The run's seed (any int; taken modulo 2**64, as ``torch.manual_seed`` does).
        step: The step number (``run_step``'s, the same on every rank).
        stage: The virtual stage, ``0 .. 4095``.
        microbatch: The microbatch's index in the step, ``0 .. 2**20 - 1``.

    Returns:
        A seed in ``0 .. 2**64 - 1``; two tasks of one step never get the same low 32 bits.

    Raises:
        PlanError: An argument that is not an int, a negative step, a stage or microbatch
            out of range.
    """
    for name, v in (("stage", stage), ("microbatch", microbatch)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"task_seed: {name} must be an int, got {v!r}")
    if not 0 <= stage < MAX_STAGES:
        raise PlanError(f"task_seed: stage must be in 0..{MAX_STAGES - 1}, got {stage}")
    if not 0 <= microbatch < MAX_MICROBATCHES:
        raise PlanError(
            f"task_seed: microbatch must be in 0..{MAX_MICROBATCHES - 1}, got {microbatch}"
        )
    return task_key(step_key(seed, step), stage, microbatch)


def step_key(seed: int, step: int) -> int:
    """What every task of ``step`` derives its seed from (computed once per step).

    Raises:
        PlanError: ``seed`` or ``step`` is not an int, or ``step`` is negative.
    """
    for name, v in (("seed", seed), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"task_seed: {name} must be an int, got {v!r}")
    if step < 0:
        raise PlanError(f"task_seed: step must be >= 0, got {step}")
    return _mix(_mix(seed & _M64) ^ step)


def task_key(key: int, stage: int, microbatch: int) -> int:
    """``task_seed`` from its step's ``step_key`` (stage and microbatch in range: unchecked,
    the hot path of every forward)."""
    offset = (stage << 20) | microbatch
    return ((_mix(key ^ offset) >> 32) << 32) | ((key + offset) & _M32)


def cuda_indices(devices: Iterable[torch.device | None]) -> tuple[int, ...]:
    """The indices of the CUDA devices among ``devices``, sorted, once each."""
    found: set[int] = set()
    for d in devices:
        if d is not None and d.type == "cuda":
            found.add(d.index if d.index is not None else torch.cuda.current_device())
    return tuple(sorted(found))


class fork_seeded:  # a lower-case name: used like a function, as contextlib's are
    """Run the block with the CPU generator and the CUDA generators of devices ``cuda``
    seeded with ``seed``; put their states back afterwards, also when the block raises.
    The caller holds ``TASK_RNG_LOCK`` if other threads may fork at the same time. (A
    class, not ``@contextmanager``: half the cost, on every forward.)"""

    __slots__ = ("_cuda", "_saved", "_saved_cuda", "_seed")

    def __init__(self, seed: int, cuda: Sequence[int] = ()) -> None:
        self._seed = seed
        self._cuda = cuda

    def __enter__(self) -> None:
        cpu = torch.default_generator
        self._saved = cpu.get_state()
        gens = [torch.cuda.default_generators[i] for i in self._cuda]
        self._saved_cuda = [g.get_state() for g in gens]
        try:
            cpu.manual_seed(self._seed)
            for g in gens:
                g.manual_seed(self._seed)
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        torch.default_generator.set_state(self._saved)
        for i, state in zip(self._cuda, self._saved_cuda, strict=True):
            torch.cuda.default_generators[i].set_state(state)


@contextmanager
def task_rng(
    seed: int, step: int, stage: int, microbatch: int, *, devices: Sequence[int] | None = None
) -> Iterator[None]:
    """Run the block on the random stream of one task: what a pipeline's forward of
    ``microbatch`` on virtual stage ``stage`` in step ``step`` draws from.

    The single-process reference of a pipeline with dropout (or any other draw from torch's
    global generators inside a forward) runs each stage's forward of each microbatch
    inside it, with the executor's seed (``TorchStageExecutor.rng_seed``) and the step
    numbers the pipeline ran::

        for m, mb in enumerate(microbatches):
            x = mb
            for v, module in enumerate(stages):
                with rr.task_rng(seed, step, v, m):
                    x = module(x)
            (loss_fn(x, mb) / len(microbatches)).backward()

    The last stage's loss is part of its forward task (compute it inside the block when the
    loss function draws). The generators' states are put back when the block ends.

    Args:
        seed: The executor's seed.
        step: The step number.
        stage: The virtual stage.
        microbatch: The microbatch's index in the step.
        devices: CUDA device indices to seed besides the CPU (default: every CUDA device,
            once CUDA is initialised; none before).

    Raises:
        PlanError: see :func:`task_seed`.
    """
    s = task_seed(seed, step, stage, microbatch)
    if devices is None:
        cuda_on = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        devices = range(torch.cuda.device_count()) if cuda_on else ()
    with fork_seeded(s, tuple(devices)):
        yield
