"""Faults inside the job: a rank killed without closing, and a training process that forks DataLoader workers.

Each rank is a real process with the real agent and a real GradScaler, reporting to a real collector.
Plain fork of a process with a live sender: agent/tests/test_delivery_process.py.
"""

from __future__ import annotations

import json
import pathlib
import signal
import time

import httpx
import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import scrape, value
from ampwatch_support.patience import SETTLE_S, START_S
from ampwatch_support.rank_processes import check_rank_truth, spawn_rank, wait_for

pytestmark = pytest.mark.slow

RANK = """
import json, os, pathlib, sys
from ampwatch_support.fault_training import Trainer
url, run, stop, truth = sys.argv[1:5]
trainer = Trainer(collector=url, run=run, push_interval=0.1)
while not os.path.exists(stop):
    trainer.step("train")
    if trainer.iteration % 50 == 0:
        print(trainer.iteration, flush=True)
trainer.watch.close(timeout=10)
pathlib.Path(truth).write_text(json.dumps(trainer.truth()))
"""

FORKING = """
import json, os, pathlib, sys, threading
import torch
from torch.utils.data import DataLoader, Dataset
from ampwatch_support.fault_training import Trainer
url, run, truth = sys.argv[1:4]

class Samples(Dataset):
    def __len__(self):
        return 64 * 256
    def __getitem__(self, i):
        # Runs in a forked worker: report its pid and whether an ampwatch sender thread lives there.
        senders = sum(t.name == "ampwatch-sender" and t.is_alive() for t in threading.enumerate())
        return torch.randn(64, generator=torch.Generator().manual_seed(i)), os.getpid(), senders

trainer = Trainer(collector=url, run=run, push_interval=0.05)
loader = DataLoader(Samples(), batch_size=256, num_workers=2, multiprocessing_context="fork")
worker_pids, worker_senders = set(), 0
for epoch in range(3):  # new workers are forked at each epoch, while the sender runs
    for x, pids, senders in loader:
        trainer.step("train", x)
        worker_pids |= set(pids.tolist())
        worker_senders += int(senders.sum())
parent_senders = sum(t.name == "ampwatch-sender" for t in threading.enumerate())
trainer.watch.close(timeout=10)
pathlib.Path(truth).write_text(json.dumps(dict(trainer.truth(), pid=os.getpid(), worker_pids=sorted(worker_pids),
                                               worker_senders=worker_senders, parent_senders=parent_senders)))
"""


def test_a_killed_rank_is_exposed_as_silent_and_alerted_while_the_other_rank_carries_on_exactly(tmp_path):
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"silent_after_s": 1, "silent_for_s": 1}))
    stop, run = str(tmp_path / "stop"), "rank-killed"
    ranks = []
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--silent-after", "1", "--expire-after", "60",
                                                               "--alert-thresholds", str(thresholds)]) as collector:
        try:
            ranks = [spawn_rank(RANK, collector.url, run, stop, str(tmp_path / f"truth{r}.json"), rank=r,
                                world_size=2) for r in (0, 1)]
            wait_for(lambda: all(value(scrape(collector.url), "ampwatch_iteration", run=run, rank=str(r))
                                 for r in (0, 1)), START_S, "both ranks to report")
            ranks[1].send_signal(signal.SIGKILL)  # no close(), no exit flush: the process is simply gone
            ranks[1].wait(SETTLE_S)
            killed_at = time.time()

            def silent_alert() -> list:
                firing = httpx.get(collector.url + "/v1/alerts", timeout=10).json()["firing"]
                return [a for a in firing if a["name"] == "AmpRankSilent"]
            wait_for(lambda: silent_alert(), what="AmpRankSilent to fire")
            alerts, text = silent_alert(), scrape(collector.url)
            print(f"\nAmpRankSilent fired {time.time() - killed_at:.1f} s after the SIGKILL")
            running = value(text, "ampwatch_iteration", run=run, rank="0")
            wait_for(lambda: value(scrape(collector.url), "ampwatch_iteration", run=run, rank="0") > running,
                     what="rank 0 to report further")
            pathlib.Path(stop).touch()
            out, _ = ranks[0].communicate(timeout=START_S)
            assert ranks[0].returncode == 0, out[-3000:]
            final = scrape(collector.url)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(SETTLE_S)
    assert [a["labels"]["rank"] for a in alerts] == ["1"] and alerts[0]["labels"]["run"] == run
    last_seen = {r: value(text, "ampwatch_rank_last_seen_timestamp_seconds", run=run, rank=r) for r in ("0", "1")}
    assert value(text, "ampwatch_rank_closed", run=run, rank="1") == 0
    assert last_seen["1"] <= killed_at and time.time() - last_seen["1"] > 1.0
    assert last_seen["0"] > killed_at, "the surviving rank kept reporting"
    assert value(text, "ampwatch_run_ranks_reporting", run=run) == 1
    check_rank_truth(final, run, 0, json.loads((tmp_path / "truth0.json").read_text()))
    assert value(final, "ampwatch_rank_closed", run=run, rank="1") == 0  # still exposed, still not closed


def test_dataloader_workers_forked_from_a_watched_process_never_send_and_no_event_is_doubled(tmp_path):
    run = "forking"
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        job = spawn_rank(FORKING, collector.url, run, str(tmp_path / "truth.json"))
        try:
            out, _ = job.communicate(timeout=START_S)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait(SETTLE_S)
        assert job.returncode == 0, out[-3000:]
        truth = json.loads((tmp_path / "truth.json").read_text())
        text = scrape(collector.url)
        summary = httpx.get(f"{collector.url}/v1/runs/{run}", timeout=10).json()["ranks"]
        events = httpx.get(f"{collector.url}/v1/runs/{run}/events", params={"limit": 1000}, timeout=10).json()
    print(f"\n{len(truth['worker_pids'])} workers forked; {truth['iterations']} iterations; "
          f"{len(events['events'])} events, each once")
    assert len(truth["worker_pids"]) >= 2 and truth["pid"] not in truth["worker_pids"]
    assert truth["worker_senders"] == 0, "a forked worker has a running sender"
    assert truth["parent_senders"] == 1, "exactly one sender in the training process"
    assert len(summary) == 1 and summary[0]["incarnations"] == 1 and summary[0]["pid"] == truth["pid"]
    check_rank_truth(text, run, 0, truth)
    ids = [e["id"] for e in events["events"]]
    assert events["next"] is None and ids == list(range(1, len(ids) + 1)), "an event is missing or doubled"
    assert [e["iteration"] for e in events["events"] if e["kind"] == "skip"] == truth["skipped_at"]
