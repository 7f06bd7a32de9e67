"""The on-disk spool: survives outages longer than memory holds, replays after a restart, stays bounded."""

from __future__ import annotations

import httpx
import pytest

from ampwatch.agent._batch import encode_batch
from ampwatch.agent._outbox import REPLAYED, Pending
from ampwatch.agent._sender import MAX_BODY_BYTES
from ampwatch.agent._spool import SpoolOutbox
from ampwatch.contract import placement
from ampwatch_support.batches import make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.delivery_harness import make_sender
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(60)


def _wait_for_failure(sender) -> None:
    wait_until(lambda: sender.send_failures > 0, what="an attempt to fail", every=0.01)


def _wait_until_taken(sender, recorder) -> None:
    """Wait until the sender has taken every waiting event into a batch (with a spool: onto disk)."""
    wait_until(lambda: len(recorder.events) == 0, what="the sender to take the waiting events", every=0.01)


def _batch_files(root):
    return sorted(p.name for p in root.rglob("*.json"))


def test_an_outage_longer_than_memory_holds_loses_no_event_with_a_spool(tmp_path):
    server = RecordingCollector()  # down
    sender, recorder = make_sender(server.url, max_events=10, spool_dir=str(tmp_path))
    try:
        _wait_for_failure(sender)
        for _ in range(12):  # 60 events in all, never more than 5 waiting in the 10-event buffer
            for _ in range(5):
                recorder.skip()
            _wait_until_taken(sender, recorder)
        assert _batch_files(tmp_path), "nothing was spooled during the outage"
        with server:
            sender.close(SETTLE_S)
            assert sorted(server.event_ids()) == list(range(1, 61))
            assert server.acked[-1]["state"]["delivery"]["dropped_events"] == 0
            assert server.acked[-1]["closed"] is True
    finally:
        sender.close(1)
    assert not _batch_files(tmp_path), "acknowledged batches must be deleted from the spool"
    assert list(tmp_path.iterdir()) == []


def test_spooled_batches_are_replayed_by_the_next_process_with_their_original_identity(tmp_path):
    server = RecordingCollector()  # down while the first process runs
    first, recorder = make_sender(server.url, spool_dir=str(tmp_path))
    _wait_for_failure(first)
    for _ in range(3):
        recorder.skip()
    first.close(0.3)  # gives up: what is left stays on disk
    first._thread.join(SETTLE_S)  # under load the thread may still be letting go of its spool lock
    assert _batch_files(tmp_path)

    with server:
        second, _ = make_sender(server.url, spool_dir=str(tmp_path))
        second.close(SETTLE_S)
        old = [b for b in server.acked if b["incarnation"] == first.identity.incarnation]
        new = [b for b in server.acked if b["incarnation"] == second.identity.incarnation]
        assert sorted(e["id"] for b in old for e in b["events"]) == [1, 2, 3]
        assert old[-1]["closed"] is True and old[-1]["pid"] == first.identity.pid
        assert server.acked.index(old[-1]) < server.acked.index(new[0]), "replay comes before new batches"
        assert [b["seq"] for b in old] == sorted(b["seq"] for b in old)
    assert list(tmp_path.iterdir()) == []


def test_the_spool_drops_its_oldest_batches_past_its_size_cap_and_counts_their_events(tmp_path):
    server = RecordingCollector()  # down
    sender, recorder = make_sender(server.url, spool_dir=str(tmp_path), spool_max_bytes=8_000)
    try:
        _wait_for_failure(sender)
        for _ in range(20):
            for _ in range(5):
                recorder.skip()
            _wait_until_taken(sender, recorder)
        spooled = sum(p.stat().st_size for p in tmp_path.rglob("*.json"))
        assert spooled <= 8_000 + 3_000  # the cap, plus at most the batch being written
        with server:
            sender.close(SETTLE_S)
            delivered = server.event_ids()
            dropped = server.acked[-1]["state"]["delivery"]["dropped_events"]
            assert dropped > 0
            assert len(delivered) + dropped == 100
            assert delivered == sorted(delivered) and delivered[-1] == 100, "the newest events survive"
    finally:
        sender.close(1)


def test_a_live_process_spool_is_not_adopted_but_a_dead_ones_is(tmp_path):
    alive = SpoolOutbox(tmp_path, "a" * 32, max_bytes=1 << 20)
    alive.put(Pending(seq=1, events=0, run="r", rank=0, world_size=1, body=b'{"run": "r", "rank": 0, "world_size": 1}'))
    other = SpoolOutbox(tmp_path, "b" * 32, max_bytes=1 << 20)
    assert len(other) == 0, "a live process's spool was taken over"
    other.close()
    alive.close()  # undelivered: the folder stays, unlocked
    successor = SpoolOutbox(tmp_path, "c" * 32, max_bytes=1 << 20)
    head = successor.head()
    assert head is not None and (head.seq, head.run, head.rank) == (1, "r", 0)
    # Sent marked: another process's history, never a sign that it lives (docs/protocol.md#who-owns-a-rank).
    assert head.replayed and head.load() == b'{"replayed":true,"run": "r", "rank": 0, "world_size": 1}'
    successor.pop()
    successor.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_spool_dir_is_counted_and_delivery_goes_on_from_memory(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with RecordingCollector() as server:
        sender, recorder = make_sender(server.url, spool_dir=str(not_a_folder))
        recorder.skip()
        sender.close(SETTLE_S)
        assert server.event_ids() == [1]
        assert server.acked[-1]["state"]["delivery"]["agent_errors"] == 1


def test_the_largest_batch_the_sender_builds_still_fits_a_default_collector_once_marked_as_a_replay(tmp_path):
    # The sender splits a batch to stay within MAX_BODY_BYTES; a replay adds its mark in front. A body of exactly
    # that size, spooled by a process that died, must not be refused as too large (413, for good) by a collector
    # with default limits when another process replays it.
    batch = make_batch(run="largest", events=[])
    event = {"kind": "warning", "time": 1.0, "iteration": 0, "code": "c", "message": "m" * 2000}
    events, size = [], len(encode_batch(batch))
    while size < MAX_BODY_BYTES - 3000:  # then the last message takes what is left: 900-3,000 characters
        events.append({"id": len(events) + 1, **event})
        size += len(encode_batch(events[-1])) + 1  # and its comma
    events.append({"id": len(events) + 1, **event, "message": ""})
    events[-1]["message"] = "m" * (MAX_BODY_BYTES - len(encode_batch({**batch, "events": events})))
    body = encode_batch({**batch, "events": events})
    assert len(body) == MAX_BODY_BYTES
    dead = SpoolOutbox(tmp_path, "d" * 32, max_bytes=1 << 24)
    dead.put(Pending(seq=1, events=len(events), run="largest", rank=0, world_size=1, body=body))
    dead.close()  # undelivered: left for the next process
    successor = SpoolOutbox(tmp_path, "e" * 32, max_bytes=1 << 24)
    try:
        replay = successor.head().load()
        assert replay.startswith(REPLAYED)
        with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
            answer = httpx.post(collector.url + "/v1/ingest", content=replay,
                                headers={"Content-Type": "application/json"}, timeout=60)
        assert answer.json()["applied"] is True, answer.text[:300]
    finally:
        successor.close()


def test_a_replayed_batch_goes_to_the_collector_its_own_run_rank_and_world_size_are_placed_on(tmp_path):
    # A dead process's batch (rank 3 of a 4-rank run in blocks of 2: the run's second collector) is replayed by a
    # process of another run, which places its own batches on its run's first collector.
    with RecordingCollector() as a, RecordingCollector() as b:
        urls = [a.url, b.url]
        mine = next(r for r in (f"mine-{i}" for i in range(100)) if placement.ranking(r, urls)[0] == a.url)
        theirs = next(r for r in (f"theirs-{i}" for i in range(100)) if placement.ranking(r, urls)[1] == b.url)
        body = encode_batch(make_batch(run=theirs, rank=3, world_size=4))
        dead = SpoolOutbox(tmp_path, "d" * 32, max_bytes=1 << 20)
        dead.put(Pending(seq=1, events=0, run=theirs, rank=3, world_size=4, body=body))
        dead.close()  # undelivered: left for the next process
        sender, _ = make_sender(urls, run=mine, spool_dir=str(tmp_path), block_ranks=2)
        sender.close(SETTLE_S)
        assert {(batch["run"], batch["rank"], batch.get("replayed", False)) for batch in b.acked} == {
            (theirs, 3, True)}
        assert {(batch["run"], batch["rank"]) for batch in a.acked} == {(mine, 0)}


def test_a_spooled_batch_whose_rank_its_world_cannot_hold_is_skipped_and_delivery_goes_on(tmp_path):
    # No collector could be placed for it: adopted, it would stay at the head of the outbox for good.
    dead = SpoolOutbox(tmp_path, "d" * 32, max_bytes=1 << 20)
    dead.put(Pending(seq=1, events=0, run="odd", rank=5, world_size=4,
                     body=encode_batch(make_batch(run="odd", rank=5, world_size=4))))
    dead.close()
    with RecordingCollector() as server:
        sender, recorder = make_sender(server.url, spool_dir=str(tmp_path))
        recorder.skip()
        sender.close(SETTLE_S)
        assert server.event_ids() == [1] and server.acked[-1]["closed"] is True
        assert {batch["run"] for batch in server.received} == {"test-run"}
