"""Who may do what, before any route runs: the Host allow-list, the optional read token and the per-client rate
limit."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable

from ampwatch.contract.metrics import COLLECTOR_REFUSED_REQUESTS

from ._hosts import HostAllowList, host_name

__all__ = ["AccessGuard", "AccessMetrics", "RateLimiter", "READ_PREFIXES", "bearer_matches"]

# Paths that reveal what the collector holds; the status page's files and health checks stay open.
READ_PREFIXES = ("/metrics", "/v1/")
_INGEST = "/v1/ingest"


def bearer_matches(given: bytes | None, token: str) -> bool:
    """Tell whether an ``Authorization`` header carries ``token`` as a bearer token (constant-time).

    The scheme is case-insensitive, as HTTP says: ``bearer``, ``Bearer`` and ``BEARER`` all work.
    """
    scheme, _, credentials = (given or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token.encode())


class RateLimiter:
    """A token bucket per client address: ``rate`` tokens per second on average, bursts up to ``burst``
    (default ``2 * rate``). A request takes one token; a batch's events take one each (``cost``).

    At most ``max_clients`` buckets are kept; when full, buckets that refilled (idle clients) go first,
    so a flood of spoofed or many distinct addresses cannot grow memory without bound. Each call costs O(1).
    """

    def __init__(self, rate: float, max_clients: int = 10_000, clock: Callable[[], float] = time.monotonic,
                 burst: float | None = None) -> None:
        self.rate, self.max_clients, self.clock = rate, max_clients, clock
        self.burst = 2.0 * rate if burst is None else burst
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, time of last refill)

    def allow(self, client: str, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens for ``client``; return False (taking none) when its bucket holds fewer."""
        now = self.clock()
        tokens, then = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if client not in self._buckets and len(self._buckets) >= self.max_clients:
            self._forget_idle(now)
        if tokens < cost:
            self._buckets[client] = (tokens, now)
            return False
        self._buckets[client] = (tokens - cost, now)
        return True

    def retry_after(self, client: str, cost: float = 1.0) -> int:
        """Whole seconds until ``client`` has ``cost`` tokens again (at least 1)."""
        tokens, _ = self._buckets.get(client, (0.0, 0.0))
        return max(1, int((cost - tokens) / self.rate + 0.999))

    def _forget_idle(self, now: float) -> None:
        full = [c for c, (t, then) in self._buckets.items() if t + (now - then) * self.rate >= self.burst]
        for client in full or list(self._buckets)[: max(1, len(self._buckets) // 10)]:
            del self._buckets[client]

    def __len__(self) -> int:
        return len(self._buckets)


class AccessGuard:
    """Refuse a request before routing: with more than one ``Host`` (400), for a name this collector does not serve
    (421), over the client's rate (429), or reading without the read token (401/403)."""

    def __init__(self, read_token: str | None, rate_limit: float, hosts: HostAllowList | None = None) -> None:
        self._read_token = read_token
        self.hosts = hosts
        self.limiter = RateLimiter(rate_limit) if rate_limit > 0 else None
        self.refused: dict[str, int] = {"host": 0, "rate": 0, "read_auth": 0}  # exposed in /metrics

    def refusal(self, scope: dict) -> tuple[int, dict, list[tuple[bytes, bytes]]] | None:
        """Return ``(status, body, extra headers)`` when the request must be refused, else None."""
        authorities = [value for name, value in scope.get("headers") or () if name == b"host"]
        if len(authorities) > 1:
            # The allow-list would read one and the ingest's Origin check another (HTTP/1.1: always a 400).
            self.refused["host"] += 1
            return 400, {"error": "host", "retry": False,
                         "message": f"the request has {len(authorities)} Host headers; HTTP allows one"}, []
        if self.hosts is not None:
            authority = authorities[0] if authorities else None
            if not self.hosts.allows(authority):
                self.refused["host"] += 1
                name = (host_name(authority or b"") or "")[:64]
                # "retry": an agent keeps its batches until the operator adds the name it uses.
                return 421, {"error": "host", "retry": True,
                             "message": f"this collector does not answer to the name {name!r} (the request's Host); "
                             f"it serves {self.hosts.describe()}. If agents or Prometheus reach it by that name, "
                             "add it to --allowed-hosts (AMPWATCH_SERVER_ALLOWED_HOSTS); a web page on another "
                             "site whose name points here (DNS rebinding) is refused this way"}, []
        if self.limiter is not None:
            client = (scope.get("client") or ("unknown", 0))[0]
            if not self.limiter.allow(client):
                self.refused["rate"] += 1
                wait = self.limiter.retry_after(client)
                return 429, {"error": "rate", "retry": True,
                             "message": f"too many requests from {client}: this collector allows "
                             f"{self.limiter.rate:g} per second per client address (--rate-limit); retry in "
                             f"{wait} s"}, [(b"retry-after", str(wait).encode())]
        path = scope.get("path", "")
        if self._read_token is None or path == _INGEST or not path.startswith(READ_PREFIXES):
            return None
        given = dict(scope.get("headers") or ()).get(b"authorization")
        if not given:
            self.refused["read_auth"] += 1
            return 401, {"error": "auth", "message": "this collector requires a read token: send 'Authorization: "
                         "Bearer <token>' (Prometheus: authorization.credentials in the scrape config)"}, \
                [(b"www-authenticate", b"Bearer")]
        if not bearer_matches(given, self._read_token):
            self.refused["read_auth"] += 1
            return 403, {"error": "auth", "message": "the read token is wrong: it must equal the collector's "
                         "--read-token / AMPWATCH_SERVER_READ_TOKEN"}, []
        return None

    async def refuse(self, send: Callable, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the refusal as a JSON answer."""
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), *headers]})
        await send({"type": "http.response.body", "body": payload})


class AccessMetrics:
    """A prometheus_client Collector exposing the guard's refusals (read at scrape time)."""

    def __init__(self, guard: AccessGuard) -> None:
        self.guard = guard

    def collect(self):  # noqa: ANN201 - prometheus_client's Collector protocol
        from prometheus_client.core import CounterMetricFamily
        family = CounterMetricFamily(COLLECTOR_REFUSED_REQUESTS.name.removesuffix("_total"),
                                     COLLECTOR_REFUSED_REQUESTS.help, labels=list(COLLECTOR_REFUSED_REQUESTS.labels))
        for reason, count in list(self.guard.refused.items()):  # one C call: safe while the loop adds a reason
            family.add_metric([reason], count)
        yield family
