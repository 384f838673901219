"""What megatron-core's pipeline schedule needs to run on a CPU, for the tests only.

megatron-core assumes a GPU: ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``
and a hard-coded ``torch.zeros(..., device="cuda")`` in its 1F1B schedule. In the test
processes (never in the package) these are mapped to the CPU. A ``TorchFunctionMode`` is
per thread: it is entered on this thread and on every thread started afterwards (the
drop-in runs the model on its compute thread; ``GPTModel``'s default causal mask is made
with ``device="cuda"``).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``torch.device("cuda")``) to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def install() -> CudaToCpu:
    """Patch ``torch.cuda`` for megatron-core on a CPU and enter the device mode on this
    thread; quiet megatron's import-time warnings (TE/Apex missing)."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    mode = CudaToCpu()
    mode.__enter__()
    run = threading.Thread.run

    def run_on_cpu(self: threading.Thread) -> None:
        with CudaToCpu():
            run(self)

    threading.Thread.run = run_on_cpu  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel  # noqa: F401
    return mode


def no_op_rng_tracker() -> None:
    """Megatron's CUDA RNG tracker forks nothing (GPTModel asks for it; dropout is 0)."""
    import contextlib

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
