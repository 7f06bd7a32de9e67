"""Connections that hold the collector without asking anything of it: bounded in time, per address and in number.

uvicorn's keep-alive timeout starts only once a response is sent, so a connection that never
completes a request (silent, or half a request line) would hold a file handle for good, and
enough of them would leave none for a new agent. Here, on top of the HTTP protocol uvicorn picks:

- a request's headers must arrive within ``header_timeout`` of the connection opening (or of the
  request's first byte, on a kept-alive connection), its body within ``body_timeout`` of the headers;
  the connection is closed otherwise;
- one client address holds at most ``per_client`` connections at once; more are closed as they open;
- connections still waiting for a request's headers or body are at most ``pending_cap``: when one
  more opens, the oldest of them is closed. Agents send a whole request as soon as they connect, so
  their connections leave that set within a moment, while idle ones (silent, or headers sent and no
  body) can never take every file handle.

Each closing is counted in ``counts`` (the access guard's, exposed in ``/metrics``). O(1) per
connection and per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

__all__ = ["ConnectionLimits", "bounded_protocol", "pending_cap_for"]


def pending_cap_for(open_files: int) -> int:
    """How many connections may wait for a request's headers or body at once: half the open-file limit."""
    return max(64, open_files // 2)


class ConnectionLimits:
    """What every connection of one server shares: the limits, the per-address counts, the waiting connections."""

    def __init__(self, *, header_timeout: float, body_timeout: float, per_client: int, pending_cap: int,
                 counts: MutableMapping[str, int]) -> None:
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.per_client, self.pending_cap = per_client, pending_cap
        self.clients: dict[str, int] = {}  # address -> connections open
        self.pending: dict[Any, None] = {}  # connections waiting for a request's headers or body, oldest first
        self.counts = counts
        for reason in ("client_connections", "request_timeout", "idle_evicted"):
            counts.setdefault(reason, 0)

    def close(self, protocol: Any, reason: str) -> None:
        self.counts[reason] += 1
        protocol.transport.close()


def bounded_protocol(limits: ConnectionLimits, base: type | None = None) -> type:
    """Return uvicorn's HTTP protocol class (httptools, else h11; or ``base``) held to ``limits``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol
        base = AutoHTTPProtocol

    class BoundedProtocol(base):  # type: ignore[misc, valid-type]  # a base chosen at run time (httptools or h11)
        _timer: asyncio.TimerHandle | None = None
        _address: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._address = address = self.client[0] if self.client else ""
            open_now = limits.clients[address] = limits.clients.get(address, 0) + 1
            if limits.per_client and open_now > limits.per_client:
                limits.close(self, "client_connections")
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            idle = before is None or before.response_complete
            super().data_received(data)
            cycle = self.cycle
            if cycle is not before:  # a request's headers are complete
                self._stop()
                if cycle.more_body and not self.transport.is_closing():
                    self._timer = self.loop.call_later(limits.body_timeout, limits.close, self, "request_timeout")
                    self._hold()  # pending until its body is complete (headers whole in one read: from now)
                else:
                    limits.pending.pop(self, None)
            elif idle and self._timer is None and not self.transport.is_closing():
                self._await_headers()  # a new request began on a kept-alive connection
            elif self._timer is not None and cycle is not None and not cycle.more_body and not idle:
                self._stop()  # the body is complete
                limits.pending.pop(self, None)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop()
            limits.pending.pop(self, None)
            if self._address is not None:
                left = limits.clients.get(self._address, 1) - 1
                if left > 0:
                    limits.clients[self._address] = left
                else:
                    limits.clients.pop(self._address, None)
                self._address = None
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._timer = self.loop.call_later(limits.header_timeout, limits.close, self, "request_timeout")
            self._hold()

        def _hold(self) -> None:
            """Count this connection as pending (where it was, if it was), closing the oldest past the cap."""
            limits.pending[self] = None
            if len(limits.pending) > limits.pending_cap:
                oldest = next(iter(limits.pending))
                del limits.pending[oldest]
                limits.close(oldest, "idle_evicted")

        def _stop(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    return BoundedProtocol
