"""POST a batch to one collector over a kept-alive HTTP connection (standard library only)."""

from __future__ import annotations

import enum
import http.client
import urllib.parse

__all__ = ["Outcome", "IngestClient", "classify"]

INGEST_PATH = "/v1/ingest"


class Outcome(enum.Enum):
    """What the sender does with a batch after one attempt."""

    ACKED = "acked"        # 2xx: durable at the collector; forget it
    RETRY = "retry"        # no answer, 5xx, 408, 429: send the very same batch again later
    REJECTED = "rejected"  # any other answer: sending it again cannot help; drop and count


def classify(status: int | None) -> Outcome:
    """Map an HTTP status (``None``: no answer) to what the sender does next."""
    if status is None or status >= 500 or status in (408, 429):
        return Outcome.RETRY
    if 200 <= status < 300:
        return Outcome.ACKED
    return Outcome.REJECTED


class IngestClient:
    """One collector's ingest endpoint; reconnects after any connection error."""

    def __init__(self, base_url: str, token: str | None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        self.url = base_url
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "", parts.port
        self._path = parts.path.rstrip("/") + INGEST_PATH
        self._headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes, timeout: float) -> tuple[int | None, str]:
        """Send ``body``; return (status, short reason). Status ``None`` means no answer (with the error)."""
        reused = self._conn is not None
        status, detail, timed_out = self._attempt(body, timeout)
        if status is None and reused and not timed_out:
            # The collector may have closed an idle kept-alive connection: that is not an outage.
            status, detail, _ = self._attempt(body, timeout)
        return status, detail

    def _attempt(self, body: bytes, timeout: float) -> tuple[int | None, str, bool]:
        """Make one request on the current (or a new) connection; also say whether it timed out."""
        try:
            conn = self._connection(timeout)
            conn.request("POST", self._path, body=body, headers=self._headers)
            response = conn.getresponse()
            detail = response.read().decode("utf-8", "replace")[:500]
            if response.will_close:
                self.close()
            return response.status, detail, False
        except TimeoutError as exc:
            self.close()
            return None, f"no answer within {timeout:.3g} s ({exc})", True
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return None, f"{type(exc).__name__}: {exc}", False

    def close(self) -> None:
        """Drop the connection (the next post opens a new one)."""
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:  # pragma: no cover - closing a broken socket
                pass
            self._conn = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """Return the kept-alive connection with ``timeout`` applied, opening one if needed."""
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn
