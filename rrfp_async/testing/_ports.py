"""Ports for a rendezvous on 127.0.0.1 (``spawn``'s and a test's own process groups)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Returns:
        The port number. Another process may take it before it is bound again: use it at
        once (as ``init_method=f"tcp://127.0.0.1:{port}"``).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
