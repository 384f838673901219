"""Hints (schedule orders) and policies (coroutines that pick among ready tasks).

One concept per module, bottom first:

* ``_listsched``: list scheduling on declared durations (cost-aware hints, the plan a hint
  stands for);
* ``_validate``: the ``Hint`` type and ``validate_hint``;
* ``_bounds``: admission bounds (``default_bound``, ``resolve_bounds``);
* ``_hints``: the hint generators and their registry (``HINTS``, ``make_hint``);
* ``_torch_hints``: any ``torch.distributed.pipelining`` schedule as a hint;
* ``_schedule``: ``StepSchedule``, a validated plan + hint + bounds, and each rank's program;
* ``_ahead``: ``PlanAhead``, the next step's schedule built on a worker thread while this
  step runs;
* ``_policy``: the ``Policy`` protocol, the ``ReadyView`` it reads, the built-in policies
  and their registry.

Admission (``AdmissionLedger``, ``hint_peak``: the in-flight bound every dispatch keeps) is
plain data of the base layer, re-exported here beside the bounds it checks.

Nothing here imports ``channels/``: deciding is independent of how messages move.

Internal to the package family: imported here for the packages above, not in ``__all__``:

* ``check_durations``: a ``Durations``' shape against its plan (``_hints``);
* ``reference_orders``: the fixed order a default byte budget is taken from (``_schedule``);
* ``HINT_ALIASES``: the hint names' aliases (``_hints._ALIASES``; torchtitan's schedule
  names are built from them).
"""

from .._admission import AdmissionLedger, hint_peak
from ._ahead import PlanAhead
from ._bounds import default_bound, resolve_bounds
from ._hints import (
    _ALIASES,
    HINTS,
    HintFn,
    backward_first,
    backward_forward_warmup,
    breadth_first,
    breadth_first_weighted,
    canonical_hint_name,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    make_hint,
    one_f_one_b,
    remaining_work,
    zb_h1,
)
from ._hints import check_durations as check_durations
from ._listsched import list_schedule, strict_timeline
from ._policy import (
    ENTRY_POINT_GROUP,
    NamedPolicy,
    Policy,
    PolicyBase,
    ReadyHeadPolicy,
    ReadyView,
    available_policies,
    backfill,
    chooses_ready_head,
    get_policy,
    greedy,
    lateness_aware,
    policy_name,
    readiness_first,
    register_policy,
    strict,
)
from ._schedule import RankProgram, StepSchedule
from ._schedule import reference_orders as reference_orders
from ._torch_hints import hint_from_torch
from ._validate import Hint, validate_hint

# Internal to the package family (see above), under a name that says which aliases.
HINT_ALIASES = _ALIASES

__all__ = [
    "ENTRY_POINT_GROUP",
    "HINTS",
    "AdmissionLedger",
    "Hint",
    "HintFn",
    "NamedPolicy",
    "PlanAhead",
    "Policy",
    "PolicyBase",
    "RankProgram",
    "ReadyHeadPolicy",
    "ReadyView",
    "StepSchedule",
    "available_policies",
    "backfill",
    "backward_first",
    "backward_forward_warmup",
    "breadth_first",
    "breadth_first_weighted",
    "canonical_hint_name",
    "chooses_ready_head",
    "default_bound",
    "get_policy",
    "gpipe",
    "greedy",
    "hint_from_torch",
    "hint_peak",
    "interleaved_1f1b",
    "lateness_aware",
    "list_schedule",
    "looped_bfs",
    "make_hint",
    "one_f_one_b",
    "policy_name",
    "readiness_first",
    "register_policy",
    "remaining_work",
    "resolve_bounds",
    "strict",
    "strict_timeline",
    "validate_hint",
    "zb_h1",
]
