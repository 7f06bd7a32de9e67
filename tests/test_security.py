"""Security of the collector: ingest and read tokens, no CORS, per-client rate limit, body limit, TLS, no secret in
a log.

In-process tests drive the real app through Starlette's TestClient (real ASGI, real SQLite); the
TLS, logging and body-limit tests run a real collector process on a free loopback port.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import socket
import ssl
import subprocess
import sys
import warnings

import httpx
import pytest

warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
from fastapi.testclient import TestClient  # noqa: E402

from ampwatch.agent._config import AgentConfig  # noqa: E402
from ampwatch.server import ServerConfig, create_app  # noqa: E402
from ampwatch.server._access import RateLimiter  # noqa: E402
from ampwatch_support.batches import APPLIED, make_batch, optimizer  # noqa: E402
from ampwatch_support.collector_process import CollectorProcess  # noqa: E402
from ampwatch_support.delivery_harness import make_sender  # noqa: E402
from ampwatch_support.exposition import value  # noqa: E402

pytestmark = pytest.mark.timeout(90)

INGEST_TOKEN = "ingest-Secret-7f3a9c"
READ_TOKEN = "read-Secret-51be2d"


def _app(tmp_path, **overrides) -> TestClient:
    return TestClient(create_app(ServerConfig(db=str(tmp_path / "ampwatch.db"), allowed_hosts=("testserver",),
                                              **overrides)))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_ingest_without_a_token_gets_401_a_wrong_one_403_and_neither_changes_anything(tmp_path):
    with _app(tmp_path, token=INGEST_TOKEN) as client:
        batch = make_batch(optimizers={"gen": optimizer(steps=3)})
        missing = client.post("/v1/ingest", json=batch)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert "AMPWATCH_TOKEN" in missing.json()["message"]
        # A prefix, an extension, another scheme and a different case are all wrong: the compare is exact.
        for wrong in (f"Bearer {INGEST_TOKEN[:-1]}", f"Bearer {INGEST_TOKEN}x", f"Basic {INGEST_TOKEN}",
                      f"Bearer {INGEST_TOKEN.upper()}", "Bearer "):
            answer = client.post("/v1/ingest", json=batch, headers={"Authorization": wrong})
            assert answer.status_code == 403, wrong
            assert "AMPWATCH_SERVER_TOKEN" in answer.json()["message"]
        assert client.get("/v1/runs").json()["runs"] == []
        assert client.post("/v1/ingest", json=batch, headers=_bearer(INGEST_TOKEN)).json() == APPLIED
        text = client.get("/metrics").text
        assert value(text, "ampwatch_collector_rejected_batches_total", reason="auth") == 6
        assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 3


def test_the_ingest_token_is_compared_in_constant_time():
    # hmac.compare_digest takes the same time wherever the first differing byte is: read the code path.
    import inspect

    from ampwatch.server import _access, _ingest
    # Both tokens go through one comparison, and that comparison is hmac.compare_digest.
    assert "hmac.compare_digest(" in inspect.getsource(_access.bearer_matches)
    assert "bearer_matches(given, self.config.token)" in inspect.getsource(_ingest.IngestService._authenticate)
    assert "bearer_matches(given, self._read_token)" in inspect.getsource(_access.AccessGuard.refusal)


def test_with_a_read_token_metrics_and_the_query_api_need_it_but_health_and_ingest_do_not(tmp_path):
    with _app(tmp_path, read_token=READ_TOKEN) as client:
        assert client.post("/v1/ingest", json=make_batch()).status_code == 200  # ingest has its own token
        for path in ("/metrics", "/v1/runs", "/v1/runs/exp-42", "/v1/runs/exp-42/events", "/v1/alerts"):
            missing = client.get(path)
            assert missing.status_code == 401, path
            assert "read token" in missing.json()["message"] and missing.headers["www-authenticate"] == "Bearer"
            assert client.get(path, headers=_bearer("nope")).status_code == 403, path
            assert client.get(path, headers=_bearer(READ_TOKEN)).status_code == 200, path
        for path in ("/healthz", "/readyz", "/"):
            assert client.get(path).status_code == 200, path
        text = client.get("/metrics", headers=_bearer(READ_TOKEN)).text
        assert value(text, "ampwatch_collector_refused_requests_total", reason="read_auth") == 10


def test_reading_is_open_without_a_read_token(tmp_path):
    with _app(tmp_path) as client:
        assert client.get("/metrics").status_code == 200 and client.get("/v1/runs").status_code == 200


def test_cors_is_off_no_origin_is_ever_allowed(tmp_path):
    with _app(tmp_path) as client:
        client.post("/v1/ingest", json=make_batch())
        evil = {"Origin": "https://evil.example"}
        for path in ("/metrics", "/v1/runs", "/v1/runs/exp-42", "/"):
            answer = client.get(path, headers=evil)
            assert answer.status_code == 200
            assert not any(h.startswith("access-control-") for h in answer.headers), (path, answer.headers)
        preflight = client.options("/v1/ingest", headers={**evil, "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code >= 400
        assert not any(h.startswith("access-control-") for h in preflight.headers)
        # A browser's cross-site form post (text/plain) is not JSON of the protocol: refused, nothing applied.
        sneaky = client.post("/v1/ingest", content=b"protocol=1", headers={**evil, "Content-Type": "text/plain"})
        assert sneaky.status_code == 415  # refused before it is read (issue 15); was 400, refused as bad JSON


def test_a_client_over_the_rate_limit_gets_429_with_retry_after_and_other_clients_are_unaffected(tmp_path):
    app = create_app(ServerConfig(db=str(tmp_path / "ampwatch.db"), rate_limit=5, allowed_hosts=("testserver",)))
    now = [0.0]  # the limiter's clock, driven here: a loaded machine must not refill the bucket mid-test
    app.state.guard.limiter.clock = lambda: now[0]
    with TestClient(app) as flooder:
        answers = [flooder.get("/healthz").status_code for _ in range(30)]
        assert answers == [200] * 10 + [429] * 20  # the burst: twice the rate, then nothing until time passes
        refused = flooder.get("/healthz")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "--rate-limit" in refused.json()["message"]
        refused_ingest = flooder.post("/v1/ingest", json=make_batch())
        assert refused_ingest.status_code == 429  # back-pressure: the agent retries with backoff, nothing lost
        assert refused_ingest.json()["retry"] is True

        async def from_elsewhere() -> int:
            transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as other:
                return (await other.get("/healthz")).status_code
        import asyncio
        assert asyncio.run(from_elsewhere()) == 200
        now[0] += 0.5  # 5 per second: two tokens came back
        assert flooder.get("/healthz").status_code == 200


def test_the_rate_limiter_refills_at_its_rate_and_keeps_a_bounded_number_of_clients():
    now = [0.0]
    limiter = RateLimiter(rate=2.0, max_clients=100, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(5)] == [True] * 4 + [False]
    now[0] += 1.0
    assert [limiter.allow("a") for _ in range(3)] == [True, True, False]
    for i in range(10_000):  # a flood of distinct addresses
        now[0] += 0.001
        limiter.allow(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) <= 100


def _openssl_cert(tmp_path) -> tuple[str, str]:
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class _TlsCollector(CollectorProcess):
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@pytest.mark.slow
def test_over_tls_the_real_agent_delivers_and_plain_http_gets_no_answer(tmp_path, monkeypatch):
    cert, key = _openssl_cert(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # trust the test's own CA, here and in the agent's default context
    with _TlsCollector(str(tmp_path / "ampwatch.db"), args=["--ssl-certfile", cert, "--ssl-keyfile", key,
                                                            "--token", INGEST_TOKEN,
                                                            "--log-level", "info"]) as collector:
        sender, recorder = make_sender(collector.url, run="tls-run", token=INGEST_TOKEN)
        try:
            for _ in range(3):
                recorder.skip()
            sender.close(10)
        finally:
            sender.close(1)
        assert sender.batches_acked >= 1 and sender.rejected_batches == 0 and sender.send_failures == 0
        context = ssl.create_default_context(cafile=cert)
        conn = http.client.HTTPSConnection("127.0.0.1", collector.port, context=context, timeout=10)
        conn.request("GET", "/v1/runs/tls-run/events")
        assert [e["id"] for e in json.loads(conn.getresponse().read())["events"]] == [1, 2, 3]
        conn.close()
        plain = http.client.HTTPConnection("127.0.0.1", collector.port, timeout=5)
        try:
            plain.request("GET", "/healthz")
            status = plain.getresponse().status
        except (http.client.HTTPException, OSError):
            status = None  # the TLS port drops a plain-HTTP client
        finally:
            plain.close()
        assert status != 200, "plain HTTP must never reach the API on a TLS port"
    assert "https://" in open(collector.log_path).read()


@pytest.mark.slow
def test_tokens_never_appear_in_the_collector_log_or_the_agents(tmp_path, caplog):
    collector = CollectorProcess(str(tmp_path / "ampwatch.db"),
                                 args=["--token", INGEST_TOKEN, "--read-token", READ_TOKEN])
    collector.args += ["--log-level", "debug"]  # the most the collector ever says
    wrong = "wrong-Secret-0d0d0d"
    with collector:
        with httpx.Client(base_url=collector.url, timeout=10) as client:
            batch = make_batch()
            assert client.post("/v1/ingest", json=batch, headers=_bearer(wrong)).status_code == 403
            assert client.post("/v1/ingest", json=batch, headers=_bearer(INGEST_TOKEN)).status_code == 200
            assert client.post("/v1/ingest", content=b"{",
                               headers={**_bearer(INGEST_TOKEN), "Content-Type": "application/json"}).status_code == 400
            assert client.get("/metrics", headers=_bearer(wrong)).status_code == 403
            assert client.get("/metrics", headers=_bearer(READ_TOKEN)).status_code == 200
            assert client.get("/v1/runs/nope", headers=_bearer(READ_TOKEN)).status_code == 404
        # The agent with a wrong token: refused, logged once, counted; the token is not in what it says.
        with caplog.at_level(logging.DEBUG, logger="ampwatch"):
            sender, recorder = make_sender(collector.url, token=wrong)
            try:
                recorder.skip()
                sender.close(5)
            finally:
                sender.close(1)
        assert sender.rejected_batches >= 1
        collector.kill(signal.SIGTERM)
    log = open(collector.log_path).read()
    assert "ampwatch collector listening" in log  # the log was really captured
    assert "refused batch" in caplog.text
    for secret in (INGEST_TOKEN, READ_TOKEN, wrong):
        assert secret not in log and secret not in caplog.text
    # Nor in a config printed by mistake, or a refused start's error message.
    assert INGEST_TOKEN not in repr(ServerConfig(token=INGEST_TOKEN, read_token=INGEST_TOKEN))
    assert INGEST_TOKEN not in repr(AgentConfig.from_env(collector="http://h:1", token=INGEST_TOKEN, environ={}))
    refused = subprocess.run([sys.executable, "-m", "ampwatch.server", "--token", INGEST_TOKEN, "--max-runs", "0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and INGEST_TOKEN not in refused.stderr + refused.stdout


def _raw_request(port: int, head: bytes, chunks: list[bytes], read_timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:
            pass  # the collector answered and closed before we finished: that is the point
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
        return data


@pytest.mark.slow
def test_bodies_over_the_limit_are_refused_with_413_declared_or_streamed_and_the_collector_stays_up(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--max-body-bytes", "65536"]) as collector:
        # A declared length over the limit: refused before a byte of the body is read.
        declared = _raw_request(collector.port, b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                b"application/json\r\nContent-Length: 1000000000\r\n\r\n", [])
        assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
        # Chunked, no length: refused once the running total passes the limit.
        chunk = b"x" * 16384
        streamed = _raw_request(collector.port, b"POST /v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                                [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 64 + [b"0\r\n\r\n"])
        assert streamed.startswith(b"HTTP/1.1 413"), streamed[:200]
        with httpx.Client(base_url=collector.url, timeout=10) as client:
            assert client.post("/v1/ingest", json=make_batch()).status_code == 200
            text = client.get("/metrics").text
        assert value(text, "ampwatch_collector_rejected_batches_total", reason="too_large") == 2
        assert collector.proc.poll() is None
