"""Ports for a rendezvous on 127.0.0.1 (``spawn``'s and a test's own process groups)."""

from __future__ import annotations

import socket

from .._errors import ResourceError
from .._resources import fd_usage, is_fd_shortage, no_fds_error

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now.

    Raises:
        ResourceError: No socket (the process is at its file-descriptor limit) or no port.

    Returns:
        The port number. Another process may take it before it is bound again: use it at
        once (as ``init_method=f"tcp://127.0.0.1:{port}"``).
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    except OSError as e:  # EMFILE: no descriptor for the socket; EADDRINUSE: no port left
        if is_fd_shortage(e):
            raise no_fds_error("free_port", "a socket to find a free port") from e
        in_use, limit = fd_usage()
        raise ResourceError(
            f"free_port: no TCP port on 127.0.0.1 can be had: {e} (this process has {in_use}"
            " file descriptors open); free ports (`ss -tan` lists them) or widen"
            " net.ipv4.ip_local_port_range",
            resource="ports",
            in_use=in_use,
            limit=limit,
        ) from e
