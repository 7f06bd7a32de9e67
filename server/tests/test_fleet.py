"""GET /v1/runs with and without --peers: the answer without them unchanged, and what a peer's answer must be.

The fleet with real collectors (a replica down, one hung, the page): tests/test_fleet_view.py.
"""

from __future__ import annotations

import http.server
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch_support.batches import make_batch
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.ports import LoopbackServer

OWN = "http://127.0.0.1:9457"
READ_TOKEN = "fleet-unit-3c7a"


class Peer(LoopbackServer):
    """A loopback server answering every GET with one fixed status and body; it records each Authorization."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__()
        self.status, self.body, self.authorizations = status, body, []

    def start(self) -> Peer:
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                peer.authorizations.append((self.path, self.headers.get("Authorization")))
                self.send_response(peer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(peer.body)))
                self.end_headers()
                self.wfile.write(peer.body)

            def log_message(self, *args: object) -> None:
                pass

        self._serve(Handler)
        return self

    def stop(self) -> None:
        self._shut_down()


def test_without_peers_the_run_list_is_what_it_always_was(client):
    client.post("/v1/ingest", json=make_batch(run="exp-1"))
    body = client.get("/v1/runs").json()
    assert set(body) == {"runs", "next"} and body["next"] is None
    assert [set(row) for row in body["runs"]] == [{"run", "ranks", "first_seen", "last_seen", "in_metrics"}]
    assert client.get("/v1/runs", params={"scope": "local"}).json() == body
    assert client.get("/v1/runs", params={"scope": "everything"}).status_code == 422


GOOD = {"runs": [{"run": "<b>peer-run</b>", "ranks": 8, "first_seen": 1.0, "last_seen": 2.0, "in_metrics": True,
                  "split": None, "replica": "http://elsewhere:1"}], "next": None}


@pytest.fixture
def peers() -> Iterator[dict[str, Peer]]:
    answers = {"good": (200, json.dumps(GOOD).encode()), "not_json": (200, b"<html>a proxy's page</html>"),
               "not_runs": (200, json.dumps({"runs": [{"run": "x"}]}).encode()),
               "refusing": (401, b'{"error": "read token"}')}
    started = {name: Peer(status, body).start() for name, (status, body) in answers.items()}
    try:
        yield started
    finally:
        for peer in started.values():
            peer.stop()


def test_a_peer_is_down_with_why_unless_it_answers_a_run_list_and_its_rows_name_the_peer_as_listed(config_for,
                                                                                                  peers):
    urls = {name: peer.url for name, peer in peers.items()}
    config = config_for(peers=(OWN, *urls.values()), advertise_url=OWN, read_token=READ_TOKEN)
    with TestClient(create_app(config), headers={"Authorization": f"Bearer {READ_TOKEN}"}) as client:
        client.post("/v1/ingest", json=make_batch(run="exp-1"))

        def settled() -> dict | None:
            body = client.get("/v1/runs").json()
            states = {r["url"]: r for r in body["replicas"]}
            return body if all(states[url]["state"] != "slow" for url in urls.values()) else None

        body = wait_until(settled, SETTLE_S, "every peer judged")
        states = {r["url"]: r for r in body["replicas"]}
        assert [r["url"] for r in body["replicas"]][0] == OWN and states[OWN]["self"] is True
        assert states[urls["good"]]["state"] == "up" and states[urls["good"]]["error"] is None
        assert states[urls["not_json"]]["error"] == "its answer is not JSON"
        assert "lacks run, ranks" in states[urls["not_runs"]]["error"]
        assert states[urls["refusing"]]["error"] == "HTTP 401 (every replica must share one --read-token)"
        assert all(states[urls[name]]["state"] == "down" for name in ("not_json", "not_runs", "refusing"))
        # Rows: this replica's, and the good peer's, with the peer's URL as --peers lists it (not what it claims).
        assert [(row["run"], row["replica"]) for row in body["runs"]] == [("exp-1", OWN),
                                                                          ("<b>peer-run</b>", urls["good"])]
        assert body["runs"][1] == dict(GOOD["runs"][0], replica=urls["good"])
        # Each peer was asked for its own runs only, with the read token every replica shares.
        assert peers["good"].authorizations[0] == ("/v1/runs?scope=local&limit=1000", f"Bearer {READ_TOKEN}")
        # A fleet cursor names the replica of the last row; anything else is refused.
        page = client.get("/v1/runs", params={"limit": 1}).json()
        assert page["runs"][0]["run"] == "exp-1" and page["next"].endswith(f":{sorted(config.peers).index(OWN)}:exp-1")
        rest = client.get("/v1/runs", params={"limit": 1, "after": page["next"]}).json()
        assert rest["runs"] == body["runs"][1:] and rest["next"] is None
        # A split run's rows on two replicas may tie on last_seen and run: the replica orders them, and paging a
        # row at a time lists both.
        own = body["runs"][0]
        twin = dict(GOOD["runs"][0], run=own["run"], last_seen=own["last_seen"])
        peers["good"].body = json.dumps({"runs": [twin], "next": None}).encode()
        wait_until(lambda: dict(twin, replica=urls["good"]) in client.get("/v1/runs").json()["runs"],
                   SETTLE_S, "the twin row listed")
        rows, after = [], None
        while True:
            page = client.get("/v1/runs", params={"limit": 1, **({"after": after} if after else {})}).json()
            rows += [(row["run"], row["replica"]) for row in page["runs"]]
            if (after := page["next"]) is None:
                break
        assert len(rows) == 2 and set(rows) == {("exp-1", OWN), ("exp-1", urls["good"])}, rows
        assert client.get("/v1/runs", params={"after": "2.0:exp-1"}).status_code == 422
        assert client.get("/v1/runs", params={"after": "2.0:9:exp-1"}).status_code == 422
