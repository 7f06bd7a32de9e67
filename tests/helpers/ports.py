"""Free loopback ports for test servers."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
