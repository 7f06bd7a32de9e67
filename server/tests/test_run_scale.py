"""GET /v1/runs/{run}/scale: the spread of the loss scale across ranks over a window, and the outlier ranks."""

from __future__ import annotations

import time

from ampwatch.server._scale_trace import CAPACITY, ScaleTrace
from ampwatch_support.batches import make_batch, optimizer, skip_event

RANKS = 8


def _post(client, rank: int, seq: int, iteration: int, scale: float, events=(), incarnation: str = "") -> None:
    batch = make_batch(rank=rank, incarnation=incarnation or f"{rank + 1:032x}", seq=seq, iteration=iteration,
                       loss_scale=scale, world_size=RANKS, events=list(events),
                       optimizers={"gen": optimizer(steps=iteration)})
    answer = client.post("/v1/ingest", json=batch)
    assert answer.status_code == 200, answer.text


def _backoff(id: int, iteration: int, before: float, after: float) -> dict:
    return {"id": id, "kind": "scale_change", "time": time.time(), "iteration": iteration, "cause": "backoff",
            "before": before, "after": after}


def _job(client) -> None:
    """Eight ranks at 2^16 up to iteration 1,000; rank 3 backs off to 0.25 at iteration 650 (reported in its
    batch at 700); rank 5 is killed after iteration 400; rank 6 runs at 2^15 from iteration 900."""
    for seq, iteration in enumerate(range(100, 1001, 100), start=1):
        for rank in range(RANKS):
            if rank == 5 and iteration > 400:
                continue
            scale, events = 65536.0, []
            if rank == 3 and iteration >= 700:
                scale = 0.25
                if iteration == 700:
                    events = [skip_event(1, iteration=650), _backoff(2, 650, 65536.0, 0.25)]
            if rank == 6 and iteration >= 900:
                scale = 32768.0
            _post(client, rank, seq, iteration, scale, events)


def test_the_spread_is_min_median_max_per_slice_of_the_window_and_the_x_axis_starts_at_the_window(client):
    _job(client)
    body = client.get("/v1/runs/exp-42/scale", params={"window": "200", "outliers": 2}).json()
    assert (body["start"], body["end"], body["width"], body["ranks"]) == (800, 1000, 2, RANKS)
    spread = body["spread"]
    assert spread["iteration"][0] == 800 and spread["iteration"][-1] == 1000 and len(spread["iteration"]) == 101
    assert set(spread["min"]) == {0.25} and set(spread["median"]) == {65536.0} and set(spread["max"]) == {65536.0}
    assert set(spread["reporting"]) == {RANKS - 1}  # rank 5 stopped at 400: it is not in this window's spread
    # The outliers: rank 3 (18 powers of two below the median), then rank 6 (one below, from 900).
    assert [(o["rank"], o["deviation"]) for o in body["outliers"]] == [(3, 18.0), (6, 1.0)]
    assert body["outliers"][0]["points"] == [[800, 0.25], [1000, 0.25]]
    assert body["outliers"][1]["points"] == [[800, 65536.0], [900, 32768.0], [1000, 32768.0]]

    everything = client.get("/v1/runs/exp-42/scale", params={"window": "all", "outliers": 1}).json()
    assert (everything["start"], everything["end"], everything["width"]) == (100, 1000, 5)
    rank3 = everything["outliers"][0]
    assert rank3["rank"] == 3 and [650, 0.25] in rank3["points"] and [100, 65536.0] in rank3["points"]
    assert rank3["skips"] == [[650, "gen"]]  # the chart's mark, from the events table
    assert body["outliers"][0]["skips"] == []  # before the 200-iteration window
    # Before rank 3 backed off the band is one scale wide; rank 5's slice of leaving drops it from the count.
    first, at_400, at_450 = 0, (400 - 100) // 5, (450 - 100) // 5
    assert everything["spread"]["min"][first] == everything["spread"]["max"][first] == 65536.0
    assert everything["spread"]["reporting"][at_400] == RANKS and everything["spread"]["reporting"][at_450] == RANKS - 1


def test_ranks_asked_for_are_drawn_whatever_their_distance_and_a_small_run_shows_every_rank(client):
    _job(client)
    body = client.get("/v1/runs/exp-42/scale", params={"window": "1000", "outliers": 1, "ranks": "0,5"}).json()
    assert [(o["rank"], o["asked"]) for o in body["outliers"]] == [(0, True), (3, False), (5, True)]
    assert body["outliers"][2]["iteration"] == 400 and body["outliers"][2]["points"][-1] == [400, 65536.0]
    small = client.get("/v1/runs/exp-42/scale", params={"outliers": RANKS}).json()
    assert [o["rank"] for o in small["outliers"]] == list(range(RANKS))


def test_a_scale_off_the_log_axis_is_the_furthest_outlier_and_is_sent_as_the_protocol_writes_it(client):
    _post(client, 0, 1, 100, 65536.0)
    _post(client, 1, 1, 100, 65536.0)
    _post(client, 2, 1, 100, 65536.0)
    _post(client, 2, 2, 200, "NaN")
    _post(client, 0, 2, 200, 65536.0)
    body = client.get("/v1/runs/exp-42/scale", params={"outliers": 1}).json()
    assert body["outliers"][0]["rank"] == 2 and body["outliers"][0]["deviation"] == "Infinity"
    assert body["outliers"][0]["points"][-1] == [200, "NaN"] and body["outliers"][0]["loss_scale"] == "NaN"
    assert body["spread"]["min"][-1] == 65536.0  # the spread keeps to scales a log axis can draw


def test_a_process_restarted_from_an_earlier_checkpoint_rewinds_the_rank_s_trace(client):
    _post(client, 0, 1, 500, 65536.0)
    _post(client, 0, 2, 900, 1024.0, [_backoff(1, 800, 65536.0, 1024.0)])
    _post(client, 0, 1, 600, 4096.0, incarnation="f" * 32)  # resumed from the checkpoint of iteration 600
    body = client.get("/v1/runs/exp-42/scale", params={"window": "all"}).json()
    assert body["end"] == 600 and body["outliers"][0]["points"] == [[500, 65536.0], [600, 4096.0]]


def test_an_unknown_window_or_run_says_what_is_accepted(client):
    _post(client, 0, 1, 100, 65536.0)
    assert client.get("/v1/runs/exp-42/scale", params={"window": "7"}).status_code == 422
    assert client.get("/v1/runs/exp-42/scale", params={"ranks": "1;2"}).status_code == 422
    assert client.get("/v1/runs/nope/scale").status_code == 404


def test_a_full_trace_thins_its_older_half_and_keeps_its_span_and_latest_changes():
    trace = ScaleTrace()
    for i in range(3 * CAPACITY):
        trace.record(10 * i, 2.0 ** (i % 2))
    assert len(trace) <= CAPACITY and trace.iterations[0] == 0
    assert list(trace.iterations[-10:]) == [10 * i for i in range(3 * CAPACITY - 10, 3 * CAPACITY)]
    assert trace.scale_at(10 * (3 * CAPACITY - 1)) == 2.0 and trace.last_iteration == 10 * (3 * CAPACITY - 1)
    trace.record(5, 8.0)  # older than what was reported since: a late event changes nothing
    assert trace.scale_at(5) == 1.0
