"""Adapters that let users of the peers keep their code (a layer above ``distributed/``).

* :mod:`rrfp_async.pipelining`: ``ScheduleReadinessFirst``, torch.distributed.pipelining's
  schedule API over the readiness-first runtime.
* :mod:`rrfp_async.megatron`: ``get_forward_backward_func``, megatron-core's
  forward-backward function over the readiness-first runtime.
* :mod:`rrfp_async.torchtitan`: torchtitan's schedule names and override factory
  (``_torchtitan``; importing that face patches torchtitan's schedule lookup).

The peers are imported lazily: ``import rrfp_async`` never imports them.

Internal to the package family: ``megatron_order`` (the order Megatron's own schedule runs a
stage's tasks in, for the lab, ``rrfp_lab``), in ``_INTERNAL``, lazy like the rest, not in
``__all__``.
"""

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from ._megatron_dropin import MegatronForwardBackward, get_forward_backward_func
    from ._megatron_peer import megatron_order as megatron_order
    from ._torch_pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

# Each adapter is imported when first named (importing torch.distributed.pipelining is slow;
# a Megatron user should not pay for it).
_WHERE = {
    "MegatronForwardBackward": "._megatron_dropin",
    "get_forward_backward_func": "._megatron_dropin",
    "ScheduleInterleavedReadinessFirst": "._torch_pipelining",
    "ScheduleReadinessFirst": "._torch_pipelining",
}

_INTERNAL = {"megatron_order": "._megatron_peer"}

__getattr__, __dir__ = exports(__name__, {**_WHERE, **_INTERNAL})


__all__ = [
    "MegatronForwardBackward",
    "ScheduleInterleavedReadinessFirst",
    "ScheduleReadinessFirst",
    "get_forward_backward_func",
]
