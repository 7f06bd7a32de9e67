"""A real HTTP server on a free loopback port that records ingest batches and misbehaves on request.

Not the collector: a test double at the network boundary, so agent tests can
see exactly what went over the wire (including retries the real collector
would deduplicate), and make the far end fail, hang, or vanish.

>>> with RecordingCollector() as server:
...     server.url.startswith("http://127.0.0.1:")
True
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Any

from ampwatch.contract.node_batch import is_node_batch, split_node_batch
from ampwatch.contract.protocol import LISTED_EVENT_KINDS
from ampwatch_support.patience import SETTLE_S
from ampwatch_support.ports import LoopbackServer, free_port

__all__ = ["RecordingCollector", "free_port"]


class RecordingCollector(LoopbackServer):
    """Records every POST to ``/v1/ingest``; answers ``status`` after ``delay`` seconds.

    ``received`` holds every decoded body in arrival order, retries included
    (``bodies`` the same as the bytes sent); ``acked`` only those answered 2xx; ``arrivals`` the
    ``time.monotonic()`` at which each POST came in, before its delay. Change ``status``/``delay`` at any time
    (a delayed answer ends early when the server stops);
    ``reply`` (a JSON object) and ``retry_after`` (a header value) make a non-2xx
    answer look like the real collector's, with its ``retry`` verdict and message.
    :meth:`stop` and :meth:`start` make it go down and come back on the same port.

    ``kinds`` plays the collector's version for the event kinds of ``LISTED_EVENT_KINDS``: a list (by default all
    of them) answers as a collector that takes them (each 2xx answer lists them); ``None`` as a collector from
    before them (2xx answers without ``"kinds"``; a batch holding one is refused 422 for good, and not recorded as
    acked). A protocol v2 body (a node relay's) is answered per inner batch, as the collector does; ``received``
    then holds the inner batches.
    """

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        self.status = 200
        self.delay = 0.0
        self.reply: dict[str, Any] | None = None
        self.retry_after: str | None = None
        self.kinds: list[str] | None = list(LISTED_EVENT_KINDS)
        self.requests = 0  # POSTs answered (a v2 request counts once)
        self.received: list[dict[str, Any]] = []
        self.bodies: list[bytes] = []
        self.acked: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.arrivals: list[float] = []
        self.changed = threading.Condition()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()

    def start(self) -> RecordingCollector:
        """Listen on ``self.port`` (again)."""
        self._stopping.clear()
        self._serve(_handler_for(self))
        return self

    def stop(self) -> None:
        """Stop listening and drop open connections (an outage); delayed answers go at once."""
        self._stopping.set()
        self._shut_down()
        with self.changed:
            connections, self._connections = list(self._connections), set()
        for conn in connections:  # kept-alive connections would otherwise outlive the "outage"
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait_for(self, predicate, timeout: float = SETTLE_S) -> bool:
        """Wait until ``predicate(self)`` holds; return whether it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True

    def event_ids(self) -> list[int]:
        """Return the ids of every event in acknowledged batches, in arrival order."""
        return [e["id"] for batch in self.acked for e in batch["events"]]


def _handler_for(server: RecordingCollector) -> type[http.server.BaseHTTPRequestHandler]:
    """Make a request handler class bound to ``server``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like the real collector under uvicorn

        def setup(self) -> None:
            super().setup()
            with server.changed:
                server._connections.add(self.connection)

        def finish(self) -> None:
            with server.changed:
                server._connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status, delay, reply, retry_after = server.status, server.delay, server.reply, server.retry_after
            with server.changed:
                server.arrivals.append(time.monotonic())
                server.changed.notify_all()
            if delay:
                server._stopping.wait(delay)
            pieces = split_node_batch(body) if is_node_batch(body) else [body]
            answers = [_answer(server, piece, status, reply) for piece in pieces or []]
            with server.changed:
                server.requests += 1
                for piece, (piece_status, _) in zip(pieces or [], answers, strict=True):
                    batch = json.loads(piece)
                    server.received.append(batch)
                    server.bodies.append(piece)
                    server.headers.append(dict(self.headers))
                    if 200 <= piece_status < 300 and self.path == "/v1/ingest":
                        server.acked.append(batch)
                server.changed.notify_all()
            if self.path != "/v1/ingest":
                status, answer = 404, json.dumps(reply or {"applied": False}).encode()
            elif pieces is None:
                status, answer = 400, b'{"error": "framing", "retry": false}'
            elif is_node_batch(body) and 200 <= status < 300:
                results = [{"status": piece_status, **piece_answer} for piece_status, piece_answer in answers]
                answer = json.dumps({"protocol": 2, "results": results}).encode()
            else:
                status, answer = answers[0][0], json.dumps(answers[0][1]).encode()
            ok = 200 <= status < 300
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                if retry_after is not None and not ok:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(answer)
            except OSError:  # the client gave up waiting
                pass

        def log_message(self, *args: Any) -> None:
            """Keep test output quiet."""

    return Handler


def _answer(server: RecordingCollector, body: bytes, status: int, reply: dict[str, Any] | None
            ) -> tuple[int, dict[str, Any]]:
    """Return the status and JSON answer to one v1 batch, as the collector ``server`` plays would give it."""
    kinds = server.kinds
    if 200 <= status < 300 and kinds is None and any(f'"kind":"{k}"'.encode() in body for k in LISTED_EVENT_KINDS):
        return 422, {"error": "schema", "retry": False,
                     "message": "the batch does not follow protocol v1 (docs/protocol.md): unknown event kind"}
    if not 200 <= status < 300:
        return status, reply if reply is not None else {"applied": False}
    return status, {"applied": True} if kinds is None else {"applied": True, "kinds": list(kinds)}
