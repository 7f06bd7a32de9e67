"""Ranks that go quiet expire from /metrics; closed runs retire after retention; history stays queryable."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from batches import make_batch, optimizer, skip_event
from exposition import value

from ampwatch.server import create_app


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_silent_rank_stops_reporting_then_expires_from_metrics_but_stays_queryable(config_for):
    # Windows of seconds, and the loop below runs until they pass, however slowly a loaded machine answers.
    silent_after = 1.5
    with TestClient(create_app(config_for(silent_after=silent_after, expire_after=3.0, run_retention=30))) as client:
        client.post("/v1/ingest", json=make_batch(rank=0))
        rank0_seen = time.monotonic()
        client.post("/v1/ingest", json=make_batch(rank=1, incarnation="d" * 32))
        if time.monotonic() - rank0_seen < silent_after:  # else the machine stalled too long to tell: skip the check
            assert value(client.get("/metrics").text, "ampwatch_run_ranks_reporting", run="exp-42") == 2
        while time.monotonic() < rank0_seen + silent_after + 0.3:  # rank 1 keeps reporting, rank 0 goes quiet
            client.post("/v1/ingest", json=make_batch(rank=1, incarnation="d" * 32,
                                                      seq=int(time.monotonic() * 1000)))
            time.sleep(0.1)
        text = client.get("/metrics").text
        # Past silent_after rank 0 no longer counts, but its last-seen series is still there to alert on.
        assert value(text, "ampwatch_run_ranks_reporting", run="exp-42") == 1
        assert _wait_until(lambda: value(client.get("/metrics").text, "ampwatch_rank_last_seen_timestamp_seconds",
                                         run="exp-42", rank="0") is None)
        assert value(client.get("/metrics").text, "ampwatch_iteration", run="exp-42", rank="1") is not None
        ranks = client.get("/v1/runs/exp-42").json()["ranks"]
        assert [(r["rank"], r["in_metrics"]) for r in ranks] == [(0, False), (1, True)]


def test_an_expired_rank_that_comes_back_continues_its_totals(config_for):
    with TestClient(create_app(config_for(silent_after=0.2, expire_after=0.5))) as client:
        client.post("/v1/ingest", json=make_batch(seq=1, optimizers={"gen": optimizer(steps=40)}))
        assert _wait_until(lambda: value(client.get("/metrics").text, "ampwatch_optimizer_steps_total",
                                         run="exp-42", rank="0", optimizer="gen") is None)
        client.post("/v1/ingest", json=make_batch(incarnation="e" * 32, seq=1,
                                                  optimizers={"gen": optimizer(steps=2)}))
        assert value(client.get("/metrics").text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0",
                     optimizer="gen") == 42


def test_a_cleanly_closed_run_stays_for_its_retention_then_leaves_metrics(config_for):
    with TestClient(create_app(config_for(silent_after=5, expire_after=60, run_retention=0.6))) as client:
        client.post("/v1/ingest", json=make_batch(closed=True, events=[
            skip_event(1), {"id": 2, "kind": "close", "time": time.time(), "iteration": 3}]))
        started = time.monotonic()
        text = client.get("/metrics").text
        assert value(text, "ampwatch_rank_closed", run="exp-42", rank="0") == 1
        assert value(text, "ampwatch_run_ranks_reporting", run="exp-42") == 0
        assert _wait_until(lambda: value(client.get("/metrics").text, "ampwatch_rank_closed",
                                         run="exp-42", rank="0") is None)
        assert time.monotonic() - started >= 0.4
        assert client.get("/v1/runs/exp-42").json()["closed"] is True
        kinds = [e["kind"] for e in client.get("/v1/runs/exp-42/events").json()["events"]]
        assert kinds == ["skip", "close"]
