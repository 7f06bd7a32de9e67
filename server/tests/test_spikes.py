"""Loss and gradient-norm spikes at the collector: counters summed over a rank's processes, levels from the newest,
the events stored and listed, and the kinds every 2xx answer lists (docs/protocol.md#kinds-a-collector-lists)."""

from __future__ import annotations

from ampwatch.contract.protocol import LISTED_EVENT_KINDS
from ampwatch_support.batches import APPLIED, DUPLICATE, make_batch, optimizer
from ampwatch_support.exposition import value

INC_A, INC_B = "a" * 32, "b" * 32
R0 = {"run": "exp-42", "rank": "0"}


def spike(id: int, kind: str, iteration: int, value: float | str, **more) -> dict:
    """A ``loss_spike`` or ``grad_norm_spike`` as the agent sends it (``more``: optimizer, local, samples)."""
    finite = not isinstance(value, str)
    return {"id": id, "kind": kind, "time": 1_764_400_000.0 + iteration, "iteration": iteration, "value": value,
            "mean": 2.0, "std": 0.25, "z": (value - 2.0) / 0.25 if finite else None, "streak": 1, **more}


def batch(incarnation: str, seq: int, loss_spikes: int, grad_norm_spikes: int, loss: dict | None = None,
          grad_norm: dict | None = None, events: list | None = None) -> dict:
    levels = {"grad_norm": grad_norm} if grad_norm else {}
    b = make_batch(incarnation=incarnation, seq=seq, iteration=10 * seq, events=events,
                   optimizers={"gen": optimizer(steps=10 * seq, grad_norm_spikes=grad_norm_spikes, **levels)})
    b["state"]["loss_spikes"] = loss_spikes
    if loss:
        b["state"]["loss"] = loss
    return b


def test_spike_counters_sum_over_a_ranks_processes_and_the_levels_are_the_newest_processs(client):
    client.post("/v1/ingest", json=batch(INC_A, 1, loss_spikes=3, grad_norm_spikes=2,
                                         loss={"mean": 2.0, "std": 0.5}, grad_norm={"mean": 7.0, "std": 1.0}))
    client.post("/v1/ingest", json=batch(INC_B, 1, loss_spikes=1, grad_norm_spikes=4,
                                         loss={"mean": 3.0, "std": 0.25}))
    text = client.get("/metrics").text
    assert value(text, "ampwatch_loss_spikes_total", **R0) == 4
    assert value(text, "ampwatch_optimizer_grad_norm_spikes_total", optimizer="gen", **R0) == 6
    assert (value(text, "ampwatch_loss_mean", **R0), value(text, "ampwatch_loss_std", **R0)) == (3.0, 0.25)
    # The newest process has no gradient-norm level yet (a fresh window): none is shown, not the old process's.
    assert value(text, "ampwatch_optimizer_grad_norm_mean", optimizer="gen", **R0) is None
    # A counter that goes down within a process never makes the total fall.
    client.post("/v1/ingest", json=batch(INC_B, 2, loss_spikes=0, grad_norm_spikes=5))
    text = client.get("/metrics").text
    assert value(text, "ampwatch_loss_spikes_total", **R0) == 4
    assert value(text, "ampwatch_optimizer_grad_norm_spikes_total", optimizer="gen", **R0) == 7
    # A batch without levels keeps the ones its process sent last (an agent sends them one heartbeat in four).
    assert (value(text, "ampwatch_loss_mean", **R0), value(text, "ampwatch_loss_std", **R0)) == (3.0, 0.25)
    client.post("/v1/ingest", json=batch(INC_B, 3, loss_spikes=0, grad_norm_spikes=5, loss={"mean": 2.5, "std": 0.5},
                                         grad_norm={"mean": 6.0, "std": 2.0}))
    client.post("/v1/ingest", json=batch(INC_B, 4, loss_spikes=0, grad_norm_spikes=5))
    text = client.get("/metrics").text
    assert (value(text, "ampwatch_loss_mean", **R0), value(text, "ampwatch_loss_std", **R0)) == (2.5, 0.5)
    assert value(text, "ampwatch_optimizer_grad_norm_std", optimizer="gen", **R0) == 2.0
    run = client.get("/v1/runs/exp-42").json()
    assert run["ranks"][0]["optimizers"]["gen"]["grad_norm"] == {"mean": 6.0, "std": 2.0}


def test_spike_events_are_stored_and_listed_with_non_finite_values_as_the_protocol_writes_them(client):
    events = [spike(1, "loss_spike", 7, 9.5, samples={"ids": [3, 4], "count": 2, "digest": "d" * 16}),
              spike(2, "grad_norm_spike", 8, "Infinity", optimizer="gen"),
              spike(3, "grad_norm_spike", 8, 40.0, optimizer="gen", local=True)]
    assert client.post("/v1/ingest", json=batch(INC_A, 1, 1, 2, events=events)).json() == APPLIED
    listed = client.get("/v1/runs/exp-42/events").json()["events"]
    where = {"rank": 0, "incarnation": INC_A}
    assert listed == [dict(events[0], **where),
                      dict(events[1], local=False, samples=None, **where),
                      dict(events[2], samples=None, **where)]
    assert listed[0]["samples"]["ids"] == [3, 4] and listed[1]["value"] == "Infinity" and listed[1]["z"] is None
    only = client.get("/v1/runs/exp-42/events", params={"kind": "grad_norm_spike"}).json()["events"]
    assert [e["id"] for e in only] == [2, 3]
    latest = client.get("/v1/runs/exp-42/events/latest").json()["rows"]
    assert sorted(row["event"]["kind"] for row in latest) == ["grad_norm_spike", "grad_norm_spike", "loss_spike"]


def test_every_2xx_answer_lists_the_kinds_added_to_protocol_1_and_a_refusal_lists_none(client):
    assert APPLIED["kinds"] == DUPLICATE["kinds"] == ["loss_spike", "grad_norm_spike"] == list(LISTED_EVENT_KINDS)
    first = batch(INC_A, 1, 0, 0)
    assert client.post("/v1/ingest", json=first).json() == APPLIED
    assert client.post("/v1/ingest", json=first).json() == DUPLICATE
    refused = client.post("/v1/ingest", json=dict(first, rank=-1))
    assert refused.status_code == 422 and "kinds" not in refused.json()


def test_a_loss_and_a_gradient_norm_spike_fire_their_alerts_on_the_rank_and_optimizer(client):
    client.post("/v1/ingest", json=batch(INC_A, 1, loss_spikes=0, grad_norm_spikes=0))
    firing = lambda: {(a["name"], a["labels"].get("optimizer")) for a in  # noqa: E731
                      client.get("/v1/alerts").json()["firing"] if a["name"] in ("AmpLossSpike", "AmpGradNormSpike")}
    assert firing() == set()
    client.post("/v1/ingest", json=batch(INC_A, 2, loss_spikes=1, grad_norm_spikes=1))
    assert firing() == {("AmpLossSpike", None), ("AmpGradNormSpike", "gen")}
