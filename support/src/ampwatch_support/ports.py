"""Free loopback ports, and the start/stop plumbing shared by the loopback HTTP test doubles."""

from __future__ import annotations

import http.server
import random
import socket
import threading
import time

from ampwatch_support.patience import SETTLE_S

__all__ = ["LoopbackServer", "free_port"]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections and ``bind(0)`` (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOW = _ephemeral_low()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range.

    A port is free between this call and whoever binds it (a collector, a DDP job's rendezvous, seconds later
    while its ranks import torch). From the ephemeral range, any outgoing connection meanwhile (every batch an
    agent posts, gloo's own) could take it: a DDP job's store then failed with EADDRINUSE in CI. Below it only
    another such pick can, one in about 12,000.
    """
    low = max(1024, _LOW - 12_000)
    for _ in range(200):
        port = random.randrange(low, _LOW)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that whole stretch in use: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackServer:
    """A threading HTTP server on ``127.0.0.1:port``; subclasses define ``start``/``stop`` around
    :meth:`_serve` and :meth:`_shut_down`, which may alternate, so a double can go down and come back."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        """Listen on ``self.port`` with ``handler``, serving in a daemon thread."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
                break
            except OSError:  # the old socket may linger a moment after a stop
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def _shut_down(self) -> None:
        """Stop listening (connections already open are the subclass's business)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
