"""The client side of the socket load generators: HTTP/1.1 by hand on asyncio streams, on the cheapest loop.

``bench._loadgen`` and ``bench.experiments._fleet_ranks`` each run thousands of simulated ranks in one process,
each with its own kept-alive connection and one request at a time, as an agent does. A client
library's cost per request would show up as the generator's lateness, so they write the request
and read the answer themselves, and run on uvloop where it is installed (the collector has it
too); what they share of that is here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["INGEST_HEAD", "read_answer", "request", "run_loop"]

_T = TypeVar("_T")

INGEST_HEAD = b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
"""A batch's request line and headers, but for its ``Content-Length`` (added by :func:`request`)."""


def request(head: bytes, body: bytes) -> bytes:
    """Return the whole request: ``head``, the length of ``body``, the blank line and ``body``."""
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """Read one HTTP answer: (status, bytes received, body).

    Raises ``ConnectionResetError`` when the server had closed the connection (a kept-alive one
    idle too long), ``asyncio.IncompleteReadError`` when it closes it mid-answer.
    """
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    status, received, length = int(line.split(b" ")[1]), len(line), 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        received += len(line)
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    body = await reader.readexactly(length) if length else b""
    return status, received + 2 + length, body


def run_loop(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to its end on uvloop when installed, else on asyncio's own loop; return its result.

    A cheaper loop keeps the generator's own cost out of what it measures.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
