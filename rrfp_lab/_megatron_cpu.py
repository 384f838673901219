"""What megatron-core's pipeline schedules need to run on a CPU: for the processes the
megatron benchmark (and the tests) spawn, never for the drop-in itself.

megatron-core assumes a GPU: ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``
and a hard-coded ``torch.zeros(..., device="cuda")`` in its schedules. In such a process
these are mapped to the CPU. A ``TorchFunctionMode`` is per thread: it is entered on this
thread and on every thread started afterwards (the drop-in runs the model on its compute
thread; ``GPTModel``'s default causal mask is made with ``device="cuda"``).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "install", "no_op_rng_tracker"]


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
    thread (and every thread started afterwards); quiet megatron's import-time warnings
    (TE/Apex missing). Only in a process of its own: it changes torch for the process."""
    cuda: Any = torch.cuda  # patched on purpose: megatron asks it for its device
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    mode = CudaToCpu()
    mode.__enter__()  # type: ignore[no-untyped-call]
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
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
