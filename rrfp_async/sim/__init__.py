"""The simulator: a whole pipeline in one process on a virtual clock.

``simulate`` runs the real :class:`~rrfp_async.loop.StageLoop` code (policies, admission,
channels) with a :class:`~rrfp_async.loop.CostModelExecutor` on a
:class:`~rrfp_async.loop.VirtualEventLoop`, so a 128-stage pipeline takes seconds and its
timeline is exact and reproducible.
"""

from ._simulate import (
    DEFAULT_WALL_LIMIT,
    MAX_CELLS,
    MAX_CELLS_PER_RANK,
    SimResult,
    compare,
    lower_bound,
    simulate,
)

__all__ = [
    "DEFAULT_WALL_LIMIT",
    "MAX_CELLS",
    "MAX_CELLS_PER_RANK",
    "SimResult",
    "compare",
    "lower_bound",
    "simulate",
]
