"""The node relay inside one process: real senders, a real Unix socket, a real collector (or a recording one)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from ampwatch.agent._relay import SOCKET_PATH_MAX
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.delivery_harness import make_sender
from ampwatch_support.exposition import value
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.slow


def _relay_threads() -> int:
    return sum(t.name == "ampwatch-relay" and t.is_alive() for t in threading.enumerate())


def _requests_and_batches(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (value(text, "ampwatch_collector_ingest_requests_total", code="200"),
            value(text, "ampwatch_collector_batches_applied_total"))


@pytest.fixture(params=["short", "long"])
def relay_dir(request, tmp_path):
    """A relay directory whose socket path fits a Unix socket address, and one whose path is longer than it holds.

    pytest's ``tmp_path`` is of either kind, depending on the test's name and how many runs the machine kept: CI's
    ``/tmp/pytest-of-root/pytest-100/popen-gw0/test_two_ranks_in_one_process_0/relay`` is the long kind.
    """
    if request.param == "long":
        directory = tmp_path / ("deep-" * 20) / "relay"
        assert len(os.fsencode(directory)) + 30 > SOCKET_PATH_MAX
        yield directory
        return
    short = tempfile.mkdtemp(prefix="aw", dir="/tmp")
    try:
        yield Path(short) / "relay"
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_two_ranks_in_one_process_share_one_relay_and_every_skip_arrives_once(tmp_path, relay_dir):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        # A 1 s push interval: the relay holds a heartbeat up to 1 s for the other rank's to join. At 50 ms
        # (a 50 ms hold) the two ranks' batches often missed each other on a loaded machine.
        pairs = [make_sender(collector.url, rank=r, world_size=2, relay=True, relay_dir=str(relay_dir),
                             push_interval=1.0) for r in (0, 1)]
        try:
            for _ in range(40):
                for _, recorder in pairs:
                    recorder.skip()
                time.sleep(0.01)
            wait_until(lambda: _relay_threads() == 1, what="one relay thread")
            # Both ranks' heartbeats come through the relay once both have found it: one request, two batches.
            wait_until(lambda: (lambda requests, batches: requests < batches)(*_requests_and_batches(collector.url)),
                       what="a request carrying both ranks' batches")
            assert stat.S_IMODE(relay_dir.stat().st_mode) == 0o700
            sockets = list(relay_dir.glob("*.sock"))
            assert len(sockets) == 1 and stat.S_IMODE(sockets[0].stat().st_mode) == 0o600
        finally:
            for sender, _ in pairs:
                sender.close(SETTLE_S)
        text = httpx.get(collector.url + "/metrics", timeout=10).text
        requests, batches = _requests_and_batches(collector.url)
    for rank in ("0", "1"):
        assert value(text, "ampwatch_optimizer_skipped_steps_total", run="test-run", rank=rank, optimizer="opt") == 40
        assert value(text, "ampwatch_rank_closed", run="test-run", rank=rank) == 1
    assert all(sender.delivery["agent_errors"] == 0 for sender, _ in pairs)
    assert requests < batches
    assert _relay_threads() == 0 and not list(relay_dir.glob("*.sock")), "closing the relay rank removed it"


def test_a_relay_directory_others_may_write_is_not_used_and_each_rank_posts_for_itself(tmp_path):
    relay_dir = tmp_path / "shared"
    relay_dir.mkdir(mode=0o777)
    os.chmod(relay_dir, 0o777)
    with RecordingCollector() as server:
        sender, recorder = make_sender(server.url, relay=True, relay_dir=str(relay_dir))
        recorder.skip()
        sender.close(SETTLE_S)
    assert server.event_ids() == [1] and all(body["protocol"] == 1 for body in server.received)
    assert sender.delivery["agent_errors"] == 1  # said once, counted once
    assert not list(relay_dir.iterdir()) and _relay_threads() == 0


def test_a_forked_child_that_outlives_the_relay_does_not_keep_another_rank_from_taking_over(tmp_path):
    relay_dir = tmp_path / "relay"
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        pairs = [make_sender(collector.url, rank=r, world_size=2, relay=True, relay_dir=str(relay_dir))
                 for r in (0, 1)]
        child = None
        try:
            for _, recorder in pairs:
                recorder.skip()
            wait_until(lambda: _relay_threads() == 1 and _requests_and_batches(collector.url)[1] >= 2,
                       what="a relay, and both ranks' first batches")
            child = os.fork()
            if child == 0:  # inherits the relay's socket and lock (as a DataLoader worker does); lives on
                time.sleep(3600)  # killed at the end of the test
                os._exit(0)
            relay, other = sorted(pairs, key=lambda pair: pair[0]._node.relay is None)
            relay[0].close(SETTLE_S)  # the relay rank ends first, while the child still lives
            assert _relay_threads() == 0
            before = _requests_and_batches(collector.url)
            for _ in range(30):
                other[1].skip()
                time.sleep(0.02)
            wait_until(lambda: _relay_threads() == 1, what="the other rank to take the relay over")
            assert other[0]._node.relay is not None
        finally:
            if child:
                os.kill(child, 9)
                os.waitpid(child, 0)
            for sender, _ in pairs:
                sender.close(SETTLE_S)
        text = httpx.get(collector.url + "/metrics", timeout=10).text
        after = _requests_and_batches(collector.url)
    assert after[1] > before[1]
    assert value(text, "ampwatch_optimizer_skipped_steps_total", run="test-run", rank=str(other[0].identity.rank),
                 optimizer="opt") == 31
    assert all(sender.delivery["agent_errors"] == 0 for sender, _ in pairs)
