"""The JSON query API: runs, one run's ranks, events with filters and pagination; health."""

from __future__ import annotations

import time

import msgspec
from fastapi.testclient import TestClient

from ampwatch.server._app import create_app
from ampwatch.server._schema import SkipEvent
from ampwatch_support.batches import make_batch, optimizer, skip_event


def _events(n: int, start: int = 1) -> list[dict]:
    out = []
    for i in range(start, start + n):
        if i % 2:
            out.append(skip_event(i, optimizer="gen" if i % 4 == 1 else "disc", iteration=i))
        else:
            out.append({"id": i, "kind": "scale_change", "time": time.time(), "iteration": i, "cause": "backoff",
                        "before": 2.0 ** 16, "after": 2.0 ** 15})
    return out


def test_runs_and_a_runs_ranks_describe_the_current_state(client):
    client.post("/v1/ingest", json=make_batch(optimizers={"gen": optimizer(steps=3, skipped=1)},
                                              events=[skip_event(1, params=("head.weight",))]))
    client.post("/v1/ingest", json=make_batch(run="exp-43"))
    runs = client.get("/v1/runs").json()["runs"]
    assert {r["run"] for r in runs} == {"exp-42", "exp-43"} and all(r["in_metrics"] for r in runs)
    run = client.get("/v1/runs/exp-42").json()
    gen = run["ranks"][0]["optimizers"]["gen"]
    assert (gen["steps"], gen["skipped"], gen["latest_nonfinite_parameter"]) == (3, 1, "head.weight")
    assert (gen["grad_norm_spikes"], gen["grad_norm"], gen["local_grad_norm"]) == (0, None, None)
    assert (run["ranks"][0]["loss_spikes"], run["ranks"][0]["loss"], run["ranks"][0]["gradient_outliers"]) == \
        (0, None, 0)
    missing = client.get("/v1/runs/nope")
    assert missing.status_code == 404 and "GET /v1/runs" in missing.json()["detail"]


def test_a_runs_ranks_show_their_spikes_and_the_newest_processs_rolling_levels(client):
    spiking = make_batch(optimizers={"gen": optimizer(steps=3, grad_norm_spikes=2, grad_norm={"mean": 4.0, "std": 0.5},
                                                      local_grad_norm={"mean": 2.0, "std": 0.25})})
    spiking["state"].update(loss_spikes=5, loss={"mean": 1.5, "std": 0.125})
    client.post("/v1/ingest", json=spiking)
    rank = client.get("/v1/runs/exp-42").json()["ranks"][0]
    assert (rank["loss_spikes"], rank["loss"]) == (5, {"mean": 1.5, "std": 0.125})
    gen = rank["optimizers"]["gen"]
    assert (gen["grad_norm_spikes"], gen["grad_norm"], gen["local_grad_norm"]) == \
        (2, {"mean": 4.0, "std": 0.5}, {"mean": 2.0, "std": 0.25})


def test_events_filter_by_kind_rank_optimizer_and_since(client):
    client.post("/v1/ingest", json=make_batch(events=_events(8)))
    client.post("/v1/ingest", json=make_batch(rank=1, incarnation="f" * 32, events=_events(2)))
    get = lambda **q: client.get("/v1/runs/exp-42/events", params=q).json()["events"]  # noqa: E731
    assert len(get()) == 10
    assert {e["kind"] for e in get(kind="skip")} == {"skip"} and len(get(kind="skip")) == 5
    assert [e["id"] for e in get(rank=1)] == [1, 2]
    assert [e["id"] for e in get(rank=0, optimizer="gen")] == [1, 5]
    assert get(since=time.time() + 60) == []
    assert client.get("/v1/runs/exp-42/events", params={"kind": "nonsense"}).status_code == 422


def test_events_come_in_pages_that_add_up_to_all_of_them(client):
    client.post("/v1/ingest", json=make_batch(events=_events(25)))
    seen, after = [], 0
    while True:
        page = client.get("/v1/runs/exp-42/events", params={"limit": 10, "after": after}).json()
        seen += [e["id"] for e in page["events"]]
        if page["next"] is None:
            break
        after = page["next"]
    assert seen == list(range(1, 26))


def test_events_newest_first_start_at_the_latest_and_page_back_to_the_first(client):
    client.post("/v1/ingest", json=make_batch(events=_events(25)))
    seen, after = [], 0
    while True:
        page = client.get("/v1/runs/exp-42/events", params={"limit": 10, "after": after, "newest_first": True}).json()
        seen += [e["id"] for e in page["events"]]
        if page["next"] is None:
            break
        after = page["next"]
    assert seen == list(range(25, 0, -1))
    skips = client.get("/v1/runs/exp-42/events", params={"limit": 2, "kind": "skip", "newest_first": True}).json()
    assert [e["id"] for e in skips["events"]] == [25, 23] and skips["next"] is not None


def test_health_ready_and_openapi_answer_and_the_cdn_loading_docs_page_is_off_by_default(client, config_for):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    assert client.get("/docs").status_code == 404  # Swagger UI loads its scripts from a public CDN (issue 15)
    with TestClient(create_app(config_for(api_docs=True))) as with_docs:
        assert with_docs.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/ingest", "/v1/runs", "/v1/runs/{run}", "/v1/runs/{run}/events", "/metrics"} <= set(paths)


def test_events_read_back_whole_although_rows_keep_only_what_is_not_a_column_or_a_default(config_for):
    import json
    import sqlite3

    skip = {"id": 1, "kind": "skip", "time": 1_764_400_000.5, "iteration": 7, "optimizer": "gen", "streak": 4,
            "params": [{"name": "head.weight", "inf": 3, "nan": 0}], "params_total": 1, "inspected": True,
            "origin": True, "origin_buckets": [2], "origin_params": ["head.weight"], "origin_params_total": 1}
    bare = {"id": 2, "kind": "skip", "time": 1_764_400_001.0, "iteration": 8, "optimizer": "disc", "streak": 8,
            "inspected": False}
    folded = {"id": 3, "kind": "scale_change", "time": 1_764_400_001.0, "iteration": 9, "cause": "backoff",
              "before": 65536.0, "after": 4096.0, "count": 4}
    single = {"id": 4, "kind": "scale_change", "time": 1_764_400_002.0, "iteration": 10, "cause": "manual",
              "before": 4096.0, "after": "NaN"}
    warning = {"id": 5, "kind": "warning", "time": 1_764_400_003.0, "iteration": 11, "code": "c", "message": "m"}
    config = config_for()
    with TestClient(create_app(config)) as client:
        assert client.post("/v1/ingest",
                           json=make_batch(events=[skip, bare, folded, single, warning])).status_code == 200
        got = client.get("/v1/runs/exp-42/events").json()["events"]
    # What a skip event left out reads back as: each optional field's default in the collector's schema (a field
    # added there needs nothing here).
    defaults = {f.name: f.default_factory() if f.default is msgspec.NODEFAULT else f.default
                for f in msgspec.structs.fields(SkipEvent) if not f.required}
    assert {"params", "inspected", "origin_params_total"} <= set(defaults) and defaults["inspected"] is True
    where = {"rank": 0, "incarnation": make_batch()["incarnation"]}
    assert got == [dict(defaults, **skip, **where), dict(defaults, **bare, **where), dict(folded, **where),
                   dict(single, count=1, **where), dict(warning, optimizer=None, **where)]
    with sqlite3.connect(config.db) as db:
        bodies = [json.loads(b) for (b,) in db.execute("SELECT body FROM events ORDER BY rowid")]
        assert bodies[1] == {"streak": 8, "inspected": False} and bodies[2] == {"cause": "backoff", "before": 65536.0,
                                                                               "after": 4096.0, "count": 4}
        # A row written before bodies were trimmed (the whole event in its body) reads back the same.
        db.execute("UPDATE events SET body = ? WHERE id = 2", (json.dumps(dict(defaults, **bare)),))
    with TestClient(create_app(config)) as client:
        assert client.get("/v1/runs/exp-42/events").json()["events"] == got
