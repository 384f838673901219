"""Channels: how stages exchange activations, gradients and TP decisions.

Nothing here imports ``policies/``: moving messages is independent of deciding.
"""

from ._base import Endpoint, Sink
from ._decisions import DecisionChannel, sequence_digest
from ._local import LocalChannel, LocalEndpoint
from ._p2p import P2PChannel
from ._wire import HEADER_LEN, encode_header

__all__ = [
    "HEADER_LEN",
    "DecisionChannel",
    "Endpoint",
    "LocalChannel",
    "LocalEndpoint",
    "P2PChannel",
    "Sink",
    "encode_header",
    "sequence_digest",
]
