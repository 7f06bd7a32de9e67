"""Issue 15's abuse of a real collector: implausible counter jumps, run and event floods, a run list that pages.

Batches are built by hand (an attacker is not an agent); the collector is a real ``ampwatch-server``
process on loopback. A second client identity is a second loopback address: on Linux all of
127.0.0.0/8 is loopback, so a client bound to 127.0.0.2 reaches a collector on 127.0.0.1 and is
seen as another address.
"""

from __future__ import annotations

import time

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value

pytestmark = pytest.mark.timeout(180)

HOUR = 3600.0


def _post(client: httpx.Client, batch: dict) -> httpx.Response:
    return client.post("/v1/ingest", json=batch)


def test_a_counter_jump_of_10_to_the_12_is_refused_with_a_clear_422_and_changes_nothing(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=10) as client:
        now = time.time()
        live = dict(run="victim-run", rank=3, world_size=8, incarnation="live000000000000000000000000000a")
        assert _post(client, make_batch(**live, seq=1, sent_at=now, iteration=100,
                                        optimizers={"gen": optimizer(steps=99, skipped=1)})).status_code == 200
        attacks = [  # the live process's next batch, and a new process's first one
            make_batch(**live, seq=2, sent_at=now + 1, iteration=101,
                       optimizers={"gen": optimizer(steps=100, skipped=10 ** 12)}),
            make_batch(**dict(live, incarnation="attacker000000000000000000000000"), seq=1, sent_at=now,
                       optimizers={"gen": optimizer(skipped=10 ** 12)}),
        ]
        for attack in attacks:
            answer = _post(client, attack)
            assert answer.status_code == 422, answer.text
            body = answer.json()
            assert body["error"] == "implausible" and body["retry"] is False
            assert "state.optimizers['gen'].skipped rose by " in body["message"]
            assert "--max-counter-rate" in body["message"]
        (rank,) = client.get("/v1/runs/victim-run").json()["ranks"]
        assert rank["optimizers"]["gen"]["skipped"] == 1 and rank["incarnations"] == 1
        text = client.get("/metrics").text
        assert value(text, "ampwatch_optimizer_skipped_steps_total", run="victim-run", rank="3", optimizer="gen") == 1
        assert value(text, "ampwatch_collector_rejected_batches_total", reason="implausible") == 2


def test_an_agent_cut_off_for_an_hour_and_a_spool_replay_are_within_the_bound(tmp_path):
    # 1,000 iterations a second for an hour, delivered in one batch after the outage; then a replay of six
    # spooled batches ten minutes apart by their sent_at, arriving back to back.
    rate = 1000
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=10) as client:
        start = time.time() - 2 * HOUR
        for seq, at in enumerate([start, start + HOUR, *(start + HOUR + 600 * k for k in range(1, 7))], 1):
            done = int((at - start) * rate)
            batch = make_batch(run="cut-off", seq=seq, sent_at=at, iteration=done,
                               optimizers={"gen": optimizer(steps=done - done // 100, skipped=done // 100)})
            assert _post(client, batch).json() == APPLIED, seq
        (rank,) = client.get("/v1/runs/cut-off").json()["ranks"]
        assert rank["iteration"] == int(2 * HOUR * rate)


def test_a_flood_of_runs_and_events_from_one_client_leaves_room_for_a_real_job_from_another(tmp_path):
    # Events at 100 a second (bursts of one batch's 10,000): a refill takes 100 s, longer than the test.
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--client-event-rate", "100"]) as collector, \
            httpx.Client(base_url=collector.url, timeout=30) as flooder, \
            httpx.Client(base_url=collector.url, timeout=30,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2")) as job:
        started = time.monotonic()
        answers: dict[int, int] = {}
        for i in range(1000):  # the 1,000 junk runs, as fast as one client can send them
            code = _post(flooder, make_batch(run=f"junk-{i}")).status_code
            answers[code] = answers.get(code, 0) + 1
        flood_s = time.monotonic() - started
        refused = _post(flooder, make_batch(run="junk-one-more"))
        event_answers = [_post(flooder, make_batch(run="junk-0", seq=2 + i, events=[
            skip_event(10_000 * i + k + 1, iteration=10_000 * i + k) for k in range(10_000)])).status_code
            for i in range(10)]
        real = _post(job, make_batch(run="real-job", events=[skip_event(1)]))
        text = flooder.get("/metrics").text
        print(f"\nrun flood: 1000 runs in {flood_s:.1f} s from one address, answers {answers}; ten batches of "
              f"10,000 events: {event_answers}; a real job from another address: {real.status_code}")
    assert real.json() == APPLIED
    # --client-new-runs 300: an hour's worth at once, then one every 12 s.
    assert 300 <= answers[200] <= 300 + flood_s / 12 + 1 and answers[200] + answers[429] == 1000, answers
    assert refused.status_code == 429 and refused.json()["retry"] is True
    assert "--client-new-runs" in refused.json()["message"] and "127.0.0.1" in refused.json()["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert event_answers == [200] + [429] * 9, event_answers
    assert value(text, "ampwatch_collector_rejected_batches_total", reason="client_runs") == answers[429] + 1
    assert value(text, "ampwatch_collector_rejected_batches_total", reason="client_events") == 9


def test_the_run_list_pages_with_a_cursor_newest_first(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector, \
            httpx.Client(base_url=collector.url, timeout=10) as client:
        for i in range(25):
            assert _post(client, make_batch(run=f"run-{i:02d}")).status_code == 200
        seen, cursor, pages = [], None, 0
        while True:
            params = {"limit": 10, **({"after": cursor} if cursor else {})}
            body = client.get("/v1/runs", params=params).json()
            seen += [r["run"] for r in body["runs"]]
            pages += 1
            cursor = body["next"]
            if cursor is None:
                break
        assert pages == 3 and sorted(seen) == [f"run-{i:02d}" for i in range(25)] and len(set(seen)) == 25
        last_seen = [r["last_seen"] for r in client.get("/v1/runs", params={"limit": 1000}).json()["runs"]]
        assert last_seen == sorted(last_seen, reverse=True)
        assert client.get("/v1/runs", params={"after": "not a cursor"}).status_code == 422
