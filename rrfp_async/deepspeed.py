"""DeepSpeed's pipeline engine, readiness-first: one line before ``deepspeed.initialize``.

::

    import deepspeed
    import rrfp_async.deepspeed

    rrfp_async.deepspeed.install()  # the one line
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=pipeline_module, config=ds_config, model_parameters=params
    )
    loss = engine.train_batch(data_iter)  # as before

``install()`` makes ``deepspeed.initialize`` build a ``ReadinessFirstPipelineEngine`` for a
``PipelineModule``: DeepSpeed's own ``PipelineEngine`` whose ``train_batch`` and
``eval_batch`` run as readiness-first steps on the runtime (the engine's own forward,
backward, loss scaling, gradient reduce and optimizer step; the runtime's order and
channels). Everything else is DeepSpeed's: the config, ``train_batch`` / ``eval_batch`` and
their options, ``set_batch_fn``, ``set_train_batch_size``, ``reset_activation_shape``,
checkpoints, timers and monitors. ``policy="strict"`` runs DeepSpeed's own 1F1B order, bit
for bit.

Not supported, and refused by name when the engine is built: topologies with a model
(tensor-parallel) axis, ``pipe_partitioned`` / ``grad_partitioned`` activations, schedules
other than DeepSpeed's ``TrainSchedule`` / ``InferenceSchedule``, and the
``DualPipeVModule``. See docs/dropins.md ("DeepSpeed") and docs/compatibility.md for the
versions tested, and ``rrfp_async.integrations._deepspeed_engine`` for how it works.
DeepSpeed is an optional dependency: importing this module does not import it.
"""

from __future__ import annotations

import threading
from typing import Any

from ._check import check_real
from ._errors import PlanError
from ._memory import MemoryBudget, parse_memory_budgets
from .integrations._deepspeed_engine import (
    DeepSpeedOptions,
    DeepSpeedRunner,
    engine_class,
    set_options,
)
from .integrations._deepspeed_peer import deepspeed_order
from .integrations._timeouts import GROUP_TIMEOUT, StepTimeout, resolve_step_timeout

__all__ = [
    "DeepSpeedOptions",
    "DeepSpeedRunner",
    "deepspeed_order",
    "engine_class",
    "install",
    "installed",
    "uninstall",
]

_lock = threading.Lock()
_saved: dict[str, Any] = {}


def install(
    *,
    policy: Any = "readiness_first",
    hint: Any = None,
    memory_factor: float | None = None,
    memory_budget: MemoryBudget | None = None,
    sizes: bool | None = None,
    step_timeout: StepTimeout = GROUP_TIMEOUT,
    **stage_kwargs: Any,
) -> DeepSpeedOptions:
    """Make ``deepspeed.initialize`` build the readiness-first engine for a
    ``PipelineModule`` (from now on, in this process; call it on every rank).

    Args:
        policy: ``"readiness_first"`` (the default), ``"strict"`` (DeepSpeed's order
            exactly, learning nothing), or any ``rr`` policy.
        hint: A hint name or generator in place of the default (the learning's cost-aware
            plan; DeepSpeed's own 1F1B order until the fits are ready and for batches of
            one size).
        memory_factor: Bound the count of activations each stage keeps instead, as a
            multiple of what the hint's order keeps (the learning is then off).
        memory_budget: The learned plan's byte budget per stage: a factor of what
            DeepSpeed's order holds on the batch (default 1.0: the same bytes), or bytes
            (an int, or ``"24GiB"``).
        sizes: False: learn nothing (DeepSpeed's order run readiness-first within its
            count of activations). Default: learn each batch's sizes (read off the first
            stage's inputs), the forwards' activation bytes and the tasks' times from the
            run, and plan each batch of varying sizes with the cost-aware hint within the
            bytes DeepSpeed's order holds on it (``rrfp_async.integrations._torch_learning``).
        step_timeout: The step watchdog: seconds, None (none), or ``"group"`` (as long as
            the process group waits, the default: DeepSpeed has no watchdog of its own).
        **stage_kwargs: Further ``rr.DistributedStage`` keywords (``trace_dir=``, ...).

    Returns:
        The options engines built from now on take (a call again replaces them).

    Raises:
        PlanError: DeepSpeed is not installed, or a bad value.
    """
    if memory_factor is not None:
        check_real("memory_factor", memory_factor, minimum=0.0, strict_minimum=True)
    if isinstance(step_timeout, str):
        resolve_step_timeout(step_timeout, None)  # (only "group"; raises naming the rest)
    elif step_timeout is not None:
        check_real("step_timeout", step_timeout, minimum=0.0, strict_minimum=True)
    if sizes is not None and not isinstance(sizes, bool):
        raise PlanError(f"sizes must be True, False or None, got {sizes!r}")
    if memory_budget is not None and memory_factor is not None:
        raise PlanError(
            "give memory_budget (bytes) or memory_factor (a count of activations), not both"
        )
    if memory_budget is not None:
        parse_memory_budgets(memory_budget)  # (raises PlanError naming a bad value)
    try:
        import deepspeed
    except ImportError as e:
        raise PlanError(
            "rrfp_async.deepspeed.install(): DeepSpeed is not installed (pip install"
            " deepspeed; see docs/compatibility.md for the versions tested)"
        ) from e
    options = DeepSpeedOptions(
        policy=policy,
        hint=hint,
        memory_factor=memory_factor,
        memory_budget=memory_budget,
        sizes=sizes,
        step_timeout=step_timeout,
        stage_kwargs=dict(stage_kwargs),
    )
    cls = engine_class()
    with _lock:
        if not _saved:
            _saved["PipelineEngine"] = deepspeed.PipelineEngine
            _saved["DualPipeVEngine"] = getattr(deepspeed, "DualPipeVEngine", None)
        deepspeed.PipelineEngine = cls
        if _saved["DualPipeVEngine"] is not None:
            deepspeed.DualPipeVEngine = _refuse_dualpipev
        set_options(options)
    return options


def uninstall() -> None:
    """Give ``deepspeed.initialize`` DeepSpeed's own engines back (engines built before
    keep running readiness-first)."""
    import deepspeed

    with _lock:
        if _saved:
            deepspeed.PipelineEngine = _saved["PipelineEngine"]
            if _saved["DualPipeVEngine"] is not None:
                deepspeed.DualPipeVEngine = _saved["DualPipeVEngine"]
            _saved.clear()
        set_options(None)


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    with _lock:
        return bool(_saved)


def _refuse_dualpipev(*args: Any, **kwargs: Any) -> Any:
    raise PlanError(
        "rrfp_async.deepspeed: a DualPipeVModule runs on DeepSpeed's DualPipeVEngine, whose"
        " bidirectional schedule the readiness-first engine does not run: call"
        " rrfp_async.deepspeed.uninstall() before deepspeed.initialize for this model, or"
        " build a PipelineModule"
    )
