"""Protocol v2 ingest: one node's batches in one request, answered and applied per rank, beside v1."""

from __future__ import annotations

import json

from ampwatch.contract.node_batch import encode_node_batch, split_node_batch
from ampwatch_support.batches import APPLIED, DUPLICATE, make_batch, optimizer, skip_event
from ampwatch_support.exposition import value

JSON = {"content-type": "application/json"}


def _body(batch: dict) -> bytes:
    return json.dumps(batch, separators=(",", ":")).encode()


def _post_node(client, *batches: dict | bytes):
    bodies = [b if isinstance(b, bytes) else _body(b) for b in batches]
    return client.post("/v1/ingest", content=encode_node_batch(bodies), headers=JSON)


def test_a_node_batch_applies_each_rank_and_answers_each_in_order(client):
    answer = _post_node(client, *(make_batch(rank=r, world_size=8, optimizers={"gen": optimizer(steps=10 + r)},
                                             events=[skip_event(1, iteration=r)]) for r in range(8)))
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert answer.json()["protocol"] == 2
    assert results == [{"status": 200, **APPLIED, "rank": r} for r in range(8)]
    text = client.get("/metrics").text
    for r in range(8):
        assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank=str(r), optimizer="gen") == 10 + r
    assert value(text, "ampwatch_collector_batches_applied_total") == 8
    assert value(text, "ampwatch_collector_ingest_requests_total", code="200") == 1
    assert len(client.get("/v1/runs/exp-42/events").json()["events"]) == 8


def test_a_node_batch_says_which_ranks_were_applied_duplicate_or_refused(client):
    first = make_batch(rank=0, optimizers={"gen": optimizer(steps=5)})
    assert client.post("/v1/ingest", json=first).json() == APPLIED  # v1, then the same batch in v2
    too_many = make_batch(rank=2, world_size=4, optimizers={f"opt{i}": optimizer() for i in range(17)})
    answer = _post_node(client, first, make_batch(rank=1, optimizers={"gen": optimizer(steps=7)}), too_many,
                        b'{"protocol":1,"rank":"three"}')
    assert answer.status_code == 200
    duplicate, applied, refused, broken = answer.json()["results"]
    assert duplicate == {"status": 200, **DUPLICATE, "rank": 0}
    assert applied == {"status": 200, **APPLIED, "rank": 1}
    assert refused["status"] == 422 and refused["retry"] is False and refused["rank"] == 2
    assert "optimizers" in refused["message"]
    assert broken["status"] == 422 and broken["error"] == "schema" and "rank" not in broken
    text = client.get("/metrics").text
    assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 5
    assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="1", optimizer="gen") == 7
    assert value(text, "ampwatch_iteration", run="exp-42", rank="2") is None


def test_two_batches_of_one_rank_in_one_node_batch_apply_in_order(client):
    answer = _post_node(client, make_batch(seq=1, optimizers={"gen": optimizer(steps=1)}),
                        make_batch(seq=2, optimizers={"gen": optimizer(steps=2)}))
    assert [r["applied"] for r in answer.json()["results"]] == [True, True]
    assert value(client.get("/metrics").text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0",
                 optimizer="gen") == 2


def test_a_node_batch_laid_out_otherwise_is_refused_as_a_whole_with_what_to_do(client):
    body = encode_node_batch([_body(make_batch(rank=0)), _body(make_batch(rank=1))])
    wrong_lengths = body.replace(b'"lengths":[', b'"lengths":[1', 1)
    spaced = json.dumps(json.loads(body)).encode()
    for bad in (wrong_lengths, body[:-1], body + b" ", spaced):
        answer = client.post("/v1/ingest", content=bad, headers=JSON)
        assert answer.status_code in (400, 422), bad[:80]
        assert answer.json()["retry"] is False
    assert "docs/protocol.md" in client.post("/v1/ingest", content=wrong_lengths, headers=JSON).json()["message"]
    assert value(client.get("/metrics").text, "ampwatch_collector_batches_applied_total") in (None, 0)


def test_a_node_batch_needs_the_token_like_any_batch(config_for):
    from fastapi.testclient import TestClient

    from ampwatch.server import create_app
    with TestClient(create_app(config_for(token="s3cret"))) as client:
        answer = _post_node(client, make_batch(rank=0), make_batch(rank=1))
        assert answer.status_code == 401 and answer.json()["retry"] is False
        assert value(client.get("/metrics").text, "ampwatch_collector_batches_applied_total") in (None, 0)


def test_split_node_batch_returns_the_exact_bytes_each_rank_encoded():
    bodies = [b'{"a":1}', b'{"b":"x,y]}"}', b"{}"]
    assert split_node_batch(encode_node_batch(bodies)) == bodies
    assert split_node_batch(encode_node_batch([])) == []
    assert split_node_batch(b'{"protocol":2,"lengths":[7],"batches":[{"a":1}]}') == [b'{"a":1}']
    assert split_node_batch(b'{"protocol":2,"lengths":[8],"batches":[{"a":1}]}') is None
    assert split_node_batch(b'{"protocol":2,"lengths":[7,7],"batches":[{"a":1}{"a":1}]}') is None
