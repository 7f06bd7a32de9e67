"""Who owns a rank: every row of docs/protocol.md#who-owns-a-rank, against a real collector process.

A rank hears from restarts, second ``watch()`` calls, dead processes' spools replayed by live ones,
second jobs with the same run id and forgers holding the ingest token. Each test sends what those
send, as real requests, and reads what the rank shows (``GET /v1/runs/{run}``, ``/metrics``). Batches are
built by hand so that each case is exactly the row it names; the agent's side of a replay (the mark it
puts on another process's spooled batch) is tested in agent/tests/test_spool.py.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
import uuid
from typing import Any

import httpx
import pytest

from ampwatch_support.batches import APPLIED, DUPLICATE, make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value

pytestmark = pytest.mark.timeout(180)

# A process seen within this long is live; far above any test's length, so none turns silent meanwhile.
SILENT_AFTER_S = 600
ARGS = ["--silent-after", str(SILENT_AFTER_S), "--expire-after", "3600"]


class Process:
    """One agent process as the collector sees it: its secret key and its current ``watch()``'s incarnation."""

    def __init__(self, run: str, *, rank: int = 3, host: str = "node-a", pid: int = 111, keyed: bool = True) -> None:
        self.run, self.rank, self.host, self.pid = run, rank, host, pid
        self.key: str | None = uuid.uuid4().hex if keyed else None
        self.incarnation = uuid.uuid4().hex
        self.seq = 0

    def watch_again(self) -> Process:
        """A second ``watch()`` in this process: a new incarnation, the same key."""
        again = Process(self.run, rank=self.rank, host=self.host, pid=self.pid)
        again.key = self.key
        return again

    def batch(self, *, skipped: int = 0, iteration: int = 0, closed: bool = False, **fields: Any) -> dict:
        """This process's next batch, ``skipped`` its cumulative skips."""
        self.seq += 1
        key = {"process_key": self.key} if self.key is not None else {}
        return make_batch(run=self.run, rank=self.rank, world_size=8, host=self.host, pid=self.pid,
                          incarnation=self.incarnation, seq=self.seq, sent_at=time.time(), iteration=iteration,
                          closed=closed, optimizers={"gen": optimizer(steps=iteration, skipped=skipped)},
                          **key, **fields)


def replayed(batch: dict) -> dict:
    """``batch`` as another process sends it from a dead one's spool (agent/_outbox.py: ``Pending.load``)."""
    return {"replayed": True, **batch}


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    with CollectorProcess(str(tmp_path_factory.mktemp("ownership") / "ampwatch.db"), args=ARGS) as running:
        yield running


@pytest.fixture
def client(collector):
    with httpx.Client(base_url=collector.url, timeout=30) as c:
        yield c


def _run() -> str:
    return "own-" + uuid.uuid4().hex[:12]


def _applied(client: httpx.Client, batch: dict) -> None:
    answer = client.post("/v1/ingest", json=batch)
    assert answer.json() == APPLIED, answer.text


def _rank(client: httpx.Client, run: str, rank: int = 3) -> dict:
    (found,) = [r for r in client.get(f"/v1/runs/{run}").json()["ranks"] if r["rank"] == rank]
    return found


def _owner(client: httpx.Client, run: str, rank: int = 3) -> tuple:
    r = _rank(client, run, rank)
    return r["incarnation"], r["pid"], r["closed"], r["optimizers"]["gen"]["skipped"], \
        [c["incarnation"] for c in r["conflicts"]]


def _conflicts_total(client: httpx.Client, run: str, rank: int = 3) -> float:
    return value(client.get("/metrics").text, "ampwatch_rank_conflicts_total", run=run, rank=str(rank))


# Rows 1 and 2.
def test_a_ranks_first_batch_makes_its_process_the_owner(client):
    run = _run()
    first = Process(run)
    _applied(client, first.batch(skipped=1, iteration=10))
    assert _owner(client, run) == (first.incarnation, 111, False, 1, [])
    _applied(client, first.batch(skipped=2, iteration=20))
    assert _owner(client, run) == (first.incarnation, 111, False, 2, [])
    assert _rank(client, run)["keyless"] is False


# Row 3.
def test_a_batch_sent_again_is_a_duplicate_and_changes_nothing(client):
    run = _run()
    process = Process(run)
    one, two = process.batch(skipped=1, iteration=10), process.batch(skipped=3, iteration=20)
    _applied(client, one)
    _applied(client, two)
    for again in (two, one):
        assert client.post("/v1/ingest", json=again).json() == DUPLICATE
    assert _owner(client, run) == (process.incarnation, 111, False, 3, [])


# Row 4.
def test_a_second_watch_in_the_same_process_owns_the_rank_without_a_claim(client):
    run = _run()
    first = Process(run)
    _applied(client, first.batch(skipped=1))
    second = first.watch_again()
    _applied(client, second.batch(skipped=2))
    _applied(client, first.batch(skipped=4))  # the first watch() still sends: its history, no claim
    _applied(client, second.batch(skipped=3))
    assert _owner(client, run) == (second.incarnation, 111, False, 4 + 3, [])
    assert _conflicts_total(client, run) == 0


# Rows 5 and 6: the host plays no part.
@pytest.mark.parametrize("host", ["node-a", "node-b"], ids=["same host", "other host"])
def test_a_restart_owns_the_rank_at_once_and_the_counts_add_up(client, host):
    run = _run()
    crashed = Process(run)
    _applied(client, crashed.batch(skipped=5, iteration=50))
    restarted = Process(run, host=host, pid=222)
    _applied(client, restarted.batch(skipped=1, iteration=5))  # the crashed one looked live a moment ago
    assert _owner(client, run) == (restarted.incarnation, 222, False, 5 + 1, [])
    _applied(client, restarted.batch(skipped=2, iteration=10, closed=True))
    assert _owner(client, run) == (restarted.incarnation, 222, True, 5 + 2, [])
    assert _rank(client, run)["host"] == host and _rank(client, run)["incarnations"] == 2
    assert _conflicts_total(client, run) == 0


# Row 7.
def test_every_rank_restarted_by_an_elastic_launcher_is_owned_by_its_new_process(client):
    run, ranks = _run(), range(4)
    first = {r: Process(run, rank=r, host=f"node-{r // 2}", pid=100 + r) for r in ranks}
    for r in ranks:
        _applied(client, first[r].batch(skipped=r, iteration=10))
    # Every worker restarted at once; a new rendezvous may put a rank on another host.
    second = {r: Process(run, rank=r, host=f"node-{(r + 1) % 4 // 2}", pid=200 + r) for r in ranks}
    for r in ranks:
        _applied(client, second[r].batch(skipped=1, iteration=1))
    for r in ranks:
        _applied(client, second[r].batch(skipped=2, iteration=2))
        assert _owner(client, run, r) == (second[r].incarnation, 200 + r, False, r + 2, [])
        assert _conflicts_total(client, run, r) == 0


# Row 8.
def test_repeated_restarts_leave_the_newest_owning_and_every_count_counted(client):
    run = _run()
    processes = [Process(run, pid=300 + i) for i in range(4)]
    for i, process in enumerate(processes):
        _applied(client, process.batch(skipped=10 ** i, iteration=i))
        assert _owner(client, run)[:2] == (process.incarnation, 300 + i)
    assert _owner(client, run) == (processes[-1].incarnation, 303, False, 1111, [])
    assert _rank(client, run)["incarnations"] == 4


# Row 9: issue 37 item 6. Without the mark, or with a collector that ignores it, the dead process's late
# batch took the rank back and put the successor out for good (409 on every later batch).
def test_a_dead_processs_spool_replayed_after_its_successor_reported_is_history(client):
    run = _run()
    dead = Process(run, pid=111)
    _applied(client, dead.batch(skipped=1, iteration=10))
    # Its last batches never reached the collector: they wait in the host's shared spool when it dies.
    spooled = [dead.batch(skipped=3, iteration=20), dead.batch(skipped=4, iteration=30, closed=True)]
    # Never heard of before: a process whose every batch waited in the spool.
    unseen = Process(run, pid=112)
    unseen_spool = [unseen.batch(skipped=7, iteration=5), unseen.batch(skipped=8, iteration=6)]
    successor = Process(run, pid=222)
    _applied(client, successor.batch(skipped=1, iteration=1))
    for batch in (*spooled, *unseen_spool):  # a sibling rank's process adopts the spools and replays them
        _applied(client, replayed(batch))
        assert _owner(client, run)[:3] == (successor.incarnation, 222, False)
    _applied(client, successor.batch(skipped=2, iteration=2))
    assert _owner(client, run) == (successor.incarnation, 222, False, 4 + 8 + 2, [])
    assert _rank(client, run)["incarnations"] == 3 and _conflicts_total(client, run) == 0
    assert client.get(f"/v1/runs/{run}/events", params={"kind": "rank_conflict"}).json()["events"] == []
    # A replay says nothing of its process being alive: the rank was last seen at the successor's batch.
    last_seen = _rank(client, run)["last_seen"]
    _applied(client, replayed(unseen.batch(skipped=9, iteration=7)))
    assert _rank(client, run)["last_seen"] == last_seen


# Rows 10, 12 and 15.
def test_the_displaced_process_sending_again_owns_the_rank_again_within_one_batch(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    claimant = Process(run, host="attacker", pid=666)
    _applied(client, claimant.batch(skipped=40, iteration=500))
    assert _owner(client, run)[:2] == (claimant.incarnation, 666)  # a restart must show at once
    _applied(client, live.batch(skipped=2, iteration=20))
    assert _owner(client, run) == (live.incarnation, 111, False, 2 + 40, [claimant.incarnation])
    refused = client.post("/v1/ingest", json=claimant.batch(skipped=41, iteration=501))
    assert refused.status_code == 409 and refused.json()["error"] == "conflict", refused.text
    assert refused.json()["retry"] is False and live.incarnation in refused.json()["message"]
    (event,) = client.get(f"/v1/runs/{run}/events", params={"kind": "rank_conflict"}).json()["events"]
    assert (event["incarnation"], event["live_incarnation"], event["pid"]) == (claimant.incarnation,
                                                                               live.incarnation, 666)
    assert _conflicts_total(client, run) == 1


# Row 11.
def test_a_batch_under_a_known_incarnation_with_another_key_or_none_is_refused(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    shown = _rank(client, run)
    for key in (uuid.uuid4().hex, None):
        forger = Process(run, host=shown["host"], pid=shown["pid"], keyed=key is not None)
        forger.incarnation, forger.key, forger.seq = shown["incarnation"], key, 10 ** 12 - 1
        answer = client.post("/v1/ingest", json=forger.batch(skipped=2, closed=True))
        assert answer.status_code == 409 and answer.json()["retry"] is False, answer.text
    assert _owner(client, run) == (live.incarnation, 111, False, 1, [])
    _applied(client, live.batch(skipped=2, iteration=20))  # not taken for a duplicate of seq 10^12
    assert _owner(client, run) == (live.incarnation, 111, False, 2, [])


# Row 13.
def test_a_forged_close_shows_until_the_live_owners_next_batch(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    forger = Process(run, host="node-a", pid=111)
    _applied(client, forger.batch(closed=True))
    assert _owner(client, run)[2] is True
    _applied(client, live.batch(skipped=1, iteration=20))
    assert _owner(client, run) == (live.incarnation, 111, False, 1, [forger.incarnation])


# Row 14: issue 37 item 8. The second forger used to displace the first (closed), not the live process,
# so the live process's batches were answered 200 and never made it the rank again.
def test_forged_incarnations_in_a_row_are_all_put_out_by_the_owners_next_batch(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    forgers = [Process(run, host="attacker", pid=600 + i) for i in range(3)]
    for i, forger in enumerate(forgers):
        _applied(client, forger.batch(closed=i == 0, loss_scale=1.0))
    assert _owner(client, run)[:2] == (forgers[-1].incarnation, 602)
    _applied(client, live.batch(skipped=2, iteration=20))
    owner = _owner(client, run)
    assert owner[:4] == (live.incarnation, 111, False, 2) and sorted(owner[4]) == \
        sorted(f.incarnation for f in forgers)
    assert _rank(client, run)["loss_scale"] == 65536.0 and _conflicts_total(client, run) == 3
    for forger in forgers:
        assert client.post("/v1/ingest", json=forger.batch()).status_code == 409


# Row 16: a claimant that forgot, after its second batch, which process it displaced kept the rank.
def test_a_claimant_keeps_its_claim_over_its_later_batches(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    claimant = Process(run, host="attacker", pid=666)
    for skipped in (1, 2, 3):
        _applied(client, claimant.batch(skipped=skipped, iteration=skipped))
    _applied(client, live.batch(skipped=1, iteration=20))
    assert _owner(client, run) == (live.incarnation, 111, False, 1 + 3, [claimant.incarnation])


# Row 17: a closed incarnation reopened on its next batch.
def test_a_closed_incarnation_stays_closed_on_a_later_batch(client):
    run = _run()
    process = Process(run)
    _applied(client, process.batch(skipped=1, iteration=10, closed=True))
    _applied(client, process.batch(skipped=2, iteration=11))  # a batch built after close() (or reordered)
    assert _owner(client, run) == (process.incarnation, 111, True, 2, [])
    assert value(client.get("/metrics").text, "ampwatch_rank_closed", run=run, rank="3") == 1


# Row 18: issue 37 item 7, for a rank that has shown a key.
def test_a_keyless_batch_never_owns_or_closes_a_rank_that_has_shown_a_key(client):
    run = _run()
    live = Process(run)
    _applied(client, live.batch(skipped=1, iteration=10))
    keyless = Process(run, host="attacker", pid=666, keyed=False)
    _applied(client, keyless.batch(skipped=5, iteration=10 ** 6, closed=True))
    _applied(client, keyless.batch(skipped=6, iteration=10 ** 6))
    assert _owner(client, run) == (live.incarnation, 111, False, 1 + 6, [])
    assert _rank(client, run)["iteration"] == 10 and _rank(client, run)["keyless"] is False
    _applied(client, live.batch(skipped=2, iteration=20))  # it claimed a live process: a conflict now
    assert _owner(client, run) == (live.incarnation, 111, False, 2 + 6, [keyless.incarnation])
    assert client.post("/v1/ingest", json=keyless.batch()).status_code == 409


# Row 19: issue 37 item 7, for a rank whose agents send no key.
def test_a_keyless_rank_is_marked_and_a_collector_may_refuse_keyless_batches(client, tmp_path):
    run = _run()
    old_agent = Process(run, keyed=False)
    _applied(client, old_agent.batch(skipped=1, iteration=10))
    assert _rank(client, run)["keyless"] is True
    restarted = Process(run, pid=222, keyed=False)
    _applied(client, restarted.batch(skipped=1, iteration=1))
    assert _owner(client, run)[:2] == (restarted.incarnation, 222)
    # What docs/security.md says a token holder can still do to such a rank: speak for its own incarnation.
    forger = Process(run, host="attacker", pid=666, keyed=False)
    forger.incarnation, forger.seq = restarted.incarnation, 10 ** 12 - 1
    _applied(client, forger.batch(skipped=1, iteration=1, closed=True))
    assert _owner(client, run)[:3] == (restarted.incarnation, 666, True)
    assert client.post("/v1/ingest", json=restarted.batch(skipped=2, iteration=2)).json() == \
        DUPLICATE
    # An operator who has upgraded every agent refuses keyless batches altogether.
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=[*ARGS, "--require-process-key"]) as strict, \
            httpx.Client(base_url=strict.url, timeout=30) as other:
        refused = other.post("/v1/ingest", json=Process(run, keyed=False).batch(skipped=1))
        assert refused.status_code == 422, refused.text
        assert (refused.json()["error"], refused.json()["retry"]) == ("process_key", False)
        assert "--require-process-key" in refused.json()["message"]
        _applied(other, Process(run).batch(skipped=1))
        assert value(other.get("/metrics").text, "ampwatch_collector_rejected_batches_total",
                     reason="process_key") == 1


# Row 20.
def test_ownership_outlives_a_collector_restart(tmp_path):
    db, run = str(tmp_path / "ampwatch.db"), _run()
    live, dead, successor = Process(run, rank=0), Process(run, rank=1), Process(run, rank=1, pid=222)
    forgers = [Process(run, rank=0, host="attacker", pid=600 + i) for i in range(2)]
    with CollectorProcess(db, args=ARGS) as collector, httpx.Client(base_url=collector.url, timeout=30) as client:
        _applied(client, live.batch(skipped=1, iteration=10))
        for forger in forgers:
            _applied(client, forger.batch(closed=True))
        _applied(client, dead.batch(skipped=1, iteration=10))
        spooled = dead.batch(skipped=2, iteration=20)
        _applied(client, successor.batch(skipped=1, iteration=1))
        collector.kill(signal.SIGTERM)
    with CollectorProcess(db, args=ARGS) as collector, httpx.Client(base_url=collector.url, timeout=30) as client:
        # Both forgers' claims on rank 0 were stored: the live process's next batch puts both out.
        _applied(client, live.batch(skipped=2, iteration=20))
        owner = _owner(client, run, 0)
        assert owner[:3] == (live.incarnation, 111, False) and sorted(owner[4]) == \
            sorted(f.incarnation for f in forgers)
        _applied(client, replayed(spooled))
        _applied(client, successor.batch(skipped=2, iteration=2))
        assert _owner(client, run, 1) == (successor.incarnation, 222, False, 2 + 2, [])
        collector.kill(signal.SIGTERM)
    with CollectorProcess(db, args=ARGS) as collector, httpx.Client(base_url=collector.url, timeout=30) as client:
        assert _owner(client, run, 0)[:3] == (live.incarnation, 111, False)
        assert _owner(client, run, 1) == (successor.incarnation, 222, False, 4, [])
        assert json.loads(json.dumps(_rank(client, run, 0)["conflicts"]))  # still listed


# Row 21: nobody is left to contradict a newcomer; the old process's later batches are its history.
def test_a_newcomer_after_the_ranks_process_closed_or_fell_silent_claims_nothing(client, tmp_path):
    run = _run()
    closed = Process(run)
    _applied(client, closed.batch(skipped=1, iteration=10, closed=True))
    newcomer = Process(run, pid=222)
    _applied(client, newcomer.batch(skipped=1, iteration=1))
    _applied(client, closed.batch(skipped=2, iteration=11))  # a batch it built after close(), arriving late
    assert _owner(client, run) == (newcomer.incarnation, 222, False, 2 + 1, [])
    # Silent past --silent-after (1 s on this collector): no longer live when the newcomer appears.
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--silent-after", "1"]) as quick, \
            httpx.Client(base_url=quick.url, timeout=30) as other:
        silent = Process(run)
        _applied(other, silent.batch(skipped=1, iteration=10))
        last_seen = _rank(other, run)["last_seen"]
        time.sleep(max(0.0, last_seen + 1.5 - time.time()))  # only its batch's age matters, not this machine's pace
        newcomer = Process(run, pid=222)
        _applied(other, newcomer.batch(skipped=1, iteration=1))
        _applied(other, silent.batch(skipped=2, iteration=20))  # it wakes up: two processes, but no claim was made
        assert _owner(other, run) == (newcomer.incarnation, 222, False, 2 + 1, [])


# Row 9, what a replay shows: not the rank's latest offending parameter, not a later sign of life.
def test_a_replay_neither_names_the_latest_parameter_nor_dates_the_rank_ahead(client):
    run = _run()
    successor = Process(run, pid=222)
    _applied(client, successor.batch(skipped=1, iteration=1,
                                     events=[skip_event(1, iteration=1, params=("successor.weight",))]))
    dead = Process(run, pid=111)
    spooled = dead.batch(skipped=1, iteration=5, events=[skip_event(1, iteration=5, params=("dead.weight",))])
    spooled["sent_at"] = time.time() + 3600  # a clock an hour ahead, or a forger's
    _applied(client, replayed(spooled))
    rank = _rank(client, run)
    assert rank["optimizers"]["gen"]["latest_nonfinite_parameter"] == "successor.weight"
    assert rank["optimizers"]["gen"]["skipped"] == 2 and rank["last_seen"] <= time.time()


# Row 20, across an upgrade: a collector before the list of displaced processes stored one id as a string.
def test_a_claim_stored_by_an_earlier_collector_is_judged_after_an_upgrade(tmp_path):
    db, run = str(tmp_path / "ampwatch.db"), _run()
    live, claimant = Process(run), Process(run, host="attacker", pid=666)
    with CollectorProcess(db, args=ARGS) as collector, httpx.Client(base_url=collector.url, timeout=30) as client:
        _applied(client, live.batch(skipped=1, iteration=10))
        _applied(client, claimant.batch(skipped=1, iteration=1))
        collector.kill(signal.SIGTERM)
    with sqlite3.connect(db) as conn:  # the claim as an earlier collector wrote it
        (stored,) = conn.execute("SELECT counters FROM incarnations WHERE incarnation = ?",
                                 (claimant.incarnation,)).fetchone()
        counters = json.loads(stored)
        assert counters["displaced"] == [live.incarnation]
        counters["displaced"] = live.incarnation
        conn.execute("UPDATE incarnations SET counters = ? WHERE incarnation = ?",
                     (json.dumps(counters), claimant.incarnation))
    with CollectorProcess(db, args=ARGS) as collector, httpx.Client(base_url=collector.url, timeout=30) as client:
        _applied(client, live.batch(skipped=2, iteration=20))
        assert _owner(client, run) == (live.incarnation, 111, False, 2 + 1, [claimant.incarnation])
