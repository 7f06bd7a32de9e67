"""What an ingest request is refused with, and the answer to a request (or one rank's batch) that failed."""

from __future__ import annotations

import logging
import sqlite3

from ._metrics import SelfMetrics
from ._store import StoreClosed

__all__ = ["Refused", "failure_answer", "refuse_browsers"]

log = logging.getLogger("ampwatch.server")


class Refused(Exception):
    """A refusal: its status, reason label, message, and whether the very same batch may pass later."""

    def __init__(self, status: int, reason: str, message: str, detail: list[str] | None = None, *,
                 retry: bool = False, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.detail = status, reason, message, detail
        self.retry, self.retry_after = retry, retry_after


def refuse_browsers(headers: dict[bytes, bytes]) -> None:
    """Refuse what a web page could send: a non-JSON body, or a request from a page of another origin.

    A page may POST ``text/plain`` or form data anywhere without a CORS preflight
    (a "simple request"), so any site a user opens could write into a collector on
    their machine. Agents send ``application/json`` and no ``Origin``; browsers
    always send ``Origin`` on cross-site POSTs.
    """
    content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if content_type != b"application/json":
        raise Refused(415, "content_type", "ingest takes only 'Content-Type: application/json' (what ampwatch "
                                           f"agents send), not {content_type.decode('latin-1')[:64]!r}")
    origin = headers.get(b"origin")
    if origin is not None:
        host = headers.get(b"host", b"")
        if origin.split(b"://", 1)[-1].rstrip(b"/").lower() != host.lower():
            raise Refused(403, "origin", "ingest refuses requests from web pages of another origin "
                                         f"({origin.decode('latin-1')[:128]}); agents send no Origin header")


def failure_answer(exc: Exception, own: SelfMetrics) -> tuple[int, dict, int | None]:
    """Return the status, error body and Retry-After for a request (v1) or one rank's batch (v2) that failed."""
    if isinstance(exc, Refused):
        own.rejected.labels(exc.reason).inc()
        body = {"error": exc.reason, "retry": exc.retry, "message": exc.message}
        if exc.detail:
            body["detail"] = exc.detail
        return exc.status, body, exc.retry_after
    if isinstance(exc, StoreClosed):
        return 503, {"error": "unavailable", "retry": True, "message": f"{exc}; retry later"}, None
    if isinstance(exc, sqlite3.DatabaseError):  # disk full, read-only, I/O error: logged once by the store
        return 503, {"error": "storage", "retry": True,
                     "message": f"the collector cannot write its database ({exc}); the batch is not "
                     "applied: retry later. Operator: free disk space or make the database writable "
                     "(see the collector's log)"}, None
    log.error("ingest failed", exc_info=exc)
    return 500, {"error": "internal", "retry": True,
                 "message": "the collector failed to store the batch; retry later and check the "
                            "collector's log"}, None
