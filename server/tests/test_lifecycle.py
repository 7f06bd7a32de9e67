"""Ranks that go quiet expire from /metrics; closed runs retire after retention; history stays queryable.

Time here is the collector's injected clock, moved by the test: only the app's own retire loop runs in
real time (it turns every fraction of a window), and the tests wait for it on a condition.
"""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch_support.batches import make_batch, optimizer, skip_event
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until


class Clock:
    """Unix seconds that move only when the test says (from the real time it starts at)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _metric(client: TestClient, name: str, **labels: str) -> float | None:
    return value(client.get("/metrics").text, name, run="exp-42", **labels)


def test_a_silent_rank_stops_reporting_then_expires_from_metrics_but_stays_queryable(config_for):
    clock = Clock()
    app = create_app(config_for(silent_after=1.5, expire_after=3.0, run_retention=30), clock=clock)
    with TestClient(app) as client:
        client.post("/v1/ingest", json=make_batch(rank=0))
        client.post("/v1/ingest", json=make_batch(rank=1, incarnation="d" * 32))
        assert _metric(client, "ampwatch_run_ranks_reporting") == 2
        clock.advance(1.0)
        client.post("/v1/ingest", json=make_batch(rank=1, incarnation="d" * 32, seq=2))
        assert _metric(client, "ampwatch_run_ranks_reporting") == 2, "quiet for 1 s of 1.5: still reporting"
        clock.advance(0.8)  # rank 0 quiet for 1.8 s, rank 1 for 0.8 s
        client.post("/v1/ingest", json=make_batch(rank=1, incarnation="d" * 32, seq=3))
        # Past silent_after rank 0 no longer counts, but its last-seen series is still there to alert on.
        assert _metric(client, "ampwatch_run_ranks_reporting") == 1
        assert _metric(client, "ampwatch_rank_last_seen_timestamp_seconds", rank="0") is not None
        clock.advance(1.5)  # rank 0 quiet for 3.3 s: past expire_after; rank 1 for 1.5 s
        wait_until(lambda: _metric(client, "ampwatch_rank_last_seen_timestamp_seconds", rank="0") is None,
                   what="the retire loop to expire rank 0")
        assert _metric(client, "ampwatch_iteration", rank="1") is not None
        ranks = client.get("/v1/runs/exp-42").json()["ranks"]
        assert [(r["rank"], r["in_metrics"]) for r in ranks] == [(0, False), (1, True)]


def test_an_expired_rank_that_comes_back_continues_its_totals(config_for):
    clock = Clock()
    with TestClient(create_app(config_for(silent_after=0.2, expire_after=0.5), clock=clock)) as client:
        client.post("/v1/ingest", json=make_batch(seq=1, optimizers={"gen": optimizer(steps=40)}))
        clock.advance(0.6)
        wait_until(lambda: _metric(client, "ampwatch_optimizer_steps_total", rank="0", optimizer="gen") is None,
                   what="the retire loop to expire rank 0")
        client.post("/v1/ingest", json=make_batch(incarnation="e" * 32, seq=1,
                                                  optimizers={"gen": optimizer(steps=2)}))
        assert _metric(client, "ampwatch_optimizer_steps_total", rank="0", optimizer="gen") == 42


def test_a_cleanly_closed_run_stays_for_its_retention_then_leaves_metrics(config_for):
    clock = Clock()
    with TestClient(create_app(config_for(silent_after=5, expire_after=60, run_retention=0.6), clock=clock)) as client:
        # A witness closed 0.3 s earlier: once it is gone, the retire loop has judged both runs at the same time.
        client.post("/v1/ingest", json=make_batch(run="witness", closed=True))
        clock.advance(0.3)
        client.post("/v1/ingest", json=make_batch(closed=True, events=[
            skip_event(1), {"id": 2, "kind": "close", "time": clock(), "iteration": 3}]))
        assert _metric(client, "ampwatch_rank_closed", rank="0") == 1
        assert _metric(client, "ampwatch_run_ranks_reporting") == 0
        clock.advance(0.4)  # the witness closed 0.7 s ago, past the retention; this run 0.4 s ago, within it
        wait_until(lambda: value(client.get("/metrics").text, "ampwatch_rank_closed", run="witness", rank="0")
                   is None, what="the retire loop to retire the witness")
        assert _metric(client, "ampwatch_rank_closed", rank="0") == 1, "a closed run left before its retention"
        clock.advance(0.3)
        wait_until(lambda: _metric(client, "ampwatch_rank_closed", rank="0") is None,
                   what="the retire loop to retire the closed run")
        assert client.get("/v1/runs/exp-42").json()["closed"] is True
        kinds = [e["kind"] for e in client.get("/v1/runs/exp-42/events").json()["events"]]
        assert kinds == ["skip", "close"]
