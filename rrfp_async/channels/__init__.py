"""Channels: how stages exchange activations, gradients and TP decisions."""

from ._base import Endpoint, Sink
from ._local import LocalChannel, LocalEndpoint

__all__ = ["Endpoint", "LocalChannel", "LocalEndpoint", "Sink"]
