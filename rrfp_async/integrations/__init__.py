"""Adapters that let users of the peers keep their code (a layer above ``distributed/``).

* :mod:`rrfp_async.pipelining`: ``ScheduleReadinessFirst``, torch.distributed.pipelining's
  schedule API over the readiness-first runtime.
* :mod:`rrfp_async.megatron`: ``get_forward_backward_func``, megatron-core's
  forward-backward function over the readiness-first runtime.

The peers are imported lazily: ``import rrfp_async`` never imports them.
"""

from ._megatron import MegatronForwardBackward, get_forward_backward_func
from ._torch_pipelining import ScheduleInterleavedReadinessFirst, ScheduleReadinessFirst

__all__ = [
    "MegatronForwardBackward",
    "ScheduleInterleavedReadinessFirst",
    "ScheduleReadinessFirst",
    "get_forward_backward_func",
]
