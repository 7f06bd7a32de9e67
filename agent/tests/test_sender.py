"""The Sender against a real HTTP server on a free loopback port: shape, retries, outages, refusals, timing."""

from __future__ import annotations

import logging
import threading
import time
from itertools import pairwise

import pytest

from ampwatch.agent._batch import DELIVERY_COUNTERS, MAX_BATCH_EVENTS
from ampwatch.agent._schedule import NEWS_GAP
from ampwatch.agent._sender import MAX_BODY_BYTES
from ampwatch.contract import placement
from ampwatch_support.delivery_harness import make_sender
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def collector():
    with RecordingCollector() as server:
        yield server


@pytest.fixture
def senders():
    """Collect senders made by a test and close them even when it fails."""
    made = []
    yield made
    for sender in made:
        sender.close(1.0)


def test_batches_arrive_with_identity_cumulative_state_events_and_a_closed_flag(collector, senders):
    sender, recorder = make_sender(collector.url, token="s3cret")
    senders.append(sender)
    for _ in range(3):
        recorder.skip()
    sender.wake()
    assert collector.wait_for(lambda s: len(s.event_ids()) == 3)
    sender.close(SETTLE_S)

    batches = collector.acked
    assert [b["seq"] for b in batches] == list(range(1, len(batches) + 1))
    first, last = batches[0], batches[-1]
    assert first["protocol"] == 1 and first["agent"]["torch"]
    assert (first["run"], first["rank"], first["world_size"], first["local_rank"]) == ("test-run", 0, 1, 0)
    assert first["pid"] == sender.identity.pid and len(first["incarnation"]) == 32
    assert {b["incarnation"] for b in batches} == {sender.identity.incarnation}
    assert last["state"]["optimizers"]["opt"]["skipped"] == 3
    assert set(last["state"]["delivery"]) == set(DELIVERY_COUNTERS)
    assert last["scaler"]["kind"] == "GradScaler"
    assert [b["closed"] for b in batches] == [False] * (len(batches) - 1) + [True]
    assert collector.event_ids() == [1, 2, 3]
    assert {h["Authorization"] for h in collector.headers} == {"Bearer s3cret"}


def test_a_batch_follows_wake_without_waiting_for_the_push_interval(collector, senders):
    sender, recorder = make_sender(collector.url, push_interval=3600.0)  # far past any wait below
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)  # the first batch goes out at start
    recorder.skip()
    sender.wake()
    assert collector.wait_for(lambda s: s.event_ids() == [1]), "wake() did not trigger a batch"


def test_a_retried_batch_repeats_its_incarnation_seq_and_body(collector, senders):
    collector.status = 503
    sender, recorder = make_sender(collector.url)
    senders.append(sender)
    recorder.skip()
    assert collector.wait_for(lambda s: len(s.received) >= 3)
    collector.status = 200
    assert collector.wait_for(lambda s: len(s.acked) >= 2)

    first_seq = [b for b in collector.received if b["seq"] == 1]
    assert len(first_seq) >= 3, "the failing batch was not retried"
    assert all(b == first_seq[0] for b in first_seq), "a retry must resend the very same body"
    assert collector.acked[0] == first_seq[0]
    assert collector.acked[1]["seq"] == 2
    assert collector.acked[1]["state"]["delivery"]["send_failures"] >= 2


@pytest.mark.parametrize("status", [429, 408])
def test_a_batch_answered_429_or_408_is_sent_again_unchanged_and_nothing_is_dropped(collector, senders, status):
    # Back-pressure and a request timeout: the same batch passes later, so the agent keeps it (an older
    # collector, or a proxy, answers without the collector's "retry" verdict: the status alone decides).
    collector.status = status
    sender, recorder = make_sender(collector.url)
    senders.append(sender)
    for _ in range(3):
        recorder.skip()
    assert collector.wait_for(lambda s: len(s.received) >= 3)
    collector.status = 200
    assert collector.wait_for(lambda s: len(s.acked) >= 1)
    sender.close(SETTLE_S)

    first = [b for b in collector.received if b["seq"] == 1]
    assert len(first) >= 3 and all(b == first[0] for b in first), "the refused batch was not resent unchanged"
    assert collector.acked[0] == first[0]
    assert collector.event_ids() == [1, 2, 3]
    assert sender.rejected_batches == 0 and sender.send_failures >= 2
    assert collector.acked[-1]["state"]["delivery"]["rejected_batches"] == 0


def test_the_collectors_retry_verdict_and_retry_after_are_followed_and_its_reason_logged_once(collector, senders,
                                                                                                caplog):
    reason = "this collector already holds 1000 runs (--max-runs 1000); retry later, when finished runs retire"
    collector.status, collector.retry_after = 429, "2"
    collector.reply = {"error": "cardinality", "retry": True, "message": reason}
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        sender, recorder = make_sender(collector.url, max_backoff=10.0)
        senders.append(sender)
        recorder.skip()
        assert collector.wait_for(lambda s: len(s.received) >= 1)
        collector.status = 200  # the next attempt passes: it must come no sooner than the collector asked
        sender.wake()
        assert collector.wait_for(lambda s: s.event_ids() == [1])
        # Without Retry-After the backoff would have retried after 0.025-0.05 s (a slow machine only waits longer).
        first, second = collector.arrivals[:2]
        assert second - first >= 2.0, f"retried {second - first:.2f} s after a Retry-After of 2 s"
    assert sender.rejected_batches == 0
    assert caplog.text.count(reason) == 1, caplog.text
    assert "AMPWATCH_URL" not in caplog.text  # the collector answered: no guessing about the address

    # The same status with "retry": false is a refusal for good: dropped and counted, never resent.
    collector.status, collector.retry_after = 429, None
    collector.reply = {"error": "cardinality", "retry": False, "message": "refused for good"}
    start = len(collector.received)
    recorder.skip()
    sender.wake()
    assert collector.wait_for(lambda s: len(s.received) >= start + 3)
    seqs = [b["seq"] for b in collector.received[start:]]
    assert sorted(seqs) == sorted(set(seqs)), "a batch refused for good was sent again"
    assert sender.rejected_batches >= 1


def test_retries_wait_out_a_backoff_that_doubles_up_to_the_cap(collector, senders):
    collector.status = 500
    sender, _ = make_sender(collector.url, push_interval=0.05, max_backoff=0.4)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.arrivals) >= 7)
    gaps = [later - earlier for earlier, later in pairwise(collector.arrivals[:7])]
    # Each retry waits at least half its backoff (0.05, 0.1, 0.2, then 0.4 capped, jittered 50-100%);
    # a loaded machine only waits longer. How long each wait is exactly: test_delivery_outcomes.py.
    least = [0.5 * min(0.4, 0.05 * 2 ** k) for k in range(6)]
    assert all(gap >= low for gap, low in zip(gaps, least, strict=True)), [round(g, 3) for g in gaps]


def test_a_short_outage_then_recovery_loses_no_event(collector, senders):
    sender, recorder = make_sender(collector.url)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) >= 1)
    collector.stop()
    for _ in range(100):
        recorder.skip()
    wait_until(lambda: sender.send_failures > 0, what="an attempt to fail during the outage")
    collector.start()
    sender.close(SETTLE_S)
    assert sorted(collector.event_ids()) == list(range(1, 101))
    assert collector.acked[-1]["closed"] is True
    assert collector.acked[-1]["state"]["delivery"]["dropped_events"] == 0


def test_without_a_spool_a_long_outage_drops_the_oldest_events_and_reports_the_count(senders):
    server = RecordingCollector()  # down from the start
    sender, recorder = make_sender(server.url, max_events=10)
    senders.append(sender)
    wait_until(lambda: sender.send_failures > 0, what="the first (empty) batch to fail")  # stuck in the outbox now
    for _ in range(50):
        recorder.skip()
    with server:
        sender.close(SETTLE_S)
        assert server.event_ids() == list(range(41, 51)), "the newest events must survive, oldest dropped"
        assert server.acked[-1]["state"]["delivery"]["dropped_events"] == 40
        assert server.acked[-1]["closed"] is True


def test_a_refused_batch_is_dropped_counted_and_never_resent(collector, senders, caplog):
    collector.status = 401
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        sender, recorder = make_sender(collector.url)
        senders.append(sender)
        recorder.skip()
        assert collector.wait_for(lambda s: len(s.received) >= 3)
        collector.status = 200
        assert collector.wait_for(lambda s: len(s.acked) >= 1)
    refused = [b for b in collector.received if b not in collector.acked]
    seqs = [b["seq"] for b in refused]
    assert len(seqs) == len(set(seqs)), "a refused batch was sent again"
    assert collector.acked[0]["state"]["delivery"]["rejected_batches"] == len(refused)
    assert "AMPWATCH_TOKEN" in caplog.text
    assert caplog.text.count("refused batch") == 1, "the refusal should be logged once, then counted"


def test_a_hanging_collector_never_blocks_the_calling_thread_and_close_keeps_its_timeout(collector, senders):
    collector.delay = 3600.0  # no answer while the test runs (stopping the server ends it)
    sender, recorder = make_sender(collector.url, timeout=3600.0)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.arrivals) == 1)  # the first batch now hangs on the collector

    def training_thread() -> None:
        for _ in range(200):
            recorder.skip()
            sender.wake()
        started = time.monotonic()
        sender.close(0.5)
        closed.append(time.monotonic() - started)

    closed: list[float] = []
    calls = threading.Thread(target=training_thread, daemon=True)
    calls.start()
    calls.join(SETTLE_S)  # a hang detector: only a call waiting on the collector (an hour) takes this long
    assert not calls.is_alive(), "a call on the training thread waited for the hanging collector"
    assert collector.received == [], "the collector answered: this test proved nothing"
    assert closed[0] >= 0.5, "close(0.5) did not give the final batch its time"


def test_close_sends_every_waiting_event_in_a_final_closed_batch(collector, senders):
    sender, recorder = make_sender(collector.url, push_interval=30.0)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    for _ in range(5):
        recorder.skip()
    sender.close(SETTLE_S)
    assert collector.acked[-1]["closed"] is True
    assert [e["id"] for e in collector.acked[-1]["events"]] == [1, 2, 3, 4, 5]


def test_more_events_than_one_batch_holds_go_out_in_several_batches(collector, senders):
    total = MAX_BATCH_EVENTS * 2 + 500
    sender, recorder = make_sender(collector.url, push_interval=30.0, max_events=total)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    for _ in range(total):
        recorder.skip()
    sender.close(SETTLE_S)
    assert max(len(b["events"]) for b in collector.acked) == MAX_BATCH_EVENTS
    assert collector.event_ids() == list(range(1, total + 1))
    assert collector.acked[-1]["closed"] is True


def test_a_batch_over_a_default_collectors_body_limit_is_split_and_every_event_arrives(collector, senders):
    # 1,200 inspected skips naming 16 parameters of 512 characters: ~10 MiB of JSON, over the 8 MiB a
    # collector accepts by default (413, refused for good). The sender splits the events over two batches.
    sender, recorder = make_sender(collector.url, push_interval=30.0)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    params = [{"name": f"{i}." + "n" * 508, "inf": 1, "nan": 0} for i in range(16)]
    for i in range(1200):
        recorder.events.append({"kind": "skip", "iteration": i, "optimizer": "opt", "streak": 1, "params": params,
                                "params_total": 16, "inspected": True})
    sender.close(SETTLE_S)
    sizes = [int(h["Content-Length"]) for h in collector.headers]
    assert max(sizes) <= MAX_BODY_BYTES and sum(sizes) > MAX_BODY_BYTES
    assert collector.event_ids() == list(range(1, 1201))
    assert sender.rejected_batches == 0 and collector.acked[-1]["closed"] is True


def test_a_failing_snapshot_is_counted_as_an_agent_error_not_raised(collector, senders):
    sender, recorder = make_sender(collector.url)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) >= 1)
    recorder.fail_snapshots = True
    assert collector.wait_for(lambda s: s.acked[-1]["state"]["delivery"]["agent_errors"] >= 1)
    assert sender._thread.is_alive()


def test_the_recorders_own_agent_errors_are_counted_with_the_senders(collector, senders):
    sender, recorder = make_sender(collector.url)
    senders.append(sender)
    recorder.errors.report("stand-in recording", ValueError("one"))
    recorder.errors.report("stand-in recording", ValueError("two"))
    recorder.fail_snapshots = False
    assert collector.wait_for(lambda s: s.acked and s.acked[-1]["state"]["delivery"]["agent_errors"] == 2)


def test_each_rank_reports_to_the_collector_placement_names_a_whole_run_on_one_a_big_one_in_blocks(senders):
    with RecordingCollector() as a, RecordingCollector() as b, RecordingCollector() as c:
        urls = [a.url, b.url, c.url]
        # "whole": 8 ranks, one block; "blocks": blocks of 3 ranks (0-2, 3-5, 6-7), one on each collector.
        expected = {(run, rank): block.collector
                    for run, block_ranks in (("whole", placement.BLOCK_RANKS), ("blocks", 3))
                    for block in placement.blocks(run, 8, urls, block_ranks)
                    for rank in range(block.first_rank, block.last_rank + 1)}
        assert len({expected["whole", rank] for rank in range(8)}) == 1
        assert len({expected["blocks", rank] for rank in range(8)}) == 3
        for run, block_ranks in (("whole", placement.BLOCK_RANKS), ("blocks", 3)):
            for rank in range(8):
                sender, _ = make_sender(urls, run=run, rank=rank, world_size=8, block_ranks=block_ranks)
                senders.append(sender)
        for sender in senders:
            sender.close(SETTLE_S)
        for server in (a, b, c):
            held = {(batch["run"], batch["rank"]) for batch in server.received}
            assert held == {key for key, url in expected.items() if url == server.url}


def test_a_rank_whose_collector_is_down_retries_it_and_never_sends_to_another_replica(senders):
    down, up = RecordingCollector(), RecordingCollector()  # "down" is not started yet
    urls = [down.url, up.url]
    run = next(r for r in (f"outage-{i}" for i in range(100)) if placement.ranking(r, urls)[0] == down.url)
    with up:
        sender, recorder = make_sender(urls, run=run)
        senders.append(sender)
        recorder.skip()
        wait_until(lambda: sender.send_failures >= 3 or up.received, what="three attempts to fail during the outage")
        assert up.received == [], "a rank of a run placed on a down collector went to another replica"
        with down:
            sender.close(SETTLE_S)
            assert down.event_ids() == [1] and down.acked[-1]["closed"] is True
            assert down.acked[-1]["state"]["delivery"]["send_failures"] >= 3
        assert up.received == [], "a rank of a run placed on a down collector went to another replica"


def test_nothing_is_started_without_a_collector():
    sender, recorder = make_sender(None)
    recorder.skip()
    sender.wake()
    sender.close(1)
    assert sender._thread is None


class CountingEvent(threading.Event):
    """A real event that counts its waits: the sender's loop waits on its wake event once per turn."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_closing_against_a_down_collector_waits_out_its_timeout_without_spinning(senders):
    server = RecordingCollector()  # down
    turns = CountingEvent()
    sender, recorder = make_sender(server.url, push_interval=30.0, max_backoff=2.0, wake=turns)
    senders.append(sender)
    recorder.skip()
    wait_until(lambda: sender.send_failures > 0, what="an attempt to fail")
    before, started = turns.waits, time.monotonic()
    sender.close(1.0)
    waited = time.monotonic() - started
    sender._thread.join(SETTLE_S)
    assert not sender._thread.is_alive(), "the sender thread outlived its close timeout"
    assert waited >= 0.9, f"close(1.0) gave up after {waited:.2f} s"
    # A loop that waits out its backoff and deadline turns a few times; one that spins turns thousands of
    # times (a loaded machine only turns it less).
    assert turns.waits - before <= 20, f"the sender turned {turns.waits - before} times in one second of closing"


def test_appended_news_wakes_the_sender_and_routine_events_wait_for_the_heartbeat(collector, senders):
    sender, recorder = make_sender(collector.url, push_interval=30.0)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    recorder.events.append({"kind": "scale_change", "iteration": 1, "cause": "growth", "before": 2.0, "after": 4.0})
    time.sleep(1.5)  # longer than the news gap: a growth is no news, so nothing may have gone
    assert len(collector.received) == 1
    recorder.skip()  # a streak's first skip: news, without any wake() call
    assert collector.wait_for(lambda s: s.event_ids() == [1, 2]), "news did not trigger a batch"
    assert len(collector.acked) == 2, "the growth rode along with the news"


def test_a_storm_of_news_is_coalesced_into_at_most_one_batch_per_news_gap(collector, senders):
    sender, recorder = make_sender(collector.url, push_interval=30.0)
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    started = time.monotonic()
    while time.monotonic() - started < 1.5:  # the gap itself is tested on its clock in test_schedule.py
        recorder.skip()  # every one a streak start
        time.sleep(0.005)
    storm = time.monotonic() - started
    assert collector.wait_for(lambda s: len(s.event_ids()) == recorder.skipped)
    # Per-event batches would be hundreds; the gap allows one per NEWS_GAP (the last may come after the storm).
    assert len(collector.acked) - 1 <= storm / NEWS_GAP + 2, len(collector.acked)


def test_news_that_waited_out_an_outage_goes_when_delivery_resumes_not_at_the_next_heartbeat(collector, senders):
    sender, recorder = make_sender(collector.url, push_interval=3600.0, max_backoff=0.2)  # no heartbeat meanwhile
    senders.append(sender)
    assert collector.wait_for(lambda s: len(s.acked) == 1)
    collector.stop()
    recorder.skip()  # news: its batch is built, then retried while the collector is down
    wait_until(lambda: sender.send_failures > 0, what="the news batch to fail")
    recorder.skip()  # news again, but the one-batch outbox is full: it waits in the event buffer
    time.sleep(NEWS_GAP)  # the schedule's own timer: its batch is due by now (and finds no room)
    failed = sender.send_failures
    # Two more failed attempts: the sender has turned since that batch was due.
    wait_until(lambda: sender.send_failures >= failed + 2, what="two more failed attempts")
    collector.start()
    assert collector.wait_for(lambda s: s.event_ids() == [1, 2]), collector.event_ids()
