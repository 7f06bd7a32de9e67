"""End to end with the real programs: 2-rank gloo jobs -> collector -> Prometheus (generated rules) -> Alertmanager
-> webhook; and three collector replicas against one collector alone, each scraped by its own Prometheus.

Everything listens on 127.0.0.1. The rules are generated from the same code as the
committed ones, with thresholds and windows shortened to seconds so the whole chain runs
in well under two minutes. Every process started here is stopped in a finalizer, even
when a test fails.

Across replicas (issue 41): beside the jobs, simulated ranks (protocol v1 batches) of two runs post, batch for
batch, both to the replica the contract's placement names (``ampwatch.contract.placement``, blocks of
BLOCK_RANKS ranks) and to a collector of their own; one Prometheus scrapes the three replicas, another the
collector alone, and both send to one Alertmanager (told apart by an external label, ``scraper``):

- STORM_RUN, 6 ranks in 3 blocks of 2, one on each replica: every rank has a loss and a gradient-norm spike, then
  skips every step for STORM batches (a streak past both thresholds, the scale backed off below 1, a high skip
  share). It fires each run-wide alert once (RUN_WIDE), no per-rank alert (held back), no desync.
- DESYNC_RUN, 4 ranks in 2 blocks of 2: the second block's ranks train at a quarter of the first's scale, so each
  replica sees one scale and only across replicas do they disagree. It fires one AmpLossScaleDesync.
- ONE_RUN, 2 ranks, whole on one replica: rank 1 alone has the same storm. It fires ONE_RUN_FIRES: rank 1's own
  alerts, a desync, sustained backoff.

Each side fires the same, but for the instance label; and no rank is exposed by two replicas.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ampwatch.contract import placement
from ampwatch.contract.metrics import METRICS
from ampwatch.contract.thresholds import AlertThresholds
from ampwatch.dashboards.dashboard import VARIABLES_AT_ALL, dashboard_json, panel_queries
from ampwatch.dashboards.rules import render_rules
from ampwatch_support.batches import SimulatedRank, post_batch
from ampwatch_support.patience import SETTLE_S
from ampwatch_support.prometheus_stack import (
    Processes,
    binary,
    get,
    query,
    query_range,
    start_prometheus,
    wait_for_scrapes,
    wait_until,
)
from ampwatch_support.webhook_receiver import WebhookReceiver, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "e2e_ddp_job.py"
RUN_STREAK = "e2e-streak"
# Seconds instead of minutes; the alert logic is the committed one.
THRESHOLDS = AlertThresholds(
    calibration_iterations=5, skip_streak_warning=4, skip_streak_critical=16, skip_streak_window_s=6,
    backoff_window_s=6, backoff_min_count=3, backoff_for_s=1, collapsed_for_s=1, desync_for_s=5,
    skip_ratio_window_s=10, skip_ratio_for_s=1, silent_after_s=30, silent_for_s=1,
    scheduler_window_s=6, poisoned_window_s=6,
    storm_edge_for_s=3,  # three of Prometheus's 1 s evaluations: a per-rank alert held back can fire within the test
)
BLOCK_RANKS = 2  # the replicas' --block-ranks: a run of more ranks is split in blocks of 2 over them
STORM_RUN, DESYNC_RUN, ONE_RUN = "x-storm", "x-desync", "x-one"
RANKS = {STORM_RUN: 6, DESYNC_RUN: 4, ONE_RUN: 2}
PERIOD_S, ITERATIONS_PER_BATCH = 0.5, 32  # 64 steps a second: a skip share judged over enough steps
HEALTHY, STORM, AFTER = 6, 4, 20  # batches of each phase; then each rank closes
# What each run fires, replicas and alone alike: (alertname, rank, optimizer, severity); "" where a label is absent.
RUN_WIDE = {("AmpRunSkipStorm", "", "", "warning"), ("AmpRunSkipStorm", "", "", "critical"),
            ("AmpRunLossScaleCollapsed", "", "", "critical"), ("AmpRunHighSkippedStepRatio", "", "", "warning"),
            ("AmpSustainedLossScaleBackoff", "", "", "warning"), ("AmpRunLossSpike", "", "", "warning"),
            ("AmpRunGradNormSpike", "", "", "warning")}
DESYNC = {("AmpLossScaleDesync", "", "", "warning")}
ONE_RUN_FIRES = {("AmpConsecutiveSkippedSteps", "1", "gen", "warning"),
                 ("AmpConsecutiveSkippedSteps", "1", "gen", "critical"),
                 ("AmpLossScaleCollapsed", "1", "", "critical"), ("AmpHighSkippedStepRatio", "1", "gen", "warning"),
                 ("AmpLossScaleDesync", "", "", "warning"), ("AmpSustainedLossScaleBackoff", "", "", "warning")}
GRAFANA_VARIABLES = {**VARIABLES_AT_ALL, "$__rate_interval": "4s", "$__range": "30s"}


class _Receiver(WebhookReceiver):
    """What Alertmanager's webhook POSTed, read as the alerts the payloads carry."""

    def received(self) -> list[dict]:
        return [alert for request in list(self.requests) for alert in request["body"]["alerts"]]

    def alerts(self, alertname: str, status: str, **labels: str) -> list[dict]:
        return [a for a in self.received() if a["labels"].get("alertname") == alertname and a["status"] == status
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def summary(self) -> str:
        return "; ".join(f'{a["status"]} {a["labels"].get("alertname")} run={a["labels"].get("run")} '
                         f'optimizer={a["labels"].get("optimizer")}' for a in self.received()) or "nothing received"


def _start_collector(processes: Processes, folder: Path, name: str, port: int, *args: str) -> str:
    processes.start(name, [str(Path(sys.executable).parent / "ampwatch-server"), "--host", "127.0.0.1",
                           "--port", str(port), "--db", str(folder / f"{name}.db"), "--silent-after", "30", *args])
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Start three replicas and a collector alone, Alertmanager, a Prometheus for each side, the two jobs and the
    replicas' simulated runs; yield what the tests need."""
    tmp = tmp_path_factory.mktemp("e2e")
    processes = Processes(tmp)
    receiver = _Receiver().start()
    stop = threading.Event()
    sender = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        ports = [free_port() for _ in range(3)]
        peers = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        replicas = [_start_collector(processes, tmp, f"replica-{i}", port, "--peers", peers,
                                     "--block-ranks", str(BLOCK_RANKS)) for i, port in enumerate(ports)]
        alone = _start_collector(processes, tmp, "alone", free_port())
        collector, second = replicas[:2]  # the jobs' collectors
        am_port = free_port()
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "test", "group_by": ["alertname", "run", "optimizer"],
                      "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test",
                           "webhook_configs": [{"url": receiver.url + "/alerts", "send_resolved": True}]}],
        }))
        processes.start("alertmanager", [binary("prometheus-alertmanager"),
                                         f"--config.file={tmp / 'alertmanager.yml'}",
                                         f"--storage.path={tmp / 'alertmanager'}",
                                         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="])
        prometheus, prometheus_alone = (
            start_prometheus(processes, tmp, free_port(), render_rules(THRESHOLDS),
                             [url.removeprefix("http://") for url in urls], alertmanager=f"127.0.0.1:{am_port}",
                             name=name, external_labels={"scraper": scraper})
            for name, scraper, urls in (("prometheus", "replicas", replicas), ("prometheus-alone", "alone", [alone])))
        for url, name in (*((url, f"replica-{i}") for i, url in enumerate(replicas)), (alone, "alone")):
            wait_until(lambda url=url: get(url + "/readyz"), 30,
                       lambda name=name: f"{name} ready\n" + processes.log(name))
        wait_until(lambda: get(f"http://127.0.0.1:{am_port}/-/ready"), 30,
                    lambda: "alertmanager ready\n" + processes.log("alertmanager"))
        # Start the jobs only once it scrapes every collector, so a short streak cannot come and go before that.
        wait_for_scrapes(processes, prometheus, targets=len(replicas))
        wait_for_scrapes(processes, prometheus_alone, name="prometheus-alone")
        # One malformed batch, so the collector-health panel's "rejected" series has data too.
        bad = urllib.request.Request(collector + "/v1/ingest", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(bad, timeout=5)
        started = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        # A streak of 8 skips in a row, then a loss and gradient spike on rank 0 (its spike window shortened to 16
        # iterations, so that it is judged); then repeated single skips (backoff on both ranks, no streak) in a run
        # split in blocks of one rank over two collectors.
        run_split = _run_split_across(collector, second)
        jobs = [
            processes.start("job-streak", [sys.executable, str(JOB), "--collector", collector, "--run", RUN_STREAK,
                                           "--iterations", "200", "--overflow-at", "40-47", "--spike-at", "150",
                                           # the streak lasts 4 s: scrapes every second see it under way (the
                                           # streak panel's gauge), however the agent's batches fall
                                           "--overflow-sleep", "0.5"], env={**env, "AMPWATCH_SPIKE_WINDOW": "16"}),
            processes.start("job-backoff", [sys.executable, str(JOB), "--collector", f"{collector},{second}",
                                            "--run", run_split,
                                            "--iterations", "260", "--overflow-at", "140,144,148,152,156,160"],
                            env={**env, "AMPWATCH_BLOCK_RANKS": "1"}),
        ]
        stream = sender.submit(_stream_runs, replicas, alone, stop)
        yield {"prometheus": prometheus, "prometheus_alone": prometheus_alone, "collector": collector,
               "collectors": [collector, second], "replicas": replicas, "stream": stream,
               "run_split": run_split, "receiver": receiver, "jobs": jobs,
               "processes": processes, "started": started}
    finally:
        stop.set()
        sender.shutdown(wait=True)
        processes.stop_all()
        receiver.stop()


def _wait_for_jobs(stack: dict) -> None:
    for job in stack["jobs"]:
        job.wait(timeout=120)
    for name in ("job-streak", "job-backoff"):
        assert [j.returncode for j in stack["jobs"]] == [0, 0], stack["processes"].log(name)


def test_a_skip_streak_on_both_ranks_of_a_ddp_job_fires_one_amp_run_skip_storm_then_resolves(stack):
    # DDP ranks skip together: one alert for the run, which speaks for both ranks' streak alerts.
    receiver = stack["receiver"]
    # Generous: the first test also waits for both DDP jobs to start (torch, gloo) on a loaded machine.
    fired = wait_until(lambda: receiver.alerts("AmpRunSkipStorm", "firing", run=RUN_STREAK, severity="warning"),
                       150, receiver.summary)
    assert "100% of the ranks of run e2e-streak" in fired[0]["annotations"]["description"]
    assert "skipped at least 4 consecutive steps" in fired[0]["annotations"]["description"]
    assert fired[0]["annotations"]["runbook_url"].endswith("#amprunskipstorm")
    assert "rank" not in fired[0]["labels"] and "optimizer" not in fired[0]["labels"]
    wait_until(lambda: receiver.alerts("AmpRunSkipStorm", "resolved", run=RUN_STREAK), 60, receiver.summary)


def test_repeated_backoff_on_both_ranks_fires_amp_sustained_loss_scale_backoff_across_two_collectors(stack):
    receiver, run = stack["receiver"], stack["run_split"]
    fired = wait_until(lambda: receiver.alerts("AmpSustainedLossScaleBackoff", "firing", run=run), 90,
                        receiver.summary)
    assert f"100% of the open ranks of run {run}" in fired[0]["annotations"]["description"]
    # Each collector held one rank; only Prometheus saw both, and counted both as backing off.
    ranks = [_ranks_held(url, run) for url in stack["collectors"]]
    assert sorted(map(sorted, ranks)) == [["0"], ["1"]], ranks
    counted = query_range(stack["prometheus"], f'run:ampwatch_ranks_sustained_backoff:count6s{{run="{run}"}}',
                           stack["started"])
    assert max(float(v) for _, v in counted[0]["values"]) == 2
    _wait_for_jobs(stack)
    # Its skips never came two in a row, so the streak alert stayed silent for that run.
    assert receiver.alerts("AmpConsecutiveSkippedSteps", "firing", run=run) == []


def test_a_planted_spike_on_one_rank_of_a_ddp_job_names_that_rank_as_the_gradient_outlier(stack):
    # Rank 0's input 100 times larger at one iteration: its own gradients stand out from rank 1's before the
    # all-reduce (the collector's gradient_outlier), and the all-reduced norm spikes on both ranks (one run alert).
    receiver = stack["receiver"]
    fired = wait_until(lambda: receiver.alerts("AmpRankGradientOutlier", "firing", run=RUN_STREAK), 150,
                       receiver.summary)
    assert {(a["labels"]["rank"], a["labels"]["local_rank"]) for a in fired} == {("0", "0")}
    assert fired[0]["labels"]["host"] and "(host " in fired[0]["annotations"]["description"]
    wait_until(lambda: receiver.alerts("AmpRunGradNormSpike", "firing", run=RUN_STREAK), 60, receiver.summary)
    _wait_for_jobs(stack)
    assert receiver.alerts("AmpRankGradientOutlier", "firing", rank="1") == []


def _ranks_held(collector: str, run: str) -> set[str]:
    """Return the ranks of ``run`` a collector exposes in /metrics."""
    families = text_string_to_metric_families(get(collector + "/metrics").decode())
    return {sample.labels["rank"] for family in families if family.name == "ampwatch_iteration"
            for sample in family.samples if sample.labels.get("run") == run}


def _run_split_across(first: str, second: str) -> str:
    """Return the run of the backoff job, whose rank 0 and rank 1 the contract's placement puts on different
    collectors in blocks of one rank (the job's AMPWATCH_BLOCK_RANKS)."""
    run = "e2e-split-5"
    placed = {placement.collector_for(run, rank, 2, [first, second], block_ranks=1) for rank in (0, 1)}
    assert placed == {first, second}
    return run


def test_every_dashboard_panel_query_returns_data_from_prometheus(stack):
    wait_until(lambda: stack["receiver"].alerts("AmpSustainedLossScaleBackoff", "firing"), 90,
                stack["receiver"].summary)
    _wait_for_jobs(stack)
    # Prometheus has scraped both collectors, and evaluated its rules, since the ranks closed: a scrape of
    # each 2 s (two intervals) after that. Its own progress, not a sleep a loaded machine may outlast.
    ended = time.time()
    wait_until(lambda: len(query_range(stack["prometheus"], f"timestamp(up) > {ended + 2}", ended)) >= 2, SETTLE_S,
               "Prometheus to scrape both collectors after the ranks closed")
    empty = []
    for title, expr in panel_queries(dashboard_json(THRESHOLDS)):
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        if not query_range(stack["prometheus"], expr, stack["started"]):
            empty.append(f"{title}: {expr}")
    assert empty == [], "panel queries without data:\n" + "\n".join(empty)


def test_every_metric_the_rules_and_panels_read_is_exposed_by_the_collector(stack):
    _wait_for_jobs(stack)
    exposed = set(re.findall(r"^(ampwatch_[a-z_]+?)(?:_bucket|_count|_sum)?[{ ]",
                             get(stack["collector"] + "/metrics").decode(), flags=re.M))
    queries = render_rules(THRESHOLDS) + "\n".join(expr for _, expr in panel_queries(dashboard_json(THRESHOLDS)))
    # Series names, not the recording rules' level:metric:operation names; histograms by their family name.
    read = {re.sub(r"_bucket$", "", name) for name in re.findall(r"(?<![:\w])(ampwatch_[a-z_]+)", queries)}
    assert read and read <= {metric.name for metric in METRICS}
    assert read - exposed == set()


def _stream_runs(replicas: list[str], alone: str, stop: threading.Event) -> float:
    """Post the simulated runs' batches, PERIOD_S apart, each to the replica the contract's placement names and to
    the collector alone; return the time the last ones (the ranks closing) were answered."""
    ranks = [SimulatedRank(run, rank, size, ITERATIONS_PER_BATCH,
                           2.0 ** 14 if run == DESYNC_RUN and rank >= BLOCK_RANKS else 2.0 ** 16)
             for run, size in RANKS.items() for rank in range(size)]
    placed = {rank: placement.collector_for(rank.run, rank.rank, rank.world_size, replicas, BLOCK_RANKS)
              for rank in ranks}
    storming = {(STORM_RUN, rank) for rank in range(RANKS[STORM_RUN])} | {(ONE_RUN, 1)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(replicas) + 1) as posting:
        for number in range(HEALTHY + STORM + AFTER + 1):
            began = time.monotonic()
            batches: dict[str, list[dict]] = {}
            for rank in ranks:
                storm = HEALTHY <= number < HEALTHY + STORM and (rank.run, rank.rank) in storming
                sent = rank.batch(skipping=storm, spike=rank.run == STORM_RUN and number == HEALTHY - 1,
                                  closed=number == HEALTHY + STORM + AFTER)
                for url in (placed[rank], alone):
                    batches.setdefault(url, []).append(sent)
            # Each collector's batches in order, the collectors side by side: a batch reaches both sides alike.
            list(posting.map(lambda item: [post_batch(item[0], sent) for sent in item[1]], batches.items()))
            if stop.wait(max(0.0, PERIOD_S - (time.monotonic() - began))):
                raise RuntimeError("the stack stopped before the simulated runs ended")
    return time.time()


def _identity(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """An alert instance's labels, those its Prometheus (``scraper``) and the ALERTS series add left out."""
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("scraper", "alertstate", "__name__")))


def _fired(stack: dict) -> dict[str, list[dict[str, str]]]:
    """Return, for each side (the replicas, the collector alone), every alert instance Alertmanager was sent firing
    for the simulated runs, once the runs ended, nothing more can fire for them, and every instance either
    Prometheus fired reached Alertmanager."""
    if "fired" not in stack:
        ended = stack["stream"].result(timeout=SETTLE_S * 4)
        runs = f'run=~"{"|".join(RANKS)}"'
        sides = {"replicas": stack["prometheus"], "alone": stack["prometheus_alone"]}
        for side, prometheus in sides.items():
            # Its rules ran on scrapes of every collector since the ranks closed (two intervals after), and nothing
            # is pending for the runs: what fires for them has fired.
            wait_until(lambda p=prometheus: query(p, f"min(timestamp(up)) > {ended + 2}"), SETTLE_S,
                       f"the Prometheus of the {side} side to scrape after the ranks closed")
            wait_until(lambda p=prometheus: not query(p, f'ALERTS{{alertstate="pending", {runs}}}'), SETTLE_S,
                       f"no alert of the simulated runs pending in the Prometheus of the {side} side")

        def in_alertmanager(side: str) -> set[tuple]:
            return {_identity(a["labels"]) for a in stack["receiver"].received()
                    if a["status"] == "firing" and a["labels"].get("scraper") == side
                    and a["labels"].get("run") in RANKS}

        def in_prometheus(prometheus: str) -> set[tuple]:
            return {_identity(s["metric"]) for s in query_range(prometheus, f'ALERTS{{alertstate="firing", {runs}}}',
                                                                stack["started"])}

        wait_until(lambda: all(in_alertmanager(side) >= in_prometheus(p) for side, p in sides.items()), SETTLE_S,
                   lambda: f"Alertmanager to get every alert each Prometheus fired: {stack['receiver'].summary()}")
        stack["fired"] = {side: [dict(labels) for labels in in_alertmanager(side)] for side in sides}
    return stack["fired"]


def _alert(labels: dict[str, str]) -> tuple[str, str, str, str]:
    return labels["alertname"], labels.get("rank", ""), labels.get("optimizer", ""), labels.get("severity", "")


def test_a_storm_and_a_desync_split_over_replicas_fire_each_run_wide_alert_once_in_alertmanager(stack):
    for run, expected in ((STORM_RUN, RUN_WIDE), (DESYNC_RUN, DESYNC)):
        fired = [labels for labels in _fired(stack)["replicas"] if labels["run"] == run]
        # One instance of each: an alert of each replica would come once per instance label; a per-rank alert (held
        # back while the run-wide one speaks for its rank) would name a rank; the storm's ranks share one scale (no
        # desync), the desync's blocks each theirs (its alert only from across replicas).
        assert sorted(map(_alert, fired)) == sorted(expected), run
        assert all(set(labels) == {"alertname", "run", "severity"} for labels in fired), fired


def test_a_run_on_one_replica_fires_the_same_alerts_as_on_a_collector_alone_and_so_does_a_split_run(stack):
    fired = _fired(stack)
    for run in RANKS:
        # The instance label names the collector scraped; every other label, and how many instances, the same.
        replicas, alone = (sorted(_identity({k: v for k, v in labels.items() if k != "instance"})
                                  for labels in fired[side] if labels["run"] == run) for side in ("replicas", "alone"))
        assert replicas == alone, run
    assert sorted(_alert(labels) for labels in fired["replicas"] if labels["run"] == ONE_RUN) == sorted(ONE_RUN_FIRES)


def test_no_rank_is_exposed_by_two_replicas_and_each_block_by_the_replica_placement_names(stack):
    prometheus, started = stack["prometheus"], stack["started"]
    stack["stream"].result(timeout=SETTLE_S * 4)
    assert query_range(prometheus, "count by (run, rank) (ampwatch_iteration) > 1", started) == []
    for run, size in RANKS.items():
        held: dict[str, set[str]] = {}
        for series in query_range(prometheus, f'ampwatch_iteration{{run="{run}"}}', started):
            held.setdefault(series["metric"]["instance"], set()).add(series["metric"]["rank"])
        placed: dict[str, set[str]] = {}
        for block in placement.blocks(run, size, stack["replicas"], BLOCK_RANKS):
            placed.setdefault(block.collector.removeprefix("http://"), set()).update(
                str(rank) for rank in range(block.first_rank, block.last_rank + 1))
        assert held == placed, run
    assert len({block.collector for block in placement.blocks(STORM_RUN, RANKS[STORM_RUN], stack["replicas"],
                                                              BLOCK_RANKS)}) == 3
