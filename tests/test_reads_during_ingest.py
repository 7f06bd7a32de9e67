"""/metrics and the built-in alert pass run in worker threads while a real collector process applies batches.

Each rank's batches keep one invariant between its series (seq s: iteration 11s, gen steps 10s and
skipped s, disc steps 10s, backoffs s), so a scrape that mixed two batches of one rank, or failed
because ingest changed the state under it, shows.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ampwatch_support.batches import make_batch, optimizer
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import assert_promtool_accepts, samples
from ampwatch_support.patience import START_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RANKS = 1200
WRITERS = 4


def _batch(rank: int, seq: int, incarnation: str, **fields) -> dict:
    return make_batch(run="offloop", rank=rank, world_size=RANKS, seq=seq, incarnation=incarnation,
                      iteration=11 * seq, backoffs=seq,
                      optimizers={"gen": optimizer(steps=10 * seq, skipped=seq), "disc": optimizer(steps=10 * seq)},
                      **fields)


def _each_rank_from_one_batch(text: str) -> int:
    """Check every rank's series come from one batch; return how many ranks the exposition holds."""
    by_rank: dict[str, dict[tuple[str, str], float]] = {}
    for (name, labels), value in samples(text).items():
        labels = dict(labels)
        if labels.get("run") == "offloop" and "rank" in labels:
            by_rank.setdefault(labels["rank"], {})[(name, labels.get("optimizer", ""))] = value
    for rank, series in by_rank.items():
        seq = series[("ampwatch_iteration", "")] / 11
        assert seq == int(seq) and seq >= 1, (rank, series)
        assert series[("ampwatch_optimizer_steps_total", "gen")] == 10 * seq, (rank, seq, series)
        assert series[("ampwatch_optimizer_skipped_steps_total", "gen")] == seq, (rank, seq, series)
        assert series[("ampwatch_optimizer_steps_total", "disc")] == 10 * seq, (rank, seq, series)
        assert series[("ampwatch_loss_scale_backoffs_total", "")] == seq, (rank, seq, series)
    return len(by_rank)


def test_scrapes_during_ingest_are_promtool_valid_and_show_each_rank_as_of_one_batch(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        incarnations = [f"{rank:032x}" for rank in range(RANKS)]

        def fill(first: int) -> None:
            with httpx.Client(base_url=collector.url, timeout=60) as client:
                for rank in range(first, RANKS, WRITERS):
                    assert client.post("/v1/ingest", json=_batch(rank, 1, incarnations[rank])).status_code == 200

        fillers = [threading.Thread(target=fill, args=(w,)) for w in range(WRITERS)]
        for t in fillers:
            t.start()
        for t in fillers:
            t.join()

        stop = threading.Event()
        answered: list[float] = []  # when each batch of the write phase was answered
        errors: list[str] = []

        def write(first: int) -> None:
            seq = 1
            with httpx.Client(base_url=collector.url, timeout=60) as client:
                while not stop.is_set():
                    seq += 1
                    for rank in range(first, RANKS, WRITERS):
                        answer = client.post("/v1/ingest", json=_batch(rank, seq, incarnations[rank]))
                        if answer.status_code != 200:
                            errors.append(f"{answer.status_code} {answer.text}")
                        answered.append(time.monotonic())
                        if stop.is_set():
                            return

        writers = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
        for t in writers:
            t.start()
        scrapes: list[tuple[float, float]] = []
        try:
            with httpx.Client(base_url=collector.url, timeout=60) as client:
                for i in range(6):
                    started = time.monotonic()
                    answer = client.get("/metrics", headers={"Accept-Encoding": "gzip" if i % 2 else "identity"})
                    scrapes.append((started, time.monotonic()))
                    assert answer.status_code == 200
                    assert _each_rank_from_one_batch(answer.text) == RANKS
                    assert_promtool_accepts(answer.text)
        finally:
            stop.set()
            for t in writers:
                t.join(60)
        assert not errors, errors[:3]
        # Ingest went on while scrapes were being rendered (the render does not hold the event loop).
        assert any(start < t < end for start, end in scrapes for t in answered)


def test_alerts_of_the_periodic_pass_and_of_a_batch_still_fire_while_batches_arrive(tmp_path):
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"silent_after_s": 2, "silent_for_s": 0}))
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--alert-thresholds", str(thresholds)]) as collector, \
            httpx.Client(base_url=collector.url, timeout=60) as client:
        assert client.post("/v1/ingest", json=_batch(999, 1, "f" * 32)).status_code == 200  # then silent
        poisoned = _batch(1, 1, "e" * 32)
        poisoned["state"]["optimizers"]["gen"].update(poisoned_steps=1)
        assert client.post("/v1/ingest", json=poisoned).status_code == 200
        # The poisoned step fires at its batch's ingest: no pass needed.
        firing = {(a["name"], a["labels"].get("rank")) for a in client.get("/v1/alerts").json()["firing"]}
        assert ("AmpPoisonedStep", "1") in firing
        # Eight ranks keep sending: a round of their batches takes a small part of the 2 s silence even on a
        # loaded machine, so none of them may be called silent.
        seq, deadline = 1, time.monotonic() + START_S
        while ("AmpRankSilent", "999") not in firing:  # only the periodic pass, in its thread, sees silence
            assert time.monotonic() < deadline, firing
            seq += 1
            for rank in range(2, 10):
                assert client.post("/v1/ingest", json=_batch(rank, seq, f"{rank:032x}")).status_code == 200
            firing = {(a["name"], a["labels"].get("rank")) for a in client.get("/v1/alerts").json()["firing"]}
        assert ("AmpPoisonedStep", "1") in firing  # the pass kept what the batch fired
        assert not any(name == "AmpRankSilent" and 2 <= int(rank) < 10 for name, rank in firing)  # ranks sending
