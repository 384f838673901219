"""What megatron-core's pipeline schedule needs to run on a CPU, for the tests only.

megatron-core assumes a GPU: ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``
and a hard-coded ``torch.zeros(..., device="cuda")`` in its 1F1B schedule. In the test
processes (never in the package) these are mapped to the CPU. The ``TorchFunctionMode``
is per thread: it is entered on the thread that calls Megatron's schedule.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``torch.device("cuda")``) to the CPU."""

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.pipeline_parallel  # noqa: F401
    return mode


def no_op_rng_tracker() -> None:
    """A CUDA RNG tracker that forks nothing (GPTModel asks for one; dropout is 0)."""
    import contextlib

    from megatron.core import tensor_parallel

    class _Tracker:
        def fork(self, *a: Any, **k: Any) -> Any:
            return contextlib.nullcontext()

        def add(self, *a: Any, **k: Any) -> None:
            pass

        def get_states(self) -> dict[str, Any]:
            return {}

        def set_states(self, states: Any) -> None:
            pass

        def is_initialized(self) -> bool:
            return True

    tracker = _Tracker()
    tensor_parallel.random.get_cuda_rng_tracker = lambda *a, **k: tracker  # type: ignore[attr-defined]
