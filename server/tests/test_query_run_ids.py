"""Run ids with "/" (e.g. "team/exp-1", as launchers and sweep tools name runs) work in every /v1/runs route."""

from __future__ import annotations

import urllib.parse

import pytest

from ampwatch_support.batches import make_batch, optimizer, skip_event


@pytest.mark.parametrize("run", ["team/exp-1", "a/b/c", "sweep/lr=1e-3/seed 0"])
def test_a_run_id_with_slashes_answers_its_run_and_its_events_whether_quoted_or_not(client, run):
    batch = make_batch(run=run, optimizers={"gen": optimizer(steps=3, skipped=1)},
                       events=[skip_event(1, params=("head.weight",))])
    assert client.post("/v1/ingest", json=batch).status_code == 200
    for path in (urllib.parse.quote(run, safe=""), urllib.parse.quote(run, safe="/")):
        answer = client.get(f"/v1/runs/{path}")
        assert answer.status_code == 200, answer.text
        assert answer.json()["run"] == run and answer.json()["ranks"][0]["optimizers"]["gen"]["skipped"] == 1
        events = client.get(f"/v1/runs/{path}/events", params={"kind": "skip"})
        assert events.status_code == 200, events.text
        assert [(e["kind"], e["params"][0]["name"]) for e in events.json()["events"]] == [("skip", "head.weight")]


def test_an_unknown_run_with_a_slash_is_a_404_that_says_where_to_look(client):
    for path in ("/v1/runs/team%2Fnope", "/v1/runs/team/nope", "/v1/runs/team/nope/events"):
        answer = client.get(path)
        assert answer.status_code == 404 and "GET /v1/runs" in answer.json()["detail"], path
