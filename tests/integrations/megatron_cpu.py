"""What megatron-core's pipeline schedule needs to run on a CPU, for the test processes:
the megatron benchmark's shims (``rrfp_lab._megatron_cpu``), one implementation."""

from __future__ import annotations

from rrfp_lab._megatron_cpu import CudaToCpu, install, no_op_rng_tracker

__all__ = ["CudaToCpu", "install", "no_op_rng_tracker"]
