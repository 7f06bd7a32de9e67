"""GET /v1/runs/{run}/events/latest: the newest events, newest first, each storm one row with its count and ranks."""

from __future__ import annotations

import time

from ampwatch_support.batches import make_batch, optimizer, skip_event


def _post(client, rank: int, seq: int, events: list[dict]) -> None:
    batch = make_batch(rank=rank, incarnation=f"{rank + 1:032x}", seq=seq, world_size=16, events=events,
                       optimizers={"gen": optimizer(steps=10)})
    assert client.post("/v1/ingest", json=batch).status_code == 200


def test_a_storm_is_one_row_and_the_events_around_it_keep_their_own(client):
    _post(client, 3, 1, [{"id": 1, "kind": "poisoned_step", "time": time.time(), "iteration": 5, "optimizer": "gen",
                          "reason": "nonfinite_grad", "params": [], "params_total": 0}])
    for rank in [*range(0, 8), *range(10, 14)]:  # twelve ranks skip iteration 20: a storm
        _post(client, rank, 2, [skip_event(2, iteration=20)])
    for rank in (1, 2):  # two ranks skip iteration 30: too few for a storm
        _post(client, rank, 3, [skip_event(3, iteration=30)])
    body = client.get("/v1/runs/exp-42/events/latest").json()
    shape = [(r["event"]["kind"], r["event"]["iteration"], r["count"], r["rank_ranges"]) for r in body["rows"]]
    assert shape == [("skip", 30, 1, "2"), ("skip", 30, 1, "1"), ("skip", 20, 12, "0-7, 10-13"),
                     ("poisoned_step", 5, 1, "3")]
    assert body["rows"][2]["ranks"] == 12 and body["rows"][2]["event"]["rank"] == 13  # the newest of the storm
    assert body["scanned"] == 15 and body["more"] is False
    # Fewer events read than were written: the answer says there is more.
    short = client.get("/v1/runs/exp-42/events/latest", params={"scan": 4, "limit": 2}).json()
    assert len(short["rows"]) == 2 and short["more"] is True


def test_a_storm_the_scans_edge_cuts_is_counted_whole(client):
    for rank in range(12):  # twelve ranks skip iteration 20, then two ranks skip iteration 30
        _post(client, rank, 1, [skip_event(1, iteration=20)])
    for rank in (1, 2):
        _post(client, rank, 2, [skip_event(2, iteration=30)])
    # The rows start among the newest 8 events: the two later skips and 6 of the storm's 12.
    body = client.get("/v1/runs/exp-42/events/latest", params={"scan": 8}).json()
    shape = [(r["event"]["iteration"], r["count"], r["rank_ranges"]) for r in body["rows"]]
    assert shape == [(30, 1, "2"), (30, 1, "1"), (20, 12, "0-11")]
    assert body["scanned"] == 14 and body["more"] is False
    # A storm wholly behind the rows' start gets no row (and no partial count).
    behind = client.get("/v1/runs/exp-42/events/latest", params={"scan": 2}).json()
    assert [(r["event"]["iteration"], r["count"]) for r in behind["rows"]] == [(30, 1), (30, 1)]


def test_latest_events_of_an_unknown_run_is_a_404(client):
    assert client.get("/v1/runs/nope/events/latest").status_code == 404
