"""Free loopback ports, and the start/stop plumbing shared by the loopback HTTP test doubles."""

from __future__ import annotations

import http.server
import socket
import threading
import time

from ampwatch_support.patience import SETTLE_S

__all__ = ["LoopbackServer", "free_port"]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
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
