"""GET /v1/runs/{run}/summary: ranks in trouble first, counted by reason, paged and searchable, from memory."""

from __future__ import annotations

import time

from batches import make_batch, optimizer

from ampwatch.server._view_cache import ViewCache


def _post(client, rank: int, *, host: str = "node-a", scale: float = 65536.0, iteration: int = 100, seq: int = 1,
          **counters) -> None:
    batch = make_batch(rank=rank, incarnation=f"{rank + 1:032x}", host=host, iteration=iteration, loss_scale=scale,
                       seq=seq,
                       world_size=6, optimizers={"gen": optimizer(**{"steps": 100, **counters})})
    assert client.post("/v1/ingest", json=batch).status_code == 200


def _job(client) -> None:
    _post(client, 0)
    _post(client, 1, poisoned_steps=1)
    _post(client, 2, skipped=3, consecutive=3, longest=3, streaks=1)
    _post(client, 3, scale=0.25)
    _post(client, 4, skipped=100)  # 100 of 200 calls skipped: a high recent ratio
    _post(client, 5, host="node-b")


def test_the_summary_lists_ranks_in_trouble_first_by_reason_and_counts_the_rest(client):
    _job(client)
    body = client.get("/v1/runs/exp-42/summary").json()
    assert [row["rank"] for row in body["rows"]] == [1, 3, 2, 4, 0, 5]
    reasons = {row["rank"]: row["reasons"] for row in body["rows"]}
    assert reasons[1][0] == "poisoned" and "alert" in reasons[1]
    assert reasons[3][:2] == ["collapsed", "desynced"] and reasons[2] == ["in_streak"]
    assert reasons[4][0] == "high_skip_ratio" and reasons[0] == reasons[5] == []
    assert body["ranks"] == 6 and body["in_trouble"] == 4 and body["matched"] == 6 and body["closed"] is False
    assert body["counts"]["poisoned"] == body["counts"]["collapsed"] == body["counts"]["in_streak"] == 1
    assert body["counts"]["silent"] == 0
    row4 = next(row for row in body["rows"] if row["rank"] == 4)
    assert row4["recent_skip_ratio"] == 0.5 and (row4["skipped"], row4["steps"]) == (100, 100)
    assert body["scale"] == {"min": 0.25, "median": 65536.0, "max": 65536.0}
    assert "AmpPoisonedStep" in next(row for row in body["rows"] if row["rank"] == 1)["alerts"]


def test_the_summary_pages_and_searches_by_rank_host_or_reason(client):
    _job(client)
    pages, offset = [], 0
    while offset is not None:
        body = client.get("/v1/runs/exp-42/summary", params={"offset": offset, "limit": 4}).json()
        pages.append([row["rank"] for row in body["rows"]])
        offset = body["next"]
    assert pages == [[1, 3, 2, 4], [0, 5]]
    found = {q: [row["rank"] for row in client.get("/v1/runs/exp-42/summary", params={"search": q}).json()["rows"]]
             for q in ("node-b", "3", "streak")}
    assert found == {"node-b": [5], "3": [3], "streak": [2]}


def test_a_run_not_in_memory_is_a_404_that_says_where_to_look(client):
    answer = client.get("/v1/runs/nope/summary")
    assert answer.status_code == 404 and "GET /v1/runs/{run} reads one from the database" in answer.json()["detail"]


def test_the_summary_is_built_once_per_change_and_its_rows_progress_is_read_at_each_answer(client):
    _job(client)
    clock = [time.time()]
    cache = client.app.state.view_cache = ViewCache(clock=lambda: clock[0])
    first = client.get("/v1/runs/exp-42/summary").json()
    assert cache.builds == 1
    # Other pages, searches and tabs read the same build.
    client.get("/v1/runs/exp-42/summary", params={"offset": 2, "limit": 2})
    client.get("/v1/runs/exp-42/summary", params={"search": "node-b"})
    assert (cache.builds, cache.hits) == (1, 2)
    # Progress alone (rank 0 steps on) does not move the run's generation, yet its row reads it now.
    _post(client, 0, iteration=200, seq=2, steps=200)
    again = client.get("/v1/runs/exp-42/summary").json()
    assert cache.builds == 1 and again["generation"] == first["generation"]
    row0 = next(row for row in again["rows"] if row["rank"] == 0)
    assert (row0["iteration"], row0["steps"]) == (200, 200)
    # A change the summary shows (rank 5 starts skipping) moves it: rebuilt, rank 5 now in trouble, once the
    # body is a second old (a storm moves the generation at every batch: one build a second serves every tab).
    _post(client, 5, host="node-b", seq=2, skipped=2, consecutive=2, longest=2, streaks=1)
    assert client.get("/v1/runs/exp-42/summary").json()["in_trouble"] == first["in_trouble"] and cache.builds == 1
    clock[0] += 1.5
    moved = client.get("/v1/runs/exp-42/summary").json()
    assert cache.builds == 2 and moved["generation"] > first["generation"]
    assert next(row for row in moved["rows"] if row["rank"] == 5)["reasons"][0] == "in_streak"
    assert moved["in_trouble"] == first["in_trouble"] + 1
