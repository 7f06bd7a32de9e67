"""The many-cluster stack of docs/central-store.md, with the real programs on loopback.

Two clusters, A and B, each a collector and its scraper: A's is Prometheus in agent mode, B's is vmagent (both
forms of the scraper), each adding ``cluster`` as an external label and remote-writing to one central
VictoriaMetrics. vmalert evaluates the rules ampwatch generates (the demo thresholds: windows of seconds) against
the store and sends to a real Alertmanager, whose webhook a loopback receiver records.

Both clusters run a job of the same name, ``train``, of two ranks: the rules keep runs of different clusters
apart (``by (cluster, run, ...)``), or cluster B's two healthy ranks would halve the share of A's ranks in a
streak, and the run-wide alert would carry no cluster.

vmalert reads back the recordings it writes, so the run-wide alert sees a storm a few evaluations (and new series'
delays) after the per-rank alerts it holds back do: the rules are generated for vmalert at 1 s evaluations
(``for_vmalert``, as docs/central-store.md says), and those per-rank alerts never fire.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ampwatch.contract.thresholds import DEMO_THRESHOLDS
from ampwatch.dashboards.generate import for_vmalert
from ampwatch.dashboards.rules import render_rules
from ampwatch_support.batches import OptimizerRun, make_batch, post_batch
from ampwatch_support.central_stack import instant_query, start_agent, start_alertmanager, start_store, start_vmalert
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import SETTLE_S, START_S
from ampwatch_support.prometheus_stack import Processes, get, wait_until
from ampwatch_support.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.timeout(300)

RUN = "train"
RANKS = (0, 1)
SCRAPER = {"A": "prometheus-agent", "B": "vmagent"}
# The demo's windows of seconds; the held-back per-rank alerts wait out vmalert's chain of recordings.
THRESHOLDS = for_vmalert(DEMO_THRESHOLDS, evaluation_s=1)


class _Job:
    """Both clusters' ``train`` jobs: every rank posts a batch each 0.3 s (so no rank goes silent); once
    :attr:`streak` is set, each rank of cluster A skips every step from then on."""

    def __init__(self, collectors: dict[str, str]) -> None:
        self.collectors, self.streak, self.stop = collectors, threading.Event(), threading.Event()
        self.runs = {(c, r): OptimizerRun() for c in collectors for r in RANKS}
        self.incarnations = {key: uuid.uuid4().hex for key in self.runs}
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._play, daemon=True)

    def _play(self) -> None:
        seq = 0
        try:
            while not self.stop.wait(0.3):
                seq += 1
                for (cluster, rank), run in self.runs.items():
                    if cluster == "A" and self.streak.is_set():
                        run.skip(seq)
                    else:
                        run.step()
                    post_batch(self.collectors[cluster], make_batch(
                        run=RUN, rank=rank, world_size=len(RANKS), local_rank=rank, host=f"{cluster}-node",
                        incarnation=self.incarnations[cluster, rank], seq=seq, sent_at=time.time(), iteration=seq,
                        optimizers={"gen": run.counters()}))
        except BaseException as error:  # the test reads it: a job that stopped posting explains a silent alert
            self.errors.append(error)

    def skipped(self, cluster: str) -> int:
        return sum(run.skipped for (c, _), run in self.runs.items() if c == cluster)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Start the store, Alertmanager, vmalert, and each cluster's collector and scraper; play both jobs."""
    tmp = tmp_path_factory.mktemp("central")
    processes, receiver = Processes(tmp), WebhookReceiver().start()
    collectors = {c: CollectorProcess(db=str(tmp / f"collector-{c}.db")) for c in SCRAPER}
    job = None
    try:
        store = start_store(processes, tmp)
        alertmanager = start_alertmanager(processes, tmp, receiver.url + "/alerts",
                                          group_by=["alertname", "cluster", "run", "rank"])
        vmalert = start_vmalert(processes, tmp, render_rules(THRESHOLDS), store, alertmanager)
        for cluster, collector in collectors.items():
            collector.start()
            start_agent(processes, tmp, SCRAPER[cluster], cluster, [collector.url.removeprefix("http://")], store)
        job = _Job({c: collector.url for c, collector in collectors.items()})
        job.thread.start()
        # The streak starts once the store holds both clusters' ranks, so vmalert sees it begin.
        wait_until(lambda: len(instant_query(store, f'ampwatch_rank_closed{{run="{RUN}"}}')) == 4, START_S,
                   lambda: f"both clusters' ranks in the store; job errors {job.errors}\n"
                           + processes.log("prometheus-agent-A") + processes.log("vmagent-B"))
        job.streak.set()
        yield {"store": store, "vmalert": vmalert, "receiver": receiver, "job": job, "processes": processes}
    finally:
        if job is not None:
            job.stop.set()
            job.thread.join(10)
        processes.stop_all()
        for collector in collectors.values():
            collector.kill()
        receiver.stop()


def _alerts(receiver: WebhookReceiver, status: str = "firing") -> list[dict[str, str]]:
    """The labels of every alert Alertmanager sent with ``status``."""
    return [alert["labels"] for request in list(receiver.requests) for alert in request["body"]["alerts"]
            if alert["status"] == status]


def _active(vmalert: str, name: str = "") -> list[tuple[str, str]]:
    """The alerts vmalert holds now (``name``'s only, if given), as (name, state: pending or firing)."""
    alerts = json.loads(get(vmalert + "/api/v1/alerts"))["data"]["alerts"]
    return [(a["name"], a["state"]) for a in alerts if not name or a["name"] == name]


def test_a_streak_in_cluster_a_fires_the_run_skip_storm_for_cluster_a_only(stack):
    receiver, processes = stack["receiver"], stack["processes"]
    storm = wait_until(
        lambda: [a for a in _alerts(receiver) if a["alertname"] == "AmpRunSkipStorm"], START_S,
        lambda: f"AmpRunSkipStorm from vmalert via Alertmanager; got {_alerts(receiver)}; job errors "
                f"{stack['job'].errors}\n" + processes.log("vmalert") + processes.log("alertmanager"))
    # Both of A's ranks are in a streak (of 4 skips, the warning, soon 16, the critical one): the run-wide alert
    # speaks for them, in cluster A, for run train.
    assert {(a["cluster"], a["run"]) for a in storm} == {("A", RUN)}, storm
    assert "warning" in {a["severity"] for a in storm}, storm
    # Once vmalert's recordings caught up, the storm holds back A's per-rank streak alerts: none pending or firing
    # (a pending one that goes away never fires), and none reached Alertmanager.
    wait_until(lambda: _active(stack["vmalert"], "AmpRunSkipStorm") and not _active(stack["vmalert"],
                                                                                   "AmpConsecutiveSkippedSteps"),
               START_S, lambda: f"vmalert holding back the per-rank alerts: {_active(stack['vmalert'])}")
    assert [a for a in _alerts(receiver) if a["alertname"] == "AmpConsecutiveSkippedSteps"] == []
    # Cluster B's run of the same name is healthy: no alert at all names it, and none lacks a cluster.
    assert [a for a in _alerts(receiver) if a.get("cluster") != "A"] == []
    assert stack["job"].errors == []


def test_the_central_store_holds_each_clusters_ranks_once_through_both_scrapers(stack):
    store, job = stack["store"], stack["job"]
    # Each rank of each cluster is one series (Prometheus agent wrote A's, vmagent B's), never merged or doubled.
    ranks = instant_query(store, f'count by (cluster, rank) (ampwatch_rank_closed{{run="{RUN}"}})')
    assert sorted((s["metric"]["cluster"], s["metric"]["rank"], s["value"][1]) for s in ranks) == [
        ("A", "0", "1"), ("A", "1", "1"), ("B", "0", "1"), ("B", "1", "1")]
    # vmalert's recording of a run's ranks counts each cluster's two, not four.
    counted = wait_until(lambda: instant_query(store, f'run:ampwatch_ranks:count{{run="{RUN}"}}'), SETTLE_S,
                         "vmalert's recording run:ampwatch_ranks:count in the store")
    assert sorted((s["metric"]["cluster"], s["value"][1]) for s in counted) == [("A", "2"), ("B", "2")]
    # The skips the store sums per cluster are the skips the job made there (A's streak; B none): counted once.
    job.stop.set()
    job.thread.join(10)
    sent = {c: job.skipped(c) for c in SCRAPER}
    assert sent["A"] > 0 and sent["B"] == 0

    def summed() -> dict[str, float]:
        result = instant_query(store, f'sum by (cluster) (ampwatch_optimizer_skipped_steps_total{{run="{RUN}"}})')
        return {s["metric"]["cluster"]: float(s["value"][1]) for s in result}

    wait_until(lambda: summed() == sent, SETTLE_S, lambda: f"the store's sums {summed()} to be the sent {sent}")
