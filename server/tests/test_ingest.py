"""Ingest: validation answers, idempotency, reordering, incarnations, limits; a bad batch changes nothing."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch_support.batches import APPLIED, DUPLICATE, make_batch, optimizer, skip_event
from ampwatch_support.exposition import value

INC_A = "a" * 32
INC_B = "b" * 32


def steps(client: TestClient, **labels: str) -> float | None:
    return value(client.get("/metrics").text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0",
                 optimizer="gen", **labels)


def test_a_batch_applied_twice_changes_nothing(client):
    batch = make_batch(optimizers={"gen": optimizer(steps=5, skipped=1)}, events=[skip_event(1)])
    assert client.post("/v1/ingest", json=batch).json() == APPLIED
    before = client.get("/metrics").text
    again = client.post("/v1/ingest", json=batch)
    assert again.status_code == 200 and again.json() == DUPLICATE
    after = client.get("/metrics").text
    assert value(after, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 5
    assert value(after, "ampwatch_collector_duplicate_batches_total") == 1
    assert len(client.get("/v1/runs/exp-42/events").json()["events"]) == 1
    strip = lambda text: [line for line in text.splitlines() if line.startswith("ampwatch_optimizer")]  # noqa: E731
    assert strip(before) == strip(after)


def test_an_older_batch_arriving_late_does_not_move_counters_back_but_keeps_its_events(client):
    newer = make_batch(seq=3, optimizers={"gen": optimizer(steps=30)}, events=[skip_event(3)])
    older = make_batch(seq=2, optimizers={"gen": optimizer(steps=20)}, events=[skip_event(2)])
    assert client.post("/v1/ingest", json=newer).json()["applied"] is True
    assert client.post("/v1/ingest", json=older).json() == DUPLICATE
    assert steps(client) == 30
    ids = [e["id"] for e in client.get("/v1/runs/exp-42/events").json()["events"]]
    assert sorted(ids) == [2, 3]


def test_a_restarted_rank_adds_its_new_incarnation_to_the_earlier_totals(client):
    client.post("/v1/ingest", json=make_batch(incarnation=INC_A, seq=7, backoffs=2,
                                              optimizers={"gen": optimizer(steps=70, skipped=3)}))
    client.post("/v1/ingest", json=make_batch(incarnation=INC_B, seq=1, backoffs=1,
                                              optimizers={"gen": optimizer(steps=4, skipped=1)}))
    text = client.get("/metrics").text
    assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 74
    assert value(text, "ampwatch_optimizer_skipped_steps_total", run="exp-42", rank="0", optimizer="gen") == 4
    assert value(text, "ampwatch_loss_scale_backoffs_total", run="exp-42", rank="0") == 3
    # A late retry from the old process changes nothing and does not steal the "current" gauges.
    client.post("/v1/ingest", json=make_batch(incarnation=INC_A, seq=7, iteration=999,
                                              optimizers={"gen": optimizer(steps=70, skipped=3)}))
    client.post("/v1/ingest", json=make_batch(incarnation=INC_B, seq=2, iteration=5,
                                              optimizers={"gen": optimizer(steps=5, skipped=1)}))
    text = client.get("/metrics").text
    assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 75
    assert value(text, "ampwatch_iteration", run="exp-42", rank="0") == 5
    assert client.get("/v1/runs/exp-42").json()["ranks"][0]["incarnations"] == 2


def test_counters_that_go_down_within_an_incarnation_never_make_totals_fall(client):
    client.post("/v1/ingest", json=make_batch(seq=1, optimizers={"gen": optimizer(steps=10)}))
    client.post("/v1/ingest", json=make_batch(seq=2, optimizers={"gen": optimizer(steps=3)}))
    assert steps(client) == 10


def test_malformed_json_gets_400_and_changes_nothing(client):
    answer = client.post("/v1/ingest", content=b'{"protocol": 1,', headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["message"]
    assert client.get("/v1/runs").json()["runs"] == []
    assert value(client.get("/metrics").text, "ampwatch_collector_rejected_batches_total", reason="json") == 1


def test_schema_errors_get_422_naming_the_field(client):
    bad = make_batch(optimizers={"gen": optimizer(steps=-1)})
    answer = client.post("/v1/ingest", json=bad)
    assert answer.status_code == 422
    assert any("state.optimizers.gen.steps" in line for line in answer.json()["detail"])
    future = make_batch(protocol=2)
    answer = client.post("/v1/ingest", json=future)
    assert answer.status_code == 422 and "this collector speaks version 1" in json.dumps(answer.json())
    unknown = make_batch(events=[{"id": 1, "kind": "teleport", "time": 1.0, "iteration": 0}])
    assert client.post("/v1/ingest", json=unknown).status_code == 422
    assert client.post("/v1/ingest", json=make_batch(rank=2, world_size=2)).status_code == 422
    # true and 1.0 are not integers (a lax reading would apply them as rank 1, seq 1).
    assert client.post("/v1/ingest", json=make_batch(rank=True)).status_code == 422
    assert client.post("/v1/ingest", json=make_batch(seq=1.0)).status_code == 422
    assert client.get("/v1/runs").json()["runs"] == []


def test_a_token_is_required_when_configured_and_compared_exactly(config_for):
    with TestClient(create_app(config_for(token="s3cret"))) as client:
        batch = make_batch()
        missing = client.post("/v1/ingest", json=batch)
        assert missing.status_code == 401 and "AMPWATCH_TOKEN" in missing.json()["message"]
        wrong = client.post("/v1/ingest", json=batch, headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 403
        right = client.post("/v1/ingest", json=batch, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200 and right.json()["applied"] is True


def test_a_body_over_the_limit_gets_413(config_for):
    with TestClient(create_app(config_for(max_body_bytes=2048))) as client:
        big = make_batch(events=[skip_event(i + 1) for i in range(40)])
        answer = client.post("/v1/ingest", json=big)
        assert answer.status_code == 413 and "--max-body-bytes" in answer.json()["message"]
        assert client.get("/v1/runs").json()["runs"] == []


def test_cardinality_limits_tell_back_pressure_429_from_permanent_422_and_count_the_rejection(config_for):
    with TestClient(create_app(config_for(max_runs=1, max_ranks_per_run=1, max_optimizers_per_rank=2,
                                          max_label_length=16))) as client:
        assert client.post("/v1/ingest", json=make_batch()).status_code == 200
        # Back-pressure: a new run may get in once finished runs retire; the agent keeps the batch and retries.
        other_run = client.post("/v1/ingest", json=make_batch(run="exp-43"))
        assert other_run.status_code == 429 and int(other_run.headers["retry-after"]) >= 1
        assert other_run.json()["retry"] is True and "--max-runs" in other_run.json()["message"]
        # Permanent: resending the same rank's batches can never pass; the agent drops and counts them.
        other_rank = client.post("/v1/ingest", json=make_batch(rank=1))
        assert other_rank.status_code == 422 and other_rank.json()["retry"] is False
        assert "--max-ranks-per-run" in other_rank.json()["message"] and "retry-after" not in other_rank.headers
        many = client.post("/v1/ingest", json=make_batch(seq=2, optimizers={n: optimizer() for n in ("a", "b", "c")}))
        assert many.status_code == 422 and many.json()["retry"] is False
        assert "--max-optimizers-per-rank 2" in many.json()["message"]
        long_name = client.post("/v1/ingest", json=make_batch(seq=2, optimizers={"x" * 17: optimizer()}))
        assert long_name.status_code == 422 and long_name.json()["retry"] is False
        schema = client.post("/v1/ingest", json=make_batch(seq=2, world_size=0))
        assert schema.status_code == 422 and schema.json()["retry"] is False and schema.json()["error"] == "schema"
        text = client.get("/metrics").text
        assert value(text, "ampwatch_collector_rejected_batches_total", reason="cardinality") == 4
        assert value(text, "ampwatch_collector_ingest_requests_total", code="429") == 1
        assert value(text, "ampwatch_collector_ingest_requests_total", code="422") == 4
