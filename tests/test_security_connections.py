"""Connections that never complete a request, against real collector processes: closed within a bounded
time, few per client address, and never so many that a new agent finds no room.

Each client identity is a loopback address of its own (all of 127.0.0.0/8 is loopback on Linux).
"""

from __future__ import annotations

import http.client
import socket

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value

pytestmark = pytest.mark.timeout(120)

PER_CLIENT = 8


def _connect(port: int, address: str, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(address, 0))
    if send:
        sock.sendall(send)
    return sock


def _closed_by_collector(sock: socket.socket) -> bool:
    """Wait (up to 30 s) for the collector to close ``sock``; True if it did, having sent nothing."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def _agent_is_served(url: str, address: str = "127.0.0.2", run: str = "agent") -> bool:
    with httpx.Client(base_url=url, timeout=30, transport=httpx.HTTPTransport(local_address=address)) as agent:
        return agent.post("/v1/ingest", json=make_batch(run=run)).json() == APPLIED


@pytest.mark.slow
def test_connections_that_never_complete_a_request_are_closed_and_one_address_holds_few(tmp_path):
    args = ["--header-timeout", "1", "--body-timeout", "2", "--max-client-connections", str(PER_CLIENT)]
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=args) as collector:
        port = collector.port
        idle = [_connect(port, "127.0.0.3") for _ in range(20)]
        half_line = [_connect(port, "127.0.0.4", b"GET /heal") for _ in range(5)]
        slow_body = _connect(port, "127.0.0.5", b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=("127.0.0.6", 0))
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() == b'{"status":"ok"}'
        kept.sock.sendall(b"GET /heal")  # half of a second request on a kept-alive connection
        assert _agent_is_served(collector.url)
        for sock in [*idle, *half_line, slow_body, kept.sock]:
            assert _closed_by_collector(sock)
        # Their address holds no connection now: a new one is served.
        assert _agent_is_served(collector.url, "127.0.0.3", run="after")
        with httpx.Client(base_url=collector.url, timeout=30) as client:
            text = client.get("/metrics").text
    refused = {reason: value(text, "ampwatch_collector_refused_requests_total", reason=reason)
               for reason in ("client_connections", "request_timeout")}
    assert refused == {"client_connections": 20 - PER_CLIENT, "request_timeout": PER_CLIENT + 5 + 1 + 1}, refused


@pytest.mark.slow
def test_idle_connections_from_one_address_or_many_never_leave_a_new_agent_without_room(tmp_path):
    # 256 open files: idle connections may hold half of them; past that the oldest idle one is closed.
    args = ["--max-client-connections", "0"]
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=args, open_files=256) as collector:
        idle = [_connect(collector.port, f"127.0.1.{i % 4 + 1}") for i in range(400)]
        try:
            assert _agent_is_served(collector.url)
            with httpx.Client(base_url=collector.url, timeout=30) as client:
                text = client.get("/metrics").text
            closed = {reason: value(text, "ampwatch_collector_refused_requests_total", reason=reason)
                      for reason in ("idle_evicted", "request_timeout")}
            assert sum(closed.values()) >= 400 - 128 and closed["idle_evicted"] > 0, closed
        finally:
            for sock in idle:
                sock.close()


HEADERS_ONLY = (b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")


@pytest.mark.slow
def test_connections_that_sent_headers_and_no_body_count_among_the_idle_and_never_leave_a_new_agent_without_room(
        tmp_path):
    # 256 open files, the defaults otherwise (4,096 connections per address, bodies within 60 s): connections that
    # sent a request's headers but no body held a file each until the body timeout, so one address took them all.
    # The second 200 come after a request completed on a kept-alive connection (headers whole in one read).
    with CollectorProcess(str(tmp_path / "ampwatch.db"), open_files=256) as collector:
        fresh = [_connect(collector.port, "127.0.0.3", HEADERS_ONLY) for _ in range(200)]
        reused = []
        for _ in range(200):  # each a new connection, so each must find room
            kept = http.client.HTTPConnection("127.0.0.1", collector.port, timeout=60, source_address=("127.0.0.4", 0))
            try:
                kept.request("GET", "/healthz")
                assert kept.getresponse().read() == b'{"status":"ok"}'
            except OSError:  # no file left for it: reset
                break
            kept.sock.sendall(HEADERS_ONLY)
            reused.append(kept.sock)
        try:
            assert len(reused) == 200, f"a new connection found no room after {len(fresh) + len(reused)}"
            assert _agent_is_served(collector.url)
            with httpx.Client(base_url=collector.url, timeout=30) as client:
                text = client.get("/metrics").text
            evicted = value(text, "ampwatch_collector_refused_requests_total", reason="idle_evicted")
            assert evicted >= 400 - 128, evicted  # the cap: half the open files wait for headers or a body
            assert sum(_closed_by_collector(sock) for sock in fresh[:100] + reused[:50]) == 150, \
                "the oldest waiting for a body are the first closed"
        finally:
            for sock in fresh + reused:
                sock.close()
