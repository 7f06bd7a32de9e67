"""Issue 15's takeover attack against a real collector: a second process claiming a live rank is a conflict.

A new incarnation for a rank whose current incarnation is live is shown at once (a restart after a
crash must be), but if the live process sends again, two processes claim the rank: the newcomer is
recorded as a conflict (event, ``ampwatch_rank_conflicts_total``, ``AmpRankConflict``) and put out
(what it counted meanwhile stays counted: counters never go down; its later batches get a 409), and the
live rank's series and alerts carry on. Batches are built by hand (the attacker is not an
agent); the collector is a real ``ampwatch-server`` process.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

pytestmark = pytest.mark.timeout(120)

RUN = "victim-run"
VICTIM = "victim0000000000000000000000000a"
ATTACKER = "attacker00000000000000000000000b"
RESTARTED = "restarted000000000000000000000c"


def _victim(seq: int, **fields) -> dict:
    return make_batch(run=RUN, rank=3, world_size=8, host="node-a", pid=111, incarnation=VICTIM, seq=seq,
                      iteration=10 * seq, optimizers={"gen": optimizer(steps=10 * seq, skipped=seq)}, **fields)


def _attack(seq: int) -> dict:
    # Plausible counters (the 10^12 jump is refused by the plausibility bound: test_security_abuse.py),
    # a close, a foreign host, and an event of its own.
    return make_batch(run=RUN, rank=3, world_size=8, host="attacker", pid=666, incarnation=ATTACKER, seq=seq,
                      iteration=500, closed=True, optimizers={"gen": optimizer(steps=100, skipped=400)},
                      events=[skip_event(seq, iteration=500)])


def _wait_for(condition):
    return wait_until(condition, what="the alert", every=0.1)


def _firing(client: httpx.Client, name: str) -> list:
    return [a["labels"] for a in client.get("/v1/alerts").json()["firing"] if a["name"] == name]


def test_a_second_process_claiming_a_live_rank_is_a_conflict_and_the_live_rank_is_unaffected(tmp_path):
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"silent_after_s": 2, "silent_for_s": 0}))
    args = ["--silent-after", "2", "--expire-after", "600", "--alert-thresholds", str(thresholds)]
    db = str(tmp_path / "ampwatch.db")
    with CollectorProcess(db, args=args) as collector, httpx.Client(base_url=collector.url, timeout=10) as client:
        assert client.post("/v1/ingest", json=_victim(1)).status_code == 200
        # Taken for a restart at first: a crashed process's successor must show at once.
        assert client.post("/v1/ingest", json=_attack(1)).json() == APPLIED
        assert client.post("/v1/ingest", json=_victim(2)).json() == APPLIED  # the live one sends again
        refused = client.post("/v1/ingest", json=_attack(2))
        assert refused.status_code == 409 and refused.json()["retry"] is False
        assert "AMPWATCH_RUN" in refused.json()["message"] and VICTIM in refused.json()["message"]

        (rank,) = client.get(f"/v1/runs/{RUN}").json()["ranks"]
        assert (rank["incarnation"], rank["host"], rank["pid"], rank["closed"]) == (VICTIM, "node-a", 111, False)
        # The claimant's one applied batch stays counted (400 skips): exposed counters never go down.
        assert rank["optimizers"]["gen"]["skipped"] == 2 + 400 and rank["incarnations"] == 1
        assert rank["optimizers"]["gen"]["latest_nonfinite_parameter"] is None  # the claimant's skip named one
        assert [(c["incarnation"], c["host"], c["pid"]) for c in rank["conflicts"]] == [(ATTACKER, "attacker", 666)]
        text = client.get("/metrics").text
        labels = {"run": RUN, "rank": "3"}
        assert value(text, "ampwatch_rank_conflicts_total", **labels) == 1
        assert value(text, "ampwatch_rank_closed", **labels) == 0
        assert value(text, "ampwatch_optimizer_skipped_steps_total", optimizer="gen", **labels) == 2 + 400
        assert value(text, "ampwatch_iteration", **labels) == 20
        (event,) = client.get(f"/v1/runs/{RUN}/events", params={"kind": "rank_conflict"}).json()["events"]
        assert (event["incarnation"], event["host"], event["pid"], event["live_incarnation"]) == \
            (ATTACKER, "attacker", 666, VICTIM)
        assert _wait_for(lambda: _firing(client, "AmpRankConflict")) == [dict(labels, severity="warning")]

        # The victim dies while the attacker keeps sending: its silence is still seen and alerted.
        def attacker_sends_and_victim_is_silent():
            client.post("/v1/ingest", json=_attack(int(time.time() * 10)))
            return _firing(client, "AmpRankSilent")
        assert _wait_for(attacker_sends_and_victim_is_silent) == [dict(labels, severity="warning")]
        collector.kill(signal.SIGTERM)

    # The judgement is stored: after a restart the victim is still the rank and the conflict still counted.
    with CollectorProcess(db, args=args) as collector, httpx.Client(base_url=collector.url, timeout=10) as client:
        (rank,) = client.get(f"/v1/runs/{RUN}").json()["ranks"]
        assert (rank["incarnation"], rank["host"], len(rank["conflicts"])) == (VICTIM, "node-a", 1)
        text = client.get("/metrics").text
        assert value(text, "ampwatch_rank_conflicts_total", run=RUN, rank="3") == 1
        assert value(text, "ampwatch_optimizer_skipped_steps_total", run=RUN, rank="3", optimizer="gen") == 2 + 400
        # Still put out: its batches are refused.
        assert client.post("/v1/ingest", json=_attack(99)).status_code == 409


def test_a_restart_right_after_a_crash_is_not_a_conflict_and_its_counts_add_up(tmp_path):
    # The crashed process was seen a moment ago (live), but it never sends again: no conflict.
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=10) as client:
        assert client.post("/v1/ingest", json=_victim(1)).status_code == 200
        for seq in (1, 2):
            restarted = make_batch(run=RUN, rank=3, world_size=8, host="node-b", pid=222, incarnation=RESTARTED,
                                   seq=seq, iteration=5 * seq, closed=seq == 2,
                                   optimizers={"gen": optimizer(steps=5 * seq, skipped=seq)})
            assert client.post("/v1/ingest", json=restarted).json() == APPLIED
        (rank,) = client.get(f"/v1/runs/{RUN}").json()["ranks"]
        assert (rank["incarnation"], rank["host"], rank["closed"], rank["conflicts"]) == (RESTARTED, "node-b", True, [])
        assert rank["optimizers"]["gen"]["skipped"] == 1 + 2 and rank["incarnations"] == 2
        text = client.get("/metrics").text
        assert value(text, "ampwatch_rank_conflicts_total", run=RUN, rank="3") == 0
        assert client.get(f"/v1/runs/{RUN}/events", params={"kind": "rank_conflict"}).json()["events"] == []
        assert _firing(client, "AmpRankConflict") == []
        # The collector's own event kind cannot be forged by an agent.
        forged = {"id": 9, "kind": "rank_conflict", "time": time.time(), "iteration": 0, "live_incarnation": VICTIM}
        answer = client.post("/v1/ingest", json=make_batch(run="forged", events=[forged]))
        assert answer.status_code == 422 and answer.json()["error"] == "schema"


def test_a_second_watch_in_the_same_process_is_not_a_conflict(tmp_path):
    # A notebook cell run again: a new incarnation from the same process (its secret process key, which every
    # watch() of a process sends) while the first still sends. Host and pid alone: tests/test_security_identity.py.
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=10) as client:
        key = "process0000000000000000000000000"
        again = dict(run=RUN, rank=3, world_size=8, host="node-a", pid=111, incarnation=RESTARTED, process_key=key)
        assert client.post("/v1/ingest", json=_victim(1, process_key=key)).status_code == 200
        assert client.post("/v1/ingest", json=make_batch(**again, seq=1)).json() == APPLIED
        assert client.post("/v1/ingest", json=_victim(2, process_key=key)).json() == APPLIED
        assert client.post("/v1/ingest", json=make_batch(**again, seq=2)).json() == APPLIED
        (rank,) = client.get(f"/v1/runs/{RUN}").json()["ranks"]
        assert (rank["incarnation"], rank["incarnations"], rank["conflicts"]) == (RESTARTED, 2, [])
        assert value(client.get("/metrics").text, "ampwatch_rank_conflicts_total", run=RUN, rank="3") == 0
