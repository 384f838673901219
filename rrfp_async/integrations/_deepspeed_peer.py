"""What the DeepSpeed drop-in reads from the installed DeepSpeed: its pipeline order, its
grid, and what it refuses.

The order is DeepSpeed's own: each stage's forwards and backwards in the order its
``TrainSchedule`` (``InferenceSchedule`` for ``eval_batch``) issues their ``ForwardPass`` and
``BackwardPass`` instructions, read from the schedule's instruction stream (the k-th
forward of a stage is microbatch k, and so is the k-th backward: DeepSpeed's 1F1B keeps
both in microbatch order, which the buffer ids are checked against). DeepSpeed's 1F1B warms
up with ``P - s`` forwards on stage ``s`` (Megatron's with ``P - s - 1``), so it keeps up to
``min(P - s, M)`` activations, its ``num_pipe_buffers()``.
"""

from __future__ import annotations

import functools
from typing import Any

from .._errors import PlanError
from .._tasks import Task
from ..distributed import ProcessLayout

__all__ = ["WHO", "deepspeed_order", "layout_of_engine", "refuse_config", "refuse_unsupported"]

WHO = "rrfp_async.deepspeed (the readiness-first PipelineEngine)"


@functools.lru_cache(maxsize=64)
def _order(stages: int, microbatches: int, forward_only: bool) -> tuple[tuple[Task, ...], ...]:
    from deepspeed.runtime.pipe import schedule as ds

    out: list[tuple[Task, ...]] = []
    for s in range(stages):
        sched: Any
        if forward_only:
            sched = ds.InferenceSchedule(micro_batches=microbatches, stages=stages, stage_id=s)
        else:
            sched = ds.TrainSchedule(micro_batches=microbatches, stages=stages, stage_id=s)
        buffers = sched.num_pipe_buffers()
        tasks: list[Task] = []
        nf = nb = 0
        for cmds in sched.steps():
            for c in cmds:
                if isinstance(c, ds.ForwardPass):
                    kind, mb = "F", nf
                    nf += 1
                elif isinstance(c, ds.BackwardPass):
                    kind, mb = "B", nb
                    nb += 1
                else:
                    continue
                if c.buffer_id != mb % buffers:
                    raise PlanError(
                        f"{WHO}: DeepSpeed's {type(sched).__name__} (stage {s} of {stages},"
                        f" {microbatches} microbatches) runs microbatch {mb}'s {kind} in"
                        f" buffer {c.buffer_id}, not {mb % buffers}: an order this drop-in"
                        " does not know (a patched schedule?)"
                    )
                tasks.append(Task(s, kind, mb))  # type: ignore[arg-type]
        want = microbatches * (1 if forward_only else 2)
        if len(tasks) != want:
            raise PlanError(
                f"{WHO}: DeepSpeed's {type(sched).__name__} issued {len(tasks)} passes on"
                f" stage {s}, not {want}"
            )
        out.append(tuple(tasks))
    return tuple(out)


def deepspeed_order(
    stages: int, microbatches: int, *, forward_only: bool = False
) -> dict[int, list[Task]]:
    """DeepSpeed's per-stage task order of one ``train_batch`` (``forward_only``: of one
    ``eval_batch``), from the installed DeepSpeed's ``TrainSchedule`` /
    ``InferenceSchedule``.

    Args:
        stages: Pipeline stages P.
        microbatches: Microbatches M (``gradient_accumulation_steps``).
        forward_only: The inference schedule's order (every forward, in order).

    Returns:
        ``{stage: [Task, ...]}``.

    Raises:
        PlanError: The installed schedule issues passes in an order the drop-in cannot
            read (a patched ``TrainSchedule``).
    """
    got = _order(stages, microbatches, forward_only)
    return {s: list(t) for s, t in enumerate(got)}


def layout_of_engine(engine: Any) -> ProcessLayout:
    """The runtime's ``ProcessLayout`` of a ``PipelineEngine``'s grid (DeepSpeed's topology
    names every rank's pipe and data coordinate: no collective).

    Raises:
        PlanError: A topology with axes other than pipe and data (tensor parallelism).
    """
    grid = engine.grid
    topo = grid.topology()
    axes = list(topo.get_axis_names())
    extra = {a: int(topo.get_dim(a)) for a in axes if a not in ("pipe", "data")}
    if any(d > 1 for d in extra.values()) or "pipe" not in axes:
        raise PlanError(
            f"{WHO}: a PipelineModule topology with axes {axes} (sizes {extra}) is not"
            " supported: tensor (model) parallelism runs on DeepSpeed's own PipelineEngine"
            " (rrfp_async.deepspeed.uninstall() before deepspeed.initialize); supported: the"
            " axes 'pipe' and 'data' (PipeDataParallelTopology, the default), other axes of"
            " size 1"
        )
    ones = {a: 0 for a in extra}
    pp, dp = int(topo.get_dim("pipe")), max(int(topo.get_dim("data")), 1)
    if "data" in axes:
        table = tuple(
            tuple((int(topo.get_rank(pipe=p, data=d, **ones)),) for p in range(pp))
            for d in range(dp)
        )
    else:
        table = (tuple((int(topo.get_rank(pipe=p, **ones)),) for p in range(pp)),)
    return ProcessLayout(pp=pp, dp=dp, rank=int(grid.get_global_rank()), grid=table)


def refuse_unsupported(engine: Any) -> None:
    """Refuse, by name, what the drop-in does not run (checked when the engine is built, on
    every rank alike: each reads the same config).

    Raises:
        PlanError: Tensor-parallel partitioned activations or gradients, a topology with a
            model axis, or no pipeline parallelism at all.
    """
    layout_of_engine(engine)
    if getattr(engine, "is_pipe_partitioned", False) or getattr(
        engine, "is_grad_partitioned", False
    ):
        raise PlanError(
            f"{WHO}: pipeline.pipe_partitioned / grad_partitioned (tensor-parallel"
            " partitioned activations) are not supported: set both to false in the"
            " DeepSpeed config, or run DeepSpeed's own engine"
        )


def refuse_config(config: Any) -> None:
    """Refuse, before DeepSpeed builds the engine, what its pipeline engine itself refuses
    with a bare ``AssertionError``: ZeRO stages 2 and 3 (``config``: the
    ``DeepSpeedConfig`` that ``deepspeed.initialize`` passes; None: nothing to check).

    Raises:
        PlanError: ZeRO stage 2 or 3, naming the stage and the fix.
    """
    stage = getattr(config, "zero_optimization_stage", None)
    if isinstance(stage, int) and stage >= 2:
        raise PlanError(
            f"{WHO}: zero_optimization.stage {stage}: DeepSpeed's pipeline engine runs ZeRO"
            " stages 0 and 1 only (it partitions gradients or parameters across the"
            " data-parallel group, which the pipeline's gradient accumulation does not"
            ' allow); set "zero_optimization": {"stage": 1} (or 0)'
        )
