"""Who the collector answers to, against one real collector process: the names it serves (a web page that
rebinds its own name to the collector gets nothing), forwarded headers believed only from the proxies named,
and its database folder and files kept to its own user.

A second client address is a second loopback address (all of 127.0.0.0/8 is loopback on Linux).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value

pytestmark = pytest.mark.timeout(120)

PROXY = "127.0.0.7"  # the one address named by --forwarded-allow-ips


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    db = root / "data" / "ampwatch" / "ampwatch.db"  # neither folder exists: the collector makes them
    args = ["--client-new-runs", "3", "--allowed-hosts", "collector, .svc.example", "--forwarded-allow-ips", PROXY]
    umask = os.umask(0o022)  # the usual one, under which files are created readable by everyone
    try:
        running = CollectorProcess(str(db), args=args, log_path=str(root / "collector.log")).start()
    finally:
        os.umask(umask)
    yield running
    running.kill()


def _client(collector, address: str = "127.0.0.2") -> httpx.Client:
    return httpx.Client(base_url=collector.url, timeout=30, transport=httpx.HTTPTransport(local_address=address))


def test_a_page_whose_name_is_rebound_to_the_collector_can_neither_write_nor_read(collector):
    rebound = f"attacker.example:{collector.port}"
    page = {"Host": rebound, "Origin": f"http://{rebound}"}  # what the browser sends for the page's own origin
    with _client(collector) as client:
        write = client.post("/v1/ingest", json=make_batch(run="rebound"), headers=page)
        assert write.status_code == 421 and write.json()["error"] == "host", write.text
        assert "--allowed-hosts" in write.json()["message"] and "attacker.example" in write.json()["message"]
        for path in ("/v1/runs", "/v1/runs/rebound", "/metrics", "/v1/alerts", "/", "/healthz"):
            assert client.get(path, headers=page).status_code == 421, path
        # The names it serves: loopback names and addresses, and those it was given.
        for host in ("127.0.0.1", "localhost", "LOCALHOST.", "[::1]", "ampwatch.localhost", "collector",
                     "svc.example", "ampwatch-0.svc.example"):
            assert client.get("/healthz", headers={"Host": f"{host}:{collector.port}"}).status_code == 200, host
        for host in ("collector.attacker.example", "svc.example.attacker.example", "10.1.2.3", "0.0.0.0"):
            assert client.get("/healthz", headers={"Host": host}).status_code == 421, host
        # A served name with another site's Origin is still a cross-site write.
        foreign = client.post("/v1/ingest", json=make_batch(run="rebound"),
                              headers={"Origin": f"http://attacker.example:{collector.port}"})
        assert foreign.status_code == 403 and foreign.json()["error"] == "origin"
        assert client.get("/v1/runs/rebound").status_code == 404
        assert value(client.get("/metrics").text, "ampwatch_collector_refused_requests_total", reason="host") >= 9


def _raw(collector, request: bytes) -> tuple[int, dict]:
    """Send ``request`` as written (an HTTP client would merge repeated headers) and return the status and body;
    from an address of its own, so that its new runs take no other test's budget."""
    with socket.create_connection(("127.0.0.1", collector.port), timeout=30, source_address=("127.0.0.8", 0)) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.startswith(b"{") else {}


def _ingest_request(*headers: str, run: str) -> bytes:
    body = json.dumps(make_batch(run=run)).encode()
    lines = ["POST /v1/ingest HTTP/1.1", *headers, "Content-Type: application/json", f"Content-Length: {len(body)}",
             "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_a_request_with_two_host_headers_is_refused_whichever_comes_first(collector):
    # The allow-list read the first Host and the ingest's Origin check the last: a foreign page's write passed.
    served, foreign = f"127.0.0.1:{collector.port}", f"attacker.example:{collector.port}"
    for first, second in ((served, foreign), (foreign, served), (served, served)):
        status, body = _raw(collector, _ingest_request(f"Host: {first}", f"Host: {second}",
                                                       f"Origin: http://{foreign}", run="two-hosts"))
        assert status == 400 and body["error"] == "host" and body["retry"] is False, (first, second, body)
        assert "2 Host headers" in body["message"]
        status, _ = _raw(collector, f"GET /v1/runs HTTP/1.1\r\nHost: {first}\r\nHost: {second}\r\n"
                                    "Connection: close\r\n\r\n".encode())
        assert status == 400, (first, second)
    with _client(collector) as client:
        assert client.get("/v1/runs/two-hosts").status_code == 404
    # One Host, as every client sends it, is served as before.
    assert _raw(collector, _ingest_request(f"Host: {served}", run="one-host")) == (200, APPLIED)


@pytest.mark.parametrize("host", ["[::1]evil.example", "[::1]evil.example:80", "[localhost]", "[127.0.0.1]",
                                  "[::1]:", "[::1", "::1", "localhost:80:80", "localhost:8o"])
def test_a_host_that_is_no_name_or_bracketed_ipv6_address_with_a_port_is_not_served(collector, host):
    status, body = _raw(collector, _ingest_request(f"Host: {host}", run="bad-host"))
    assert status == 421 and body["error"] == "host", (host, body)


def test_bracketed_ipv6_loopback_in_any_spelling_is_served(collector):
    for host in ("[::1]", f"[::1]:{collector.port}", "[0:0:0:0:0:0:0:1]", f"[0::1]:{collector.port}"):
        status, _ = _raw(collector, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert status == 200, host


def test_forwarded_headers_are_believed_only_from_the_proxies_named(collector):
    # From 127.0.0.1 (uvicorn's default trusted it): a forwarded address per new run would dodge the budget.
    with _client(collector, "127.0.0.1") as local, _client(collector, PROXY) as proxy:
        local_answers = [local.post("/v1/ingest", json=make_batch(run=f"forwarded-{i}"),
                                    headers={"X-Forwarded-For": f"198.51.100.{i}"}) for i in range(5)]
        assert [a.status_code for a in local_answers] == [200] * 3 + [429] * 2
        assert "127.0.0.1" in local_answers[-1].json()["message"]
        # The proxy the operator named passes each agent's address on: each has its own budget.
        proxied = [proxy.post("/v1/ingest", json=make_batch(run=f"proxied-{i}"),
                              headers={"X-Forwarded-For": f"198.51.100.{i}"}) for i in range(5)]
        assert [a.status_code for a in proxied] == [200] * 5, [a.text for a in proxied]


def test_without_forwarded_allow_ips_a_local_client_is_budgeted_as_itself_whatever_it_forwards(tmp_path):
    # The fixture's collector names a proxy; this one names none, as a collector started with the defaults.
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--client-new-runs", "3"]) as bare, \
            _client(bare, "127.0.0.1") as local:
        answers = [local.post("/v1/ingest", json=make_batch(run=f"unproxied-{i}"),
                              headers={"X-Forwarded-For": f"198.51.100.{i}", "X-Forwarded-Proto": "https"})
                   for i in range(5)]
        assert [a.status_code for a in answers] == [200] * 3 + [429] * 2, [a.text for a in answers]
        assert "127.0.0.1" in answers[-1].json()["message"] and "198.51.100" not in answers[-1].json()["message"]


def test_the_collector_makes_its_data_folder_private_and_its_database_files_owner_only(collector):
    with _client(collector) as client:
        assert client.post("/v1/ingest", json=make_batch(run="files")).status_code == 200
    folder = os.path.dirname(collector.db)
    for path in (folder, os.path.dirname(folder)):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    for suffix in ("", "-wal", "-shm"):
        assert stat.S_IMODE(os.stat(collector.db + suffix).st_mode) == 0o600, suffix


def test_a_data_folder_it_cannot_make_is_refused_in_one_line_before_it_says_it_listens(tmp_path, monkeypatch,
                                                                                      capfd):
    from ampwatch.server.__main__ import main  # the command itself, in this process: it stops before serving

    for name in [n for n in os.environ if n.startswith("AMPWATCH_SERVER_")]:
        monkeypatch.delenv(name)
    (tmp_path / "not-a-folder").write_text("")
    db = tmp_path / "not-a-folder" / "data" / "ampwatch.db"
    assert main(["--db", str(db), "--port", "1"]) == 2
    out, err = capfd.readouterr()
    assert "listening" not in out + err
    (line,) = err.strip().splitlines()
    assert str(db) in line and "install -d -m 0700" in line and str(db.parent) in line, line


@pytest.mark.slow
def test_docker_compose_configures_the_collector_to_answer_to_the_name_prometheus_scrapes(tmp_path):
    import argparse
    import pathlib
    import re
    import shutil

    import yaml

    from ampwatch.server._config import add_arguments, config_from_args
    from ampwatch.server._hosts import HostAllowList

    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMPWATCH_", "GRAFANA_"))}

    def served(**environ: str) -> HostAllowList:
        """The names the collector serves as `docker compose up` would start it with ``environ``."""
        compose = subprocess.run([shutil.which("docker-compose") or "/usr/bin/docker-compose", "-f",
                                  "docker-compose.yml", "config"], cwd=repo,
                                 env=dict(env, AMPWATCH_TOKEN="compose-token", **environ),
                                 capture_output=True, text=True, timeout=60)
        assert compose.returncode == 0, compose.stderr
        environment = yaml.safe_load(compose.stdout)["services"]["collector"]["environment"]
        parser = argparse.ArgumentParser()
        add_arguments(parser, environ={k: str(v) for k, v in environment.items()})
        return HostAllowList.of(config_from_args(parser.parse_args(["--db", str(tmp_path / "a.db")])))

    hosts = served()
    targets = re.findall(r'"([\w.-]+):9457"', (repo / "deploy" / "prometheus.yml").read_text())
    assert targets == ["collector"] and all(hosts.serves(t) for t in targets)
    assert hosts.serves("192.0.2.10") and not hosts.serves("attacker.example")  # any address: it listens on all
    assert not hosts.serves("gpu-head.example")
    # The names agents use for the host, as the compose file's comment says.
    assert served(AMPWATCH_ALLOWED_HOSTS="gpu-head.example").serves("gpu-head.example")


def test_database_files_an_earlier_version_left_readable_by_others_are_made_owner_only(tmp_path):
    from ampwatch.server._store import prepare_database

    db = tmp_path / "ampwatch.db"
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"ampwatch.db{suffix}").write_bytes(b"")
        os.chmod(tmp_path / f"ampwatch.db{suffix}", 0o644)
    assert prepare_database(str(db)) == str(db)
    for suffix in ("", "-wal", "-shm"):
        assert stat.S_IMODE(os.stat(f"{db}{suffix}").st_mode) == 0o600, suffix


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o606, 0o620, 0o602], ids=oct)
def test_database_files_open_to_their_group_or_to_others_are_made_owner_only(tmp_path, mode):
    from ampwatch.server._store import prepare_database

    db = tmp_path / "ampwatch.db"
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"ampwatch.db{suffix}").write_bytes(b"")
        os.chmod(tmp_path / f"ampwatch.db{suffix}", mode)
    assert prepare_database(str(db)) == str(db)
    for suffix in ("", "-wal", "-shm"):
        assert stat.S_IMODE(os.stat(f"{db}{suffix}").st_mode) == 0o600, (oct(mode), suffix)
