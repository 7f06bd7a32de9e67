"""A real HTTP receiver on a free loopback port that records POSTed JSON and can fail, hang or be down on demand."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ampwatch_support.patience import SETTLE_S
from ampwatch_support.ports import LoopbackServer, free_port

__all__ = ["WebhookReceiver", "free_port"]


class WebhookReceiver(LoopbackServer):
    """Record every POST (path, JSON body, monotonic time); answer ``status`` or hang while ``hold`` is clear.

    >>> with WebhookReceiver() as r:   # doctest: +SKIP
    ...     post(r.url + "/hook", {...}); r.wait_for(lambda reqs: len(reqs) == 1)
    """

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        self.requests: list[dict[str, Any]] = []
        self.attempts: list[float] = []  # every POST, answered or not
        self.status = 200
        self.fail_next = 0  # answer 503 to this many POSTs first
        self.hold = threading.Event()
        self.hold.set()  # cleared: requests block until it is set again
        self.arrived = threading.Event()
        self._cond = threading.Condition()

    def start(self) -> WebhookReceiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._cond:
                    receiver.attempts.append(time.monotonic())
                receiver.arrived.set()
                receiver.hold.wait(30)
                with receiver._cond:
                    if receiver.fail_next > 0:
                        receiver.fail_next -= 1
                        code = 503
                    else:
                        code = receiver.status
                        if code < 300:
                            receiver.requests.append({"path": self.path, "body": json.loads(body or b"null"),
                                                      "time": time.monotonic(),
                                                      "content_type": self.headers.get("Content-Type")})
                    receiver._cond.notify_all()
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._serve(Handler)
        return self

    def stop(self) -> None:
        self.hold.set()
        self._shut_down()

    def wait_for(self, done: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = SETTLE_S) -> list[dict[str, Any]]:
        """Wait until ``done(requests)`` holds; return the requests (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(self.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"receiver condition not met in {timeout}s; got {self.requests!r}")
                self._cond.wait(left)
            return list(self.requests)

