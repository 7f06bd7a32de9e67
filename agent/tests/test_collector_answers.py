"""Whatever answers at the collector's address, the agent reads at most what the protocol needs of it.

A real HTTP server on a free loopback port answers every ingest with a 400 MiB body (with a
``Content-Length``, chunked, or until it closes): the agent keeps a few KiB, drops the
connection instead of draining it, and never holds the rest in the training process.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import tracemalloc

import pytest

from ampwatch.agent._http import ANSWER_BYTES, RESULT_BYTES, IngestClient, Outcome, answer_limit
from ampwatch.contract.node_batch import encode_node_batch
from ampwatch_support.ports import LoopbackServer

HUGE = 400 << 20
CHUNK = 1 << 16


class HugeAnswers(LoopbackServer):
    """Answers each POST with ``status`` and ``body`` (default ``HUGE`` bytes) framed as ``framing``; counts sends."""

    def __init__(self, framing: str, status: int = 200, body: bytes | None = None) -> None:
        super().__init__()
        self.framing, self.status, self.body = framing, status, body
        self.size = HUGE if body is None else len(body)
        self.sent: list[int] = []  # bytes of body each answer got out before the client went away
        self.done = threading.Condition()

    def start(self) -> HugeAnswers:
        self._serve(_handler_for(self))
        return self

    def stop(self) -> None:
        self._shut_down()

    def wait_for_answers(self, count: int, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.done:
            while len(self.sent) < count:
                if not self.done.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True


def _handler_for(server: HugeAnswers) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(server.status)
            self.send_header("Content-Type", "application/json")
            if server.framing == "content-length":
                self.send_header("Content-Length", str(server.size))
            elif server.framing == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            sent, chunk = 0, b'{"message": "' + b"x" * CHUNK
            try:
                while sent < server.size:
                    piece = server.body if server.body is not None else chunk[:server.size - sent]
                    if server.framing == "chunked":
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    else:
                        self.wfile.write(piece)
                    sent += len(piece)
                if server.framing == "chunked":
                    self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the agent dropped the connection: what it did not read was never sent
                self.close_connection = True
            if server.framing == "until-close":
                self.close_connection = True
            with server.done:
                server.sent.append(sent)
                server.done.notify_all()

        def log_message(self, *args: object) -> None:
            """Keep test output quiet."""

    return Handler


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
def test_a_400_mib_answer_is_read_only_as_far_as_the_protocol_needs_and_its_connection_dropped(framing):
    with HugeAnswers(framing) as server:
        client = IngestClient(server.url, None)
        tracemalloc.start()
        try:
            answer = client.post(b'{"protocol": 1}', timeout=30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert answer.status == 200 and answer.outcome is Outcome.ACKED
        assert len(answer.detail) == ANSWER_BYTES
        assert peak < 4 * ANSWER_BYTES + (1 << 20), f"reading the answer allocated {peak / 2**20:.1f} MiB"
        assert client._conn is None, "a connection with an unread answer was kept for the next batch"
        assert server.wait_for_answers(1)
        # Loopback socket buffers hold a few MiB; the rest was never sent because nobody read it.
        assert server.sent[0] < 64 << 20, f"the agent read {server.sent[0] / 2**20:.0f} MiB of the answer"


def test_a_huge_refusal_is_still_retried_and_an_answer_of_the_protocols_size_keeps_the_connection():
    with HugeAnswers("content-length", status=503) as server:
        client = IngestClient(server.url, None)
        answer = client.post(b"{}", timeout=30)
        assert answer.outcome is Outcome.RETRY and len(answer.reason) < 300
        assert client._conn is None
    results = [{"status": 422, "error": "schema", "retry": False, "rank": rank,
                "message": "m" * (RESULT_BYTES - 200)} for rank in range(64)]
    whole = json.dumps({"protocol": 2, "results": results}).encode()
    relayed = encode_node_batch([b'{"protocol":1,"rank":%d}' % rank for rank in range(64)])
    assert answer_limit(b'{"protocol":1}') == ANSWER_BYTES < len(whole) <= answer_limit(relayed)
    with HugeAnswers("content-length", body=whole) as server:  # a relay's v2 answer: 64 long refusals
        client = IngestClient(server.url, None)
        answer = client.post(relayed, timeout=30)
        assert answer.detail.encode() == whole and client._conn is not None
