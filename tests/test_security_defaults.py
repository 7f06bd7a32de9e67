"""Secure by default (issue 15): what a web page or a careless deployment could do to a collector, refused.

In-process tests drive the real app through Starlette's TestClient; the start-up and token-file
tests run the real ``ampwatch-server`` command (on 127.0.0.1 only: a refused start binds nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
from fastapi.testclient import TestClient  # noqa: E402

from ampwatch.server import ServerConfig, create_app  # noqa: E402
from ampwatch.server.__main__ import build_parser  # noqa: E402
from ampwatch.server._config import config_from_args  # noqa: E402
from ampwatch_support.batches import APPLIED, make_batch, optimizer  # noqa: E402
from ampwatch_support.collector_process import CollectorProcess  # noqa: E402

pytestmark = pytest.mark.timeout(90)

TOKEN = "ingest-Secret-0c4e1b"
JSON = {"Content-Type": "application/json"}


def _app(tmp_path, **overrides) -> TestClient:
    return TestClient(create_app(ServerConfig(db=str(tmp_path / "ampwatch.db"), allowed_hosts=("testserver",),
                                              **overrides)))


def _runs(client: TestClient) -> list:
    return client.get("/v1/runs").json()["runs"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_a_web_page_could_post_without_a_preflight_is_refused_and_changes_nothing(tmp_path, content_type):
    import json

    body = json.dumps(make_batch(optimizers={"gen": optimizer(steps=3)})).encode()  # a valid batch, even
    headers = {"Content-Type": content_type} if content_type else {}
    with _app(tmp_path) as client:
        answer = client.post("/v1/ingest", content=body, headers=headers)
        assert answer.status_code == 415, answer.text
        assert "application/json" in answer.json()["message"] and answer.json()["retry"] is False
        assert _runs(client) == []
        assert client.post("/v1/ingest", content=body, headers={"Content-Type": "application/json; charset=utf-8"}
                           ).json() == APPLIED


def test_a_post_from_a_page_of_another_origin_is_refused_and_the_collectors_own_origin_is_not(tmp_path):
    batch = make_batch(optimizers={"gen": optimizer(steps=3)})
    with _app(tmp_path) as client:  # TestClient sends Host: testserver
        for origin in ("http://evil.example", "https://testserver.evil.example", "null"):
            answer = client.post("/v1/ingest", json=batch, headers={"Origin": origin})
            assert answer.status_code == 403 and "origin" in answer.json()["message"], origin
        assert _runs(client) == []
        assert client.post("/v1/ingest", json=batch, headers={"Origin": "http://testserver"}).status_code == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive_for_ingest_and_reads(tmp_path, scheme):
    with _app(tmp_path, token=TOKEN, read_token="read-" + TOKEN) as client:
        batch = make_batch(optimizers={"gen": optimizer(steps=3)})
        assert client.post("/v1/ingest", json=batch, headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200
        assert client.get("/metrics", headers={"Authorization": f"{scheme} read-{TOKEN}"}).status_code == 200
        assert client.get("/metrics", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 403


def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_SERVER_")}
    return subprocess.run([sys.executable, "-m", "ampwatch.server", "--db", str(tmp_path / "a.db"), *args],
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "collector.example"])
def test_listening_beyond_loopback_without_a_token_refuses_to_start_and_names_the_fix(tmp_path, host):
    done = _serve(tmp_path, "--host", host)
    assert done.returncode == 2
    assert "--token-file" in done.stderr and "--insecure" in done.stderr and "AMPWATCH_TOKEN" in done.stderr


def test_a_token_or_insecure_lets_a_non_loopback_address_through_and_loopback_needs_neither(tmp_path):
    parse = lambda *argv: config_from_args(build_parser().parse_args(["--db", str(tmp_path / "a.db"), *argv]))  # noqa: E731
    assert parse("--host", "0.0.0.0", "--token", TOKEN).token == TOKEN
    assert parse("--host", "0.0.0.0", "--insecure").insecure is True
    for loopback in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"):
        assert parse("--host", loopback).token is None


def test_tokens_and_webhook_urls_come_from_files_and_never_show_on_the_command_line(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "read").write_text("  read-" + TOKEN + "  \n")
    (tmp_path / "hooks").write_text("webhook:http://127.0.0.1:9/secret-path\n")
    args = ["--token-file", str(tmp_path / "token"), "--read-token-file", str(tmp_path / "read"),
            "--webhook-file", str(tmp_path / "hooks")]
    config = config_from_args(build_parser().parse_args(["--db", str(tmp_path / "a.db"), *args]))
    assert (config.token, config.read_token) == (TOKEN, "read-" + TOKEN)
    assert [t.url for t in config.webhook] == ["http://127.0.0.1:9/secret-path"]
    assert TOKEN not in repr(config)
    with CollectorProcess(str(tmp_path / "c.db"), args=args) as collector:
        cmdline = open(f"/proc/{collector.proc.pid}/cmdline", "rb").read().decode()
        assert TOKEN not in cmdline and "secret-path" not in cmdline
        import httpx
        with httpx.Client(base_url=collector.url, timeout=10) as client:
            batch = make_batch(optimizers={"gen": optimizer(steps=3)})
            assert client.post("/v1/ingest", json=batch).status_code == 401
            assert client.post("/v1/ingest", json=batch,
                               headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
            assert client.get("/metrics", headers={"Authorization": f"Bearer read-{TOKEN}"}).status_code == 200


@pytest.mark.parametrize("problem, args, says", [
    ("both", ["--token", "x", "--token-file", "{tmp}/token"], "not both"),
    ("missing", ["--token-file", "{tmp}/nowhere"], "cannot be read"),
    ("empty", ["--read-token-file", "{tmp}/empty"], "is empty"),
    ("not yes/no", ["--insecure"], None),
])
def test_bad_secret_files_and_flags_say_what_is_wrong(tmp_path, monkeypatch, problem, args, says):
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "empty").write_text("\n")
    argv = ["--db", str(tmp_path / "a.db"), *(a.format(tmp=tmp_path) for a in args)]
    if says is None:  # the variable form of a flag takes yes/no words only
        monkeypatch.setenv("AMPWATCH_SERVER_INSECURE", "maybe")
        with pytest.raises(ValueError, match="AMPWATCH_SERVER_INSECURE='maybe' is not a yes/no value"):
            config_from_args(build_parser().parse_args(argv[:2]))
        return
    with pytest.raises(ValueError, match=says):
        config_from_args(build_parser().parse_args(argv))
