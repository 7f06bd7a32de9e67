"""Forged identities and budgets dodged, against one real collector process shared by every case.

A rank's host, pid and incarnation id are what ``GET /v1/runs/{run}`` shows, so none of them may be
enough to speak for the rank: a forged close from "the same process" is a conflict like any other,
and a forged batch for the live incarnation is refused. New incarnations cost nothing, so a rank's
totals over all of them are bounded too. And three protections that no test pinned: a future
``sent_at`` is clamped before the plausibility bound is computed, a client's event budget keeps its
burst cap however long the client was idle, and the node relay posts only where its ranks are
configured to. Batches are built by hand (an attacker is not an agent).
"""

from __future__ import annotations

import json
import socket
import time
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

from ampwatch.server import ServerConfig, create_app
from ampwatch.server._client_budget import ClientBudget
from ampwatch_support.batches import APPLIED, make_batch, optimizer
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(120)

EVENT_RATE = 10  # per second and client address; bursts of one full batch (10,000 events)
IDLE_S = 8.0  # the budget client's idle time: 80 events' worth, which a missing cap would add to its burst


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    args = ["--client-event-rate", str(EVENT_RATE), "--silent-after", "600", "--expire-after", "3600"]
    with CollectorProcess(str(root / "ampwatch.db"), args=args) as running:
        yield running


@pytest.fixture
def client(collector):
    with httpx.Client(base_url=collector.url, timeout=30) as c:
        yield c


def _post(client: httpx.Client, batch: dict) -> httpx.Response:
    return client.post("/v1/ingest", json=batch)


def _warning(event_id: int) -> dict:
    return {"id": event_id, "kind": "warning", "time": time.time(), "iteration": 0, "code": "c", "message": "m"}


def _process(run: str, **fields) -> dict:
    """A process of rank 3 of ``run``: its identity fields, with a fresh incarnation id and process key."""
    return dict(run=run, rank=3, world_size=8, host="node-a", pid=111, incarnation=uuid.uuid4().hex,
                process_key=uuid.uuid4().hex, **fields)


def _rank(client: httpx.Client, run: str) -> dict:
    (rank,) = client.get(f"/v1/runs/{run}").json()["ranks"]
    return rank


def test_a_forged_close_from_the_host_and_pid_the_read_api_shows_is_a_conflict_and_the_rank_stays_open(client):
    victim = _process("forged-close")
    assert _post(client, make_batch(**victim, seq=1, iteration=10,
                                    optimizers={"gen": optimizer(steps=10)})).status_code == 200
    shown = _rank(client, "forged-close")
    assert "process_key" not in str(client.get("/v1/runs/forged-close").json())
    # Everything the read API shows, and a fresh incarnation, but no process key: the rank has shown one, so
    # the batch is kept as that process's history and never closes the rank (a keyed one: test_rank_ownership.py).
    forged = dict(run="forged-close", rank=3, world_size=8, host=shown["host"], pid=shown["pid"],
                  incarnation=uuid.uuid4().hex)
    assert _post(client, make_batch(**forged, seq=1, closed=True)).json() == APPLIED
    assert _rank(client, "forged-close")["closed"] is False
    # The live process sends again: two processes claim the rank.
    assert _post(client, make_batch(**victim, seq=2, iteration=20,
                                    optimizers={"gen": optimizer(steps=20)})).json() == APPLIED
    rank = _rank(client, "forged-close")
    assert (rank["closed"], rank["incarnation"], rank["iteration"]) == (False, victim["incarnation"], 20)
    assert [c["incarnation"] for c in rank["conflicts"]] == [forged["incarnation"]]
    assert _post(client, make_batch(**forged, seq=2, closed=True)).status_code == 409
    # The live incarnation's own id, which the read API shows, does not speak for it either.
    for key in (None, uuid.uuid4().hex):
        stolen = make_batch(**dict(victim, process_key=key), seq=99, iteration=30, closed=True)
        answer = _post(client, stolen)
        assert answer.status_code == 409 and answer.json()["retry"] is False, answer.text
    rank = _rank(client, "forged-close")
    assert (rank["closed"], rank["iteration"]) == (False, 20)
    assert _post(client, make_batch(**victim, seq=3, iteration=30)).json() == APPLIED
    text = client.get("/metrics").text
    assert value(text, "ampwatch_rank_conflicts_total", run="forged-close", rank="3") == 1
    assert value(text, "ampwatch_rank_closed", run="forged-close", rank="3") == 0


def test_new_incarnations_of_one_rank_cannot_pile_up_more_than_the_rank_may_count(client):
    # Each process's first batch may hold a day's worth (10,000 a second: 864,000,000), so each new
    # incarnation id would bring another day's worth; a rank's processes run one after another.
    day = 800_000_000
    answers = [_post(client, make_batch(**_process("incarnations"), optimizers={"gen": optimizer(skipped=day)}))
               for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 422, 422], [a.text for a in answers]
    assert answers[1].json()["error"] == "implausible" and "over all the processes of rank 3" in \
        answers[1].json()["message"] and "--max-counter-rate" in answers[1].json()["message"]
    assert _rank(client, "incarnations")["optimizers"]["gen"]["skipped"] == day
    # A restart that counts what a training loop counts is as welcome as ever.
    assert _post(client, make_batch(**_process("incarnations"), optimizers={"gen": optimizer(skipped=5)})
                 ).json() == APPLIED


def test_a_sent_at_far_in_the_future_is_clamped_before_the_bound_is_computed(client):
    process = _process("future")
    now = time.time()
    assert _post(client, make_batch(**process, seq=1, sent_at=now)).status_code == 200
    # Taken at its word, a sent_at 10^6 s ahead would allow 10^10; clamped to 300 s ahead, 3.6 million.
    forged = make_batch(**process, seq=2, sent_at=now + 1e6, optimizers={"gen": optimizer(skipped=10 ** 8)})
    answer = _post(client, forged)
    assert answer.status_code == 422 and answer.json()["error"] == "implausible", answer.text
    assert _rank(client, "future")["optimizers"]["gen"]["skipped"] == 0


def test_the_node_relay_posts_only_to_the_collectors_its_ranks_are_configured_for(collector, tmp_path):
    from ampwatch.agent._config import AgentConfig
    from ampwatch.agent._errors import AgentErrors
    from ampwatch.agent._identity import resolve_identity
    from ampwatch.agent._relay import REPLY_HEAD, NodeRelay, encode_frame, relay_paths

    config = AgentConfig.from_env(collector=collector.url, run="relayed",
                                  environ={"AMPWATCH_RELAY_DIR": str(tmp_path / "relay")}).for_job(1)
    paths = relay_paths(config, resolve_identity("relayed", environ={}))
    relay = NodeRelay.claim(config, paths, AgentErrors())
    assert relay is not None
    try:
        with RecordingCollector() as elsewhere:
            def hand_over(url: str, run: str) -> bytes:
                """Hand a batch to the relay as a rank does; return its answer (b"": it hung up)."""
                with socket.socket(socket.AF_UNIX) as rank, paths.address() as address:
                    rank.settimeout(30)
                    rank.connect(address)
                    rank.sendall(encode_frame(url, json.dumps(make_batch(**_process(run))).encode()))
                    return rank.recv(REPLY_HEAD.size + 4096)
            # A local process naming another URL: dropped, nothing posted anywhere.
            assert hand_over(elsewhere.url, "smuggled") == b""
            # A rank naming its configured collector: posted and answered.
            assert hand_over(collector.url, "relayed")[REPLY_HEAD.size:].startswith(b'{"status": 200')
            assert elsewhere.received == []
        with httpx.Client(base_url=collector.url, timeout=30) as client:
            assert client.get("/v1/runs/smuggled").status_code == 404
            assert _rank(client, "relayed")["incarnations"] == 1
    finally:
        relay.close()


def test_a_client_idle_for_long_keeps_its_burst_cap(tmp_path):
    # The collector's own budget on a clock the test moves (the collector process keeps its default), so
    # neither the idle time nor the time the batches take is this machine's.
    now = [0.0]
    config = ServerConfig(db=str(tmp_path / "ampwatch.db"), client_event_rate=EVENT_RATE,
                          allowed_hosts=("testserver",))
    with TestClient(create_app(config)) as client:
        client.app.state.ingest.budget = ClientBudget(config.client_new_runs, EVENT_RATE, clock=lambda: now[0])
        assert _post(client, make_batch(run="budget", events=[_warning(1)])).status_code == 200
        now[0] += IDLE_S  # idle: uncapped, the bucket would now hold 9,999 + 80 tokens; capped it holds 10,000
        burst = make_batch(run="budget", seq=2, events=[_warning(i) for i in range(2, 10_002)])
        assert _post(client, burst).json() == APPLIED
        now[0] += 7.4  # 74 events' worth
        more = _post(client, make_batch(run="budget", seq=3, events=[_warning(i) for i in range(10_002, 10_077)]))
        assert more.status_code == 429 and more.json()["error"] == "client_events", more.text
        now[0] += 0.2  # 76 events' worth: the same batch is taken
        assert _post(client, make_batch(run="budget", seq=3, events=[_warning(i) for i in range(10_002, 10_077)])
                     ).json() == APPLIED
