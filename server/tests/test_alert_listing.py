"""GET /v1/alerts?collapse=: per-rank alerts of one alert, run and severity as one entry; filters for a group."""

from __future__ import annotations

from ampwatch_support.batches import make_batch, optimizer


def _poisoned(client, rank: int, run: str = "exp-42") -> None:
    batch = make_batch(run=run, rank=rank, incarnation=f"{rank + 1:032x}", world_size=16,
                       optimizers={"gen": optimizer(steps=10, poisoned_steps=1)})
    assert client.post("/v1/ingest", json=batch).status_code == 200


def test_many_alerts_of_one_alert_and_run_are_one_entry_with_their_ranks_and_a_filter_lists_them(client):
    for rank in [*range(0, 6), 9]:
        _poisoned(client, rank)
    _poisoned(client, 0, run="other")
    plain = client.get("/v1/alerts").json()["firing"]
    assert len(plain) == 8
    collapsed = client.get("/v1/alerts", params={"collapse": 5}).json()["firing"]
    group = next(a for a in collapsed if a.get("group"))
    assert (group["name"], group["count"], group["ranks"], group["rank_ranges"]) == ("AmpPoisonedStep", 7, 7, "0-5, 9")
    assert group["labels"] == {"run": "exp-42", "severity": "critical"} and group["status"] == "firing"
    assert [a["labels"]["run"] for a in collapsed if not a.get("group")] == ["other"]  # one alert: its own entry
    members = client.get("/v1/alerts", params={"alertname": "AmpPoisonedStep", "run": "exp-42"}).json()["firing"]
    assert sorted(int(a["labels"]["rank"]) for a in members) == [0, 1, 2, 3, 4, 5, 9]
    assert client.get("/v1/alerts", params={"collapse": 1}).status_code == 422
