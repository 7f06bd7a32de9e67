"""Listed event kinds (loss_spike, grad_norm_spike) go only to a collector that takes them.

| # | the collector's answers | the agent's listed events |
|---|---|---|
| 1 | none yet | sent at once with the others, in order, with their own ids: nothing waits |
| 2 | a real collector from before them: refuses (422) | that batch once more at once without them; later ones |
|   | the first batch holding one, answers without `kinds` | dropped; all in `dropped_events`, none rejected; one |
|   |                                                      | warning names collector and kinds |
| 3 | without `kinds`, then with them (upgraded) | dropped, then sent again |
| 4 | through the node relay: each v2 result, with or without `kinds` | as 1-3, per rank |
| 5 | a spooled batch holding one, replayed to a collector never heard | sent once more without it; the next spooled |
|   | from, which refuses it (422)                                     | one is sent without it at once; counted |

Each row is the test of the same number below, in order.

The collector that lists the kinds is the recording collector of ``ampwatch_support`` (answering as the collector of
issue 40 does: ``"kinds"`` in each 2xx answer and v2 result) until that collector lands; the older one is the real
collector of the commit before the kinds were declared (it refuses a batch holding one: a leak fails the test).
"""

from __future__ import annotations

import logging

import httpx
import pytest

from ampwatch.contract.protocol import LISTED_EVENT_KINDS
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.delivery_harness import StandInRecorder, make_sender
from ampwatch_support.exposition import scrape, value
from ampwatch_support.older_collector import BEFORE_LISTED_KINDS, older_collector
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(120)

LISTING = list(LISTED_EVENT_KINDS)


def _kinds(batches: list[dict]) -> list[tuple[str, int]]:
    return [(e["kind"], e["id"]) for b in batches for e in b["events"]]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "does not take" in r.getMessage()]


def test_a_spike_goes_at_once_in_order_with_its_own_id_before_any_answer():
    with RecordingCollector() as server:
        server.kinds = LISTING
        recorder = StandInRecorder()  # the events are there before the sender's first batch
        recorder.spike()  # id 1
        recorder.skip()  # id 2
        recorder.spike("grad_norm_spike")  # id 3
        sender, _ = make_sender(server.url, recorder=recorder)
        assert server.wait_for(lambda s: sum(len(b["events"]) for b in s.acked) >= 3)
        sender.close(SETTLE_S)
    assert _kinds(server.acked) == [("loss_spike", 1), ("skip", 2), ("grad_norm_spike", 3)]
    assert _kinds(server.acked[:1]) == _kinds(server.acked), "the first batch carries them all: nothing waited"
    assert sender.delivery["dropped_events"] == 0


def test_an_older_collector_gets_no_listed_kind_and_each_one_is_counted_as_dropped_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "ampwatch.agent")
    env = older_collector(BEFORE_LISTED_KINDS, tmp_path / "old", "the last collector before the listed kinds")
    with CollectorProcess(str(tmp_path / "ampwatch.db"), env=env) as collector:
        recorder = StandInRecorder()
        recorder.spike()  # in the first batch, which this collector refuses: sent once more without it
        recorder.skip()
        sender, _ = make_sender(collector.url, recorder=recorder)
        wait_until(lambda: sender.batches_acked >= 1, what="the first answer")
        recorder.spike("grad_norm_spike")  # dropped at once
        recorder.skip()
        recorder.spike()
        sender.close(SETTLE_S)
        text = scrape(collector.url)
        events = httpx.get(f"{collector.url}/v1/runs/test-run/events", params={"limit": 100}, timeout=10).json()
    assert [e["kind"] for e in events["events"]] == ["skip", "skip"]
    assert value(text, "ampwatch_collector_ingest_requests_total", code="422") == 1  # the first batch, once
    assert sender.rejected_batches == 0
    assert value(text, "ampwatch_agent_dropped_events_total", run="test-run", rank="0") == 3
    assert sender.delivery["dropped_events"] == 3
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and collector.url in warnings[0]
    assert all(kind in warnings[0] for kind in LISTED_EVENT_KINDS)


def test_a_collector_upgraded_while_the_job_runs_gets_the_spikes_after_its_first_answer_listing_them(caplog):
    caplog.set_level(logging.WARNING, "ampwatch.agent")
    with RecordingCollector() as server:
        server.kinds = None  # answers as a collector from before the kinds
        sender, recorder = make_sender(server.url)
        wait_until(lambda: sender.batches_acked >= 1, what="the first answer")
        recorder.spike()
        recorder.skip()
        assert server.wait_for(lambda s: any(e["kind"] == "skip" for b in s.acked for e in b["events"]))
        server.kinds = LISTING  # upgraded: its next answer lists the kinds
        recorder.skip()
        assert server.wait_for(lambda s: sum(e["kind"] == "skip" for b in s.acked for e in b["events"]) == 2)
        recorder.spike("grad_norm_spike")
        sender.close(SETTLE_S)
    assert [k for k, _ in _kinds(server.acked)] == ["skip", "skip", "grad_norm_spike"]
    assert len(server.received) == len(server.acked)
    assert sender.delivery["dropped_events"] == 1
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("kinds", [LISTING, None], ids=["listing", "older"])
def test_through_the_node_relay_each_rank_sends_the_spikes_only_where_its_result_listed_them(tmp_path, kinds):
    with RecordingCollector() as server:
        server.kinds = kinds
        pairs = [make_sender(server.url, rank=r, world_size=2, relay=True, relay_dir=str(tmp_path / "relay"),
                             push_interval=1.0) for r in (0, 1)]
        try:
            # Both ranks' heartbeats come through the relay once both have found it: one request, two batches.
            assert server.wait_for(lambda s: s.requests < len(s.received)), "no request carried both ranks' batches"
            for _, recorder in pairs:
                recorder.spike()
                recorder.skip()
            assert server.wait_for(lambda s: sum(e["kind"] == "skip" for b in s.acked for e in b["events"]) == 2)
        finally:
            for sender, _ in pairs:
                sender.close(SETTLE_S)
    assert len(server.received) == len(server.acked), "no batch was refused"
    for rank, (sender, _) in enumerate(pairs):
        sent = [k for b in server.acked if b["rank"] == rank for k, _ in _kinds([b])]
        assert sent == (["loss_spike", "skip"] if kinds else ["skip"])
        assert sender.delivery["dropped_events"] == (0 if kinds else 1)


def test_spooled_spikes_replayed_to_an_older_collector_are_sent_without_them_and_counted(tmp_path):
    with RecordingCollector() as server:
        server.kinds = LISTING
        first, recorder = make_sender(server.url, spool_dir=str(tmp_path), push_interval=3600.0)  # no heartbeat
        wait_until(lambda: first.batches_acked >= 1, what="the first answer, listing the kinds")
        server.status = 503
        for spooled in (1, 2):  # two spooled batches, each holding a spike and a skip
            recorder.spike()
            recorder.skip()
            wait_until(lambda: len(first._outbox) == spooled, what="a batch spooled", every=0.01)  # noqa: B023
        first.close(0.3)  # gives up: what is left stays on disk
        first._thread.join(SETTLE_S)
        server.status, server.kinds = 200, None  # an older collector now answers at its address
        before = len(server.received)
        second, _ = make_sender(server.url, spool_dir=str(tmp_path))
        second.close(SETTLE_S)
    old = [b for b in server.acked if b["incarnation"] == first.identity.incarnation]
    assert [k for k, _ in _kinds(old)] == ["skip", "skip"]
    refused = [b for b in server.received[before:] if b not in server.acked]
    assert [k for k, _ in _kinds(refused)] == ["loss_spike", "skip"], \
        "only the first spooled spike reached the collector (refused: 422), the second went without it at once"
    assert second.rejected_batches == 0
    assert second.delivery["dropped_events"] == 2
