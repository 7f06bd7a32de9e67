"""POST a batch to one collector over a kept-alive HTTP connection (standard library only)."""

from __future__ import annotations

import dataclasses
import enum
import http.client
import json
import urllib.parse

from ampwatch.contract.node_batch import is_node_batch

__all__ = ["ANSWER_BYTES", "RESULT_BYTES", "Answer", "Outcome", "IngestClient", "answer_limit", "classify"]

INGEST_PATH = "/v1/ingest"

ANSWER_BYTES = 16 * 1024
"""The most of an answer to one batch the agent reads: a collector's longest (a schema refusal with its
ten detail lines) is a few KiB. Whatever answers at the collector's address with more is cut here, and
its connection dropped rather than read to the end: the training process never holds a long answer."""
RESULT_BYTES = 4 * 1024
"""What each further inner batch of a node relay's protocol-v2 request adds to that: its one result."""


def answer_limit(body: bytes) -> int:
    """Return the most bytes of the answer to ``body`` the agent reads (a v2 body's answer has one result per batch).

    Costs a prefix check, and for a v2 body a count of the commas in its head.
    """
    batches = 1
    if is_node_batch(body):
        batches += body.count(b",", 0, body.find(b"]"))  # the head: {"protocol":2,"lengths":[812,815],...
    return ANSWER_BYTES + RESULT_BYTES * (batches - 1)


class Outcome(enum.Enum):
    """What the sender does with a batch after one attempt."""

    ACKED = "acked"        # 2xx: durable at the collector; forget it
    RETRY = "retry"        # no answer, 5xx, 408, 429, or "retry": true: send the very same batch again later
    REJECTED = "rejected"  # refused for good ("retry": false, or another 4xx): drop and count


def classify(status: int | None, retry: bool | None = None) -> Outcome:
    """Map an HTTP status (``None``: no answer) and the collector's ``"retry"`` verdict to what to do next.

    A collector's error body says ``"retry": true`` (back-pressure: the same batch may pass
    later) or ``false`` (refused for good); without it (an older collector, a proxy) the
    status decides: 5xx, 408 and 429 are retried, any other 4xx is final.
    """
    if status is not None and 200 <= status < 300:
        return Outcome.ACKED
    if status is not None and retry is not None:
        return Outcome.RETRY if retry else Outcome.REJECTED
    if status is None or status >= 500 or status in (408, 429):
        return Outcome.RETRY
    return Outcome.REJECTED


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """What one attempt got back: the status (``None``: no answer) and what the collector said."""

    status: int | None
    detail: str
    """The answer's body (at most :func:`answer_limit` bytes of it), or the connection error."""
    retry_after: float | None = None
    """Seconds the collector asked to wait (``Retry-After``), if it said."""

    @property
    def body(self) -> dict:
        """Return the JSON error body (``{"error", "retry", "message"}``), or ``{}`` when it is not one."""
        try:
            body = json.loads(self.detail)
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    @property
    def outcome(self) -> Outcome:
        """Return what the sender does with the batch after this answer."""
        retry = self.body.get("retry") if self.status is not None and self.status >= 300 else None
        return classify(self.status, retry if isinstance(retry, bool) else None)

    @property
    def reason(self) -> str:
        """Return the collector's own message when it gave one, else the status or the error."""
        message = self.body.get("message")
        if isinstance(message, str) and message:
            detail = self.body.get("detail")
            if isinstance(detail, list) and detail:
                message += ": " + "; ".join(str(line) for line in detail[:3])
            return message[:1000]
        if self.status is None:
            return self.detail
        return f"HTTP {self.status} {self.detail.strip()[:200]}".strip()


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

    def post(self, body: bytes, timeout: float) -> Answer:
        """Send ``body``; return the answer (status ``None``: no answer, with the error as ``detail``).

        Reads at most :func:`answer_limit` bytes of the answer's body.
        """
        reused = self._conn is not None
        limit = answer_limit(body)
        answer, timed_out = self._attempt(body, timeout, limit)
        if answer.status is None and reused and not timed_out:
            # The collector may have closed an idle kept-alive connection: that is not an outage.
            answer, _ = self._attempt(body, timeout, limit)
        return answer

    def _attempt(self, body: bytes, timeout: float, limit: int) -> tuple[Answer, bool]:
        """Make one request on the current (or a new) connection; also say whether it timed out."""
        try:
            conn = self._connection(timeout)
            conn.request("POST", self._path, body=body, headers=self._headers)
            response = conn.getresponse()
            detail = response.read(limit + 1)
            if len(detail) > limit or not response.isclosed() or response.will_close:
                self.close()  # longer than any answer of the protocol: drop it unread rather than drain it
            return Answer(response.status, detail[:limit].decode("utf-8", "replace"),
                          _seconds(response.getheader("Retry-After"))), False
        except TimeoutError as exc:
            self.close()
            return Answer(None, f"no answer within {timeout:.3g} s ({exc})"), True
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return Answer(None, f"{type(exc).__name__}: {exc}"), False

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


def _seconds(header: str | None) -> float | None:
    """Parse a ``Retry-After`` of whole seconds (an HTTP date, rare from a collector, is ignored)."""
    if header is None or not header.strip().isdigit():
        return None
    return float(header.strip())
