"""The database's disk becomes full, or read-only: ingest answers 503 with a clear message, nothing
acknowledged is lost, and the collector recovers when the disk is usable again.

The database lives on a small tmpfs mounted for the test (root only; skipped otherwise, saying why),
so "full" and "read-only" are real kernel answers (ENOSPC, EROFS) to the real SQLite.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import httpx
import pytest

from ampwatch_support.batches import APPLIED, make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.fault_training import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 16 MiB tmpfs; unmounted at the end even when the test fails."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk) -> str:
    """Write a file until the disk is full; return its path."""
    path = str(disk / "filler")
    with open(path, "wb", buffering=0) as filler:  # unbuffered: close() has nothing left to write
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return path


def _until_refused(url: str, most: int = 2000) -> httpx.Response:
    """Post new batches until one is refused, and return that answer (or the last). A full disk refuses a commit
    only once it needs space the files do not have: the checkpoint thread leaves the WAL's frames to be reused
    after each checkpoint, so the first commits after the disk filled may still land there (and are stored)."""
    for seq in range(1, most + 1):
        answer = httpx.post(url + "/v1/ingest", json=make_batch(run="probe", seq=seq, iteration=seq), timeout=10)
        if answer.status_code != 200:
            break
    return answer


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def test_a_full_disk_gets_503_with_a_clear_message_loses_nothing_acknowledged_and_recovers(tiny_disk, monkeypatch):
    monkeypatch.setenv("AMPWATCH_MAX_BACKOFF", "0.3")
    monkeypatch.delenv("AMPWATCH_SPOOL_DIR", raising=False)
    collector = CollectorProcess(str(tiny_disk / "ampwatch.db"), log_path=str(tiny_disk.parent / "collector.log"))
    collector.start()
    trainer = Trainer(collector=collector.url, run="disk-full", push_interval=0.1)
    try:
        trainer.run_for(1.0, "healthy")
        filler = _fill(tiny_disk)
        probe = _until_refused(collector.url)
        trainer.run_for(1.5, "disk full")
        ready = httpx.get(collector.url + "/readyz", timeout=10).status_code
        failed = value(_metrics(collector.url), "ampwatch_collector_ingest_requests_total", code="503")
        os.remove(filler)
        trainer.run_for(1.0, "space back")
    finally:
        trainer.watch.close(timeout=20)
    try:
        assert probe.status_code == 503, probe.text
        message = probe.json()["message"]
        assert "database or disk is full" in message and "retry" in message and "free disk space" in message
        assert ready == 503, "/readyz must say the collector cannot store batches"
        assert failed and failed >= 2, "the agent's batches must have been refused while the disk was full"
        assert httpx.get(collector.url + "/readyz", timeout=10).status_code == 200
        before_kill = _metrics(collector.url)
        # Everything the agent was told is stored survives a SIGKILL: it was committed before the answer.
        collector.kill(signal.SIGKILL)
        collector.start()
        after_restart = _metrics(collector.url)
        events = httpx.get(collector.url + "/v1/runs/disk-full/events", params={"kind": "skip", "limit": 1000},
                           timeout=10).json()["events"]
    finally:
        collector.kill()
    labels, main = {"run": "disk-full", "rank": "0"}, {"run": "disk-full", "rank": "0", "optimizer": "main"}
    for text in (before_kill, after_restart):
        assert value(text, "ampwatch_optimizer_skipped_steps_total", **main) == len(trainer.skipped_at)
        assert value(text, "ampwatch_optimizer_steps_total", **main) == trainer.steps
        assert value(text, "ampwatch_loss_scale_backoffs_total", **labels) == trainer.backoffs
        assert value(text, "ampwatch_rank_closed", **labels) == 1
    assert value(before_kill, "ampwatch_agent_dropped_events_total", **labels) == 0
    assert [e["iteration"] for e in events] == trainer.skipped_at, "a skip was lost or doubled"
    log = open(collector.log_path).read()
    assert log.count("database write to") == 1, "the failure is logged once, not once per batch"
    assert "succeed again" in log


def test_a_read_only_disk_keeps_every_acknowledged_batch_readable_and_refuses_ingest_with_503(tiny_disk):
    db = str(tiny_disk / "ampwatch.db")
    collector = CollectorProcess(db, log_path=str(tiny_disk.parent / "collector.log"))
    try:
        collector.start()
        acked = [httpx.post(collector.url + "/v1/ingest", json=make_batch(seq=s, iteration=s), timeout=10).json()
                 for s in (1, 2, 3)]
        assert acked == [APPLIED] * 3
        collector.kill(signal.SIGKILL)  # no clean shutdown: the WAL still holds the commits
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True, capture_output=True)
        collector.start()
        ranks = httpx.get(collector.url + "/v1/runs/exp-42", timeout=10).json()["ranks"]
        assert ranks[0]["iteration"] == 3, "an acknowledged batch was lost"
        refused = httpx.post(collector.url + "/v1/ingest", json=make_batch(seq=4, iteration=4), timeout=10)
        assert refused.status_code == 503, refused.text
        assert "readonly" in refused.json()["message"] and "make the database writable" in refused.json()["message"]
        assert httpx.get(collector.url + "/readyz", timeout=10).status_code == 503
        # Writable again: a restart (SQLite keeps a file opened read-only as such) applies the retried batch.
        collector.kill(signal.SIGTERM)
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_disk)], check=True, capture_output=True)
        collector.start()
        again = httpx.post(collector.url + "/v1/ingest", json=make_batch(seq=4, iteration=4), timeout=10)
        assert again.json() == APPLIED
        assert value(_metrics(collector.url), "ampwatch_iteration", run="exp-42", rank="0") == 4
    finally:
        collector.kill()
