"""The ``rrfp-async`` command line and its benchmarks (tools, not library API)."""

from ._main import main

__all__ = ["main"]
