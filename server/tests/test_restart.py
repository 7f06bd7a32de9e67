"""A real collector process killed with SIGKILL mid-stream and restarted on the same database continues exactly."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request

import pytest

from ampwatch_support.batches import ingest_status, make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value


def _batch(rank: int, seq: int) -> dict:
    # Cumulative counters as an agent keeps them: every 3rd step of rank 1 skips, one event per skip.
    skipped = seq // 3 if rank == 1 else 0
    events = [skip_event(skipped, iteration=seq)] if rank == 1 and seq % 3 == 0 else []
    return make_batch(rank=rank, incarnation=f"{rank + 1:032x}", seq=seq, iteration=seq, backoffs=skipped,
                      optimizers={"gen": optimizer(steps=seq - skipped, skipped=skipped)}, events=events)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_mid_stream_then_restart_on_the_same_database_loses_and_doubles_nothing(tmp_path):
    db = str(tmp_path / "ampwatch.db")
    batches = 60
    collector = CollectorProcess(db).start()
    try:
        acked = {0: 0, 1: 0}
        killed = threading.Event()

        def sender(rank: int) -> None:
            # Like the agent: resend the same seq until acknowledged, then move on.
            seq = 1
            while seq <= batches:
                if ingest_status(collector.url, _batch(rank, seq), timeout=5) == 200:
                    acked[rank] = seq
                    seq += 1
                    if rank == 0 and seq == batches // 2:
                        collector.kill(signal.SIGKILL)  # in the middle of the stream, no shutdown at all
                        killed.set()
                else:
                    threading.Event().wait(0.05)  # down or refused: back off a little, then resend
        threads = [threading.Thread(target=sender, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        assert killed.wait(60), "the stream never reached the kill point"
        collector.start()  # same port, same database
        for t in threads:
            t.join(60)
        assert acked == {0: batches, 1: batches}
        # Resending everything after the restart changes nothing either.
        assert ingest_status(collector.url, _batch(1, batches), timeout=5) == 200
        with urllib.request.urlopen(collector.url + "/metrics", timeout=5) as answer:
            text = answer.read().decode()
        skipped = batches // 3
        assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == batches
        assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="1", optimizer="gen") == \
            batches - skipped
        assert value(text, "ampwatch_optimizer_skipped_steps_total", run="exp-42", rank="1", optimizer="gen") == \
            skipped
        assert value(text, "ampwatch_loss_scale_backoffs_total", run="exp-42", rank="1") == skipped
        assert value(text, "ampwatch_iteration", run="exp-42", rank="1") == batches
        with urllib.request.urlopen(collector.url + "/v1/runs/exp-42/events?kind=skip&limit=1000") as answer:
            ids = [e["id"] for e in json.load(answer)["events"]]
        assert ids == list(range(1, skipped + 1))
    finally:
        collector.kill()
