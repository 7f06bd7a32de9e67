"""End to end with the real programs: 2-rank gloo jobs -> collector -> Prometheus (generated rules) -> Alertmanager
-> webhook.

Everything listens on 127.0.0.1. The rules are generated from the same code as the
committed ones, with thresholds and windows shortened to seconds so the whole chain runs
in well under two minutes. Every process started here is stopped in a finalizer, even
when a test fails.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ampwatch.contract.metrics import METRICS
from ampwatch.contract.thresholds import AlertThresholds
from ampwatch.dashboards.dashboard import dashboard_json, panel_queries
from ampwatch.dashboards.rules import render_rules
from ampwatch_support.patience import SETTLE_S
from ampwatch_support.prometheus_stack import (
    Processes,
    binary,
    get,
    query_range,
    start_prometheus,
    wait_for_scrapes,
    wait_until,
)
from ampwatch_support.webhook_receiver import free_port

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
)
GRAFANA_VARIABLES = {"$run": ".*", "$rank": ".*", "$optimizer": ".*", "$__rate_interval": "4s", "$__range": "30s"}


class _Receiver:
    """Record the JSON payloads Alertmanager's webhook POSTs to a loopback HTTP server."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, alertname: str, status: str, **labels: str) -> list[dict]:
        with self.lock:
            return [a for p in self.payloads for a in p["alerts"]
                    if a["labels"].get("alertname") == alertname and a["status"] == status
                    and all(a["labels"].get(k) == v for k, v in labels.items())]

    def summary(self) -> str:
        with self.lock:
            return "; ".join(f'{a["status"]} {a["labels"].get("alertname")} run={a["labels"].get("run")} '
                             f'optimizer={a["labels"].get("optimizer")}'
                             for p in self.payloads for a in p["alerts"]) or "nothing received"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Start collector, Alertmanager, Prometheus and the two jobs; yield what the tests need."""
    tmp = tmp_path_factory.mktemp("e2e")
    processes = Processes(tmp)
    receiver = _Receiver()
    try:
        collector_port, second_port, am_port, prom_port = (free_port() for _ in range(4))
        collector, second = f"http://127.0.0.1:{collector_port}", f"http://127.0.0.1:{second_port}"
        for name, port in (("collector", collector_port), ("collector-2", second_port)):
            processes.start(name, [str(Path(sys.executable).parent / "ampwatch-server"), "--host", "127.0.0.1",
                                   "--port", str(port), "--db", str(tmp / f"{name}.db"), "--silent-after", "30"])
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "test", "group_by": ["alertname", "run", "optimizer"],
                      "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": receiver.url, "send_resolved": True}]}],
        }))
        processes.start("alertmanager", [binary("prometheus-alertmanager"),
                                         f"--config.file={tmp / 'alertmanager.yml'}",
                                         f"--storage.path={tmp / 'alertmanager'}",
                                         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="])
        prometheus = start_prometheus(processes, tmp, prom_port, render_rules(THRESHOLDS),
                                      [f"127.0.0.1:{collector_port}", f"127.0.0.1:{second_port}"],
                                      alertmanager=f"127.0.0.1:{am_port}")
        for url, name in ((collector, "collector"), (second, "collector-2")):
            wait_until(lambda url=url: get(url + "/readyz"), 30,
                       lambda name=name: f"{name} ready\n" + processes.log(name))
        wait_until(lambda: get(f"http://127.0.0.1:{am_port}/-/ready"), 30,
                    lambda: "alertmanager ready\n" + processes.log("alertmanager"))
        # Start the jobs only once it scrapes both collectors, so a short streak cannot come and go before that.
        wait_for_scrapes(processes, prometheus, targets=2)
        # One malformed batch, so the collector-health panel's "rejected" series has data too.
        bad = urllib.request.Request(collector + "/v1/ingest", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(bad, timeout=5)
        started = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        # A streak of 8 skips in a row, then a loss and gradient spike on rank 0 (its spike window shortened to 16
        # iterations, so that it is judged); then repeated single skips (backoff on both ranks, no streak) in a run
        # whose two ranks the agent pins to different collectors.
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
                            env=env),
        ]
        yield {"prometheus": prometheus, "collector": collector, "collectors": [collector, second],
               "run_split": run_split, "receiver": receiver, "jobs": jobs,
               "processes": processes, "started": started}
    finally:
        processes.stop_all()
        receiver.server.shutdown()


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
    """Return a run id whose rank 0 and rank 1 the agent pins to different collectors."""
    from ampwatch.agent._config import AgentConfig  # the agent's own pinning, not a copy of it
    config = AgentConfig.from_env(collector=[first, second], run="probe")
    return next(run for run in (f"e2e-split-{i}" for i in range(100))
                if config.collector_for(run, 0) != config.collector_for(run, 1))


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
