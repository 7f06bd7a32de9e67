"""GET /v1/runs/{run}/summary: ranks in trouble first, counted by reason, paged and searchable, from memory."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from ampwatch.server import create_app
from ampwatch.server._view_cache import ViewCache
from ampwatch_support.batches import make_batch, optimizer


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
    assert body["scale"] == {"min": 0.25, "median": 65536.0, "max": 65536.0, "ranks": 6, "collapsed": 1,
                             "no_scale": 0}
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


# ---- edges, with an injected clock -------------------------------------------------------------------------------

SILENT_AFTER_S = 10.0


@pytest.fixture
def clocked(config_for) -> Iterator[tuple[TestClient, list[float]]]:
    """A collector app whose clock (batches' arrival, silence, the built-in alerts, the summary's cache) is ``now``."""
    now = [1_800_000_000.0]
    app = create_app(config_for(silent_after=SILENT_AFTER_S), clock=lambda: now[0])
    with TestClient(app) as c:
        yield c, now


def _send(client, rank: int, *, seq: int = 1, scale: float | str | None = 65536.0, closed: bool = False,
          run: str = "edges", iteration: int = 100, enabled: bool = True, **counters) -> None:
    batch = make_batch(run=run, rank=rank, incarnation=f"{rank + 1:032x}", seq=seq, iteration=iteration,
                       loss_scale=scale, world_size=32, closed=closed,
                       optimizers={"gen": optimizer(**{"steps": iteration, **counters})})
    if not enabled:
        batch["scaler"] = {"enabled": False, "kind": "GradScaler"}
    answer = client.post("/v1/ingest", json=batch)
    assert answer.status_code == 200, answer.text


def _summary(client, run: str = "edges") -> dict:
    return client.get(f"/v1/runs/{run}/summary", params={"limit": 1000}).json()


def _reasons(body: dict) -> dict[int, list[str]]:
    return {row["rank"]: row["reasons"] for row in body["rows"]}


def test_a_rank_that_closed_cleanly_is_never_silent_however_long_ago_it_closed(clocked):
    client, now = clocked
    _send(client, 0)
    _send(client, 1, closed=True)
    now[0] += SILENT_AFTER_S + 5  # past both ranks' deadlines: only the open one is silent
    body = _summary(client)
    assert _reasons(body) == {0: ["silent"], 1: []} and body["counts"]["silent"] == 1
    assert body["closed"] is False and body["counts_cover"] == "live" and body["live_ranks"] == 1


def test_the_summary_is_rebuilt_when_the_first_rank_passes_its_silence_deadline_not_the_last(clocked):
    client, now = clocked
    _send(client, 0)  # deadline: start + 10
    now[0] += 5
    _send(client, 1)  # deadline: start + 15
    now[0] += 1
    assert _summary(client)["counts"]["silent"] == 0  # built at start + 6, held while no batch arrives
    now[0] += 4.5  # start + 10.5: rank 0 is past its deadline, rank 1 is not; no batch moved the generation
    body = _summary(client)
    assert _reasons(body) == {0: ["silent"], 1: []}


def test_the_scale_band_counts_collapsed_ranks_and_its_median_is_the_lower_middle_one(clocked):
    client, now = clocked
    # An even number of ranks with a scale: the lower of the two middle scales (2^15), a scale some rank holds,
    # not their average (49152); rank 4 has no GradScaler: no scale, never collapsed.
    for rank, scale in enumerate((16384.0, 32768.0, 65536.0, 65536.0)):
        _send(client, rank, scale=scale)
    _send(client, 4, scale=None, enabled=False)
    body = _summary(client)
    assert body["scale"] == {"min": 16384.0, "median": 32768.0, "max": 65536.0, "ranks": 4, "collapsed": 0,
                             "no_scale": 1}
    # Out of line with that median by a factor of 2: ranks 0, 2 and 3.
    assert [rank for rank, why in _reasons(body).items() if "desynced" in why] == [0, 2, 3]
    # A collapse across the job: zeros and a NaN are in the band's counts, zeros in its min and median.
    for rank, scale in enumerate((0.0, 0.0, "NaN", 65536.0)):
        _send(client, rank, seq=2, scale=scale, skipped=50, consecutive=50, longest=50, streaks=1)
    now[0] += 1.5  # past the cache's one-second floor
    body = _summary(client)
    assert body["scale"] == {"min": 0.0, "median": 0.0, "max": 65536.0, "ranks": 4, "collapsed": 3, "no_scale": 1}
    assert body["counts"]["collapsed"] == 3 and "collapsed" not in _reasons(body)[4]


def test_ranks_skipping_come_before_ranks_merely_out_of_line(clocked):
    client, now = clocked
    for rank in range(20):  # ranks 1-8 a backoff below the rest: out of line
        _send(client, rank, scale=32768.0 if 1 <= rank <= 8 else 65536.0)
    # Rank 19's streak of 16 ended between two batches (the ladder says so): its streak alert fires, nothing else.
    _send(client, 19, seq=2, iteration=200, skipped=16, longest=16, streaks=1, reached={"16": 1})
    # In a run of several ranks the periodic pass decides a streak alert, once two passes in a row found it.
    service, state = client.app.state.alert_service, client.app.state.collector_state
    for _ in range(2):
        now[0] += 1.0
        service.tick(state, now[0])
    now[0] += 1.5
    body = _summary(client)
    assert _reasons(body)[19] == ["alert"] and body["rows"][0]["rank"] == 19
    assert [row["rank"] for row in body["rows"][1:9]] == list(range(1, 9))
    assert all(_reasons(body)[rank] == ["desynced"] for rank in range(1, 9))


def test_a_whole_job_streak_is_one_banner_with_its_ranks_and_the_iteration_it_began_at(clocked):
    client, now = clocked
    for rank in range(6):
        _send(client, rank)
    # Four of six ranks skip in lockstep from iteration 290 (10 skipped by 300), rank 0 since 250; rank 5 steps on.
    for rank in range(5):
        streak = 50 if rank == 0 else 10
        _send(client, rank, seq=2, iteration=300, scale=64.0, skipped=streak, consecutive=streak, longest=streak,
              streaks=1)
    now[0] += 1.5
    body = _summary(client)
    assert body["whole_job"] == {"skipping": 5, "live": 6, "since_iteration": 290, "since_ranks": 4}
    _send(client, 5, seq=2, iteration=300, scale=64.0)  # no streak: not counted as skipping
    now[0] += 1.5
    assert _summary(client)["whole_job"]["skipping"] == 5
    for rank in range(2, 5):  # three ranks step again: 2 of 6 is not the whole job
        _send(client, rank, seq=3, iteration=320, scale=64.0, skipped=10, consecutive=0, longest=10, streaks=1)
    now[0] += 1.5
    assert _summary(client)["whole_job"] is None


def test_a_finished_run_tells_what_happened_over_its_life_and_the_alerts_that_fired(clocked):
    client, now = clocked
    # A short run: 31 of 160 step calls skipped, a streak of 20, the scale backed off to 2^-15; then it closed.
    _send(client, 0, iteration=100, scale=1.0, skipped=20, consecutive=20, longest=20, streaks=1,
          reached={"1": 1, "2": 1, "4": 1, "8": 1, "16": 1})
    live = _summary(client)
    assert live["counts_cover"] == "live" and _reasons(live)[0] == ["in_streak", "alert"]
    _send(client, 0, seq=2, iteration=160, scale=2.0 ** -15, closed=True, skipped=31, steps=129, longest=20,
          streaks=4, reached={"1": 4, "2": 2, "4": 1, "8": 1, "16": 1})
    now[0] += 700  # the streak alert resolved long ago (its window is 600 s)
    client.app.state.alert_service.tick(client.app.state.collector_state)
    assert not [a for a in client.app.state.alert_service.alerts.firing() if a.labels["run"] == "edges"]
    body = _summary(client)
    assert body["closed"] is True and body["counts_cover"] == "whole_run" and body["live_ranks"] == 0
    assert body["in_trouble"] == 1
    assert _reasons(body)[0] == ["collapsed", "long_streak", "high_skip_ratio", "alert"]
    assert body["rows"][0]["alerts"] == ["AmpConsecutiveSkippedSteps"]
    assert body["scale"] == {"min": 2.0 ** -15, "median": 2.0 ** -15, "max": 2.0 ** -15, "ranks": 1,
                             "collapsed": 1, "no_scale": 0}
    life = body["life"]
    assert {k: life[k] for k in ("iterations", "step_calls", "skipped", "streaks", "longest_streak",
                                 "longest_streak_rank", "poisoned_steps")} == \
        {"iterations": 160, "step_calls": 160, "skipped": 31, "streaks": 4, "longest_streak": 20,
         "longest_streak_rank": 0, "poisoned_steps": 0}
    assert [(a["name"], a["severity"], a["instances"], a["ranks"]) for a in life["alerts_fired"]] == \
        [("AmpConsecutiveSkippedSteps", "warning", 1, 1)]
    # Once the run retired from memory, what fired in it is forgotten too (memory stays bounded by the runs held).
    state, config = client.app.state.collector_state, client.app.state.config
    now[0] += config.run_retention
    assert state.retire(now[0], config.expire_after, config.run_retention)
    client.app.state.alert_service.tick(state)
    assert client.app.state.alert_service.alerts.fired("edges", by_rank=True) == ([], {})
