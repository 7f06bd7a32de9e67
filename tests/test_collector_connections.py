"""The collector keeps an agent's connection open between heartbeats, and has room for every rank's.

An agent sends its cumulative state every AMPWATCH_PUSH_INTERVAL (15 s) when nothing happens. uvicorn
closes a kept-alive connection idle for 5 s by default, so every heartbeat used to open a new connection
(at 16,384 ranks a quarter of the collector's CPU). Tested on a real collector process.
"""

from __future__ import annotations

import http.client
import resource
import socket
import time

import pytest

from ampwatch_support.collector_process import CollectorProcess

UVICORN_DEFAULT_KEEP_ALIVE_S = 5


def _get(conn: http.client.HTTPConnection, path: str = "/healthz") -> int:
    conn.request("GET", path)
    answer = conn.getresponse()
    answer.read()
    return answer.status


def test_a_connection_idle_longer_than_uvicorns_default_is_reused_for_the_next_batch(tmp_path):
    with CollectorProcess(str(tmp_path / "c.db")) as collector:
        conn = http.client.HTTPConnection("127.0.0.1", collector.port, timeout=10)
        assert _get(conn) == 200
        sock = conn.sock
        time.sleep(UVICORN_DEFAULT_KEEP_ALIVE_S + 2)
        # Still open: a closed one reads as EOF (b"") without blocking.
        sock.setblocking(False)
        try:
            assert sock.recv(1) == b"", "the collector sent bytes unasked"
            raise AssertionError("the collector closed a connection idle for 7 s")
        except BlockingIOError:
            pass  # nothing to read and not closed: still open
        sock.setblocking(True)
        sock.settimeout(10)
        assert _get(conn) == 200
        assert conn.sock is sock  # the same connection carried the second request
        conn.close()


def test_keep_alive_option_closes_connections_idle_for_longer(tmp_path):
    with CollectorProcess(str(tmp_path / "c.db"), args=["--keep-alive", "1"]) as collector:
        conn = http.client.HTTPConnection("127.0.0.1", collector.port, timeout=10)
        assert _get(conn) == 200
        conn.sock.settimeout(30)
        assert conn.sock.recv(1) == b""  # the collector closed it (after about 1 s)
        conn.close()


def test_collector_raises_its_open_file_limit_to_the_hard_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # inherited by the collector process
    try:
        collector = CollectorProcess(str(tmp_path / "c.db")).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with open(f"/proc/{collector.proc.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        collector_soft, collector_hard = line.split()[3:5]
        assert int(collector_soft) == int(collector_hard) == hard, line
    finally:
        collector.kill()


def test_connections_beyond_a_thousand_are_all_answered(tmp_path):
    """1,100 ranks each holding a connection: more than a 1,024 soft limit would let the collector accept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2400:
        pytest.skip(f"this machine's hard open-file limit ({hard}) leaves no room for the test's own sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        collector = CollectorProcess(str(tmp_path / "c.db")).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    socks: list[socket.socket] = []
    try:
        try:
            for _ in range(1100):
                s = socket.create_connection(("127.0.0.1", collector.port), timeout=30)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                socks.append(s)
            answered = 0
            for s in socks:
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    answered += 1
            assert answered == len(socks)
        finally:
            for s in socks:
                s.close()
    finally:
        collector.kill()
