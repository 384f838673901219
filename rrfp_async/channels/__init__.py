"""Channels: how stages exchange activations, gradients and TP decisions.

Nothing in this package imports ``policies/``: moving messages is independent of deciding.

Internal to the package family: imported by this face for the packages above, not in ``__all__``:

* ``LatencyFn``: the type of ``LocalChannel``'s ``latency`` (``LocalPipeline`` takes one);
* ``nccl_rules``, ``nccl_logs``: the NCCL-rules checker's two modules, which
  ``distributed/``'s group wiring wraps the process groups with when it is on.
"""

from . import _nccl_logs, _nccl_rules
from ._base import AbortSink, ClosingSink, Endpoint, Sink, ThreadsafeEndpoint
from ._decisions import DecisionChannel, sequence_digest
from ._local import LatencyFn as LatencyFn
from ._local import LocalChannel, LocalEndpoint
from ._p2p import P2PChannel
from ._wire import HEADER_LEN, encode_header

# Internal to the package family (see above): the checker's modules under face names.
nccl_logs = _nccl_logs
nccl_rules = _nccl_rules

__all__ = [
    "HEADER_LEN",
    "AbortSink",
    "ClosingSink",
    "DecisionChannel",
    "Endpoint",
    "LocalChannel",
    "LocalEndpoint",
    "P2PChannel",
    "Sink",
    "ThreadsafeEndpoint",
    "encode_header",
    "sequence_digest",
]
