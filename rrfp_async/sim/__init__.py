"""The simulator: a whole pipeline in one process on a virtual clock.

``simulate`` runs the real :class:`~rrfp_async.loop.StageLoop` code (policies, admission,
channels) with a :class:`~rrfp_async.loop.CostModelExecutor` on a
:class:`~rrfp_async.loop.VirtualEventLoop`, so a 128-stage pipeline takes seconds and its
timeline is exact and reproducible.

What a simulation is built from is here too: ``CostModelExecutor`` (a stage's tasks as
sleeps of their declared cost), ``VirtualEventLoop`` (the virtual clock), ``Workload`` and
``WORKLOADS`` (the named microbatch-size distributions ``make_workload`` draws from).

Internal to the package family: imported here for the lab (``rrfp_lab``), not in ``__all__``:
``TP_DECISION_LATENCY``, ``TP_STEP_CHECK`` (the modelled TP coordination terms) and
``fit_tp_term`` (their fit to measured figures), from ``_sim_tp``.
"""

from .._workloads import WORKLOADS, Workload
from ..loop import CostModelExecutor, VirtualEventLoop
from ._sim_tp import TP_DECISION_LATENCY as TP_DECISION_LATENCY
from ._sim_tp import TP_STEP_CHECK as TP_STEP_CHECK
from ._sim_tp import fit_tp_term as fit_tp_term
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
    "WORKLOADS",
    "CostModelExecutor",
    "SimResult",
    "VirtualEventLoop",
    "Workload",
    "compare",
    "lower_bound",
    "simulate",
]
