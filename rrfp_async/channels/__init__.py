"""Channels: how stages exchange activations, gradients and TP decisions.

Nothing in this package imports ``policies/``: moving messages is independent of deciding.

Internal to the package family: imported by this face for the packages above, not in ``__all__``:

* ``LatencyFn``: the type of ``LocalChannel``'s ``latency`` (``LocalPipeline`` takes one);
* ``wire``: the wire format module (``_wire``), for the NCCL-rules checker
  (``rrfp_async.testing``), which reads its message kinds and wraps its host packers.
"""

from . import _wire
from ._base import AbortSink, ClosingSink, Endpoint, Sink, ThreadsafeEndpoint
from ._decisions import DecisionChannel, sequence_digest
from ._local import LatencyFn as LatencyFn
from ._local import LocalChannel, LocalEndpoint
from ._p2p import P2PChannel
from ._wire import HEADER_LEN, encode_header

# Internal to the package family (see above): the wire format module under a face name.
wire = _wire

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
