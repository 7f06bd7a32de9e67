"""Start the many-cluster stack of docs/central-store.md as real processes on loopback, for end-to-end tests.

A central VictoriaMetrics single node; per cluster one scraper that remote-writes to it with an external label
``cluster`` (Prometheus in agent mode, or vmagent); vmalert evaluating a rule file against the store and sending to
Alertmanager. Every process goes through :class:`ampwatch_support.prometheus_stack.Processes`, which stops each one
it started.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from ampwatch_support.patience import START_S
from ampwatch_support.ports import free_port
from ampwatch_support.prometheus_stack import Processes, binary, get, wait_until

__all__ = ["instant_query", "start_agent", "start_alertmanager", "start_store", "start_vmalert"]

SCRAPERS = ("prometheus-agent", "vmagent")
"""The two forms a cluster's scraper takes: the same scrape config and external label, either program."""


def _ready(processes: Processes, name: str, base: str, path: str) -> str:
    """Wait until ``base + path`` answers; return ``base``."""
    wait_until(lambda: get(base + path), START_S, lambda: f"{name} ready at {base}{path}\n" + processes.log(name))
    return base


def start_store(processes: Processes, folder: Path) -> str:
    """Start a VictoriaMetrics single node; return its URL (remote write at ``/api/v1/write``, queries at
    ``/api/v1/query``).

    It shows a sample as soon as it is written (``-search.latencyOffset``, 30 s by default, hides the newest
    samples from queries so that a slow scraper's are not half seen: a test's windows are seconds).
    """
    port = free_port()
    processes.start("victoria-metrics", [binary("victoria-metrics"), f"-storageDataPath={folder / 'vm-data'}",
                                         f"-httpListenAddr=127.0.0.1:{port}", "-search.latencyOffset=0s",
                                         "-search.disableCache", "-loggerLevel=WARN"])
    return _ready(processes, "victoria-metrics", f"http://127.0.0.1:{port}", "/health")


def start_agent(processes: Processes, folder: Path, form: str, cluster: str, targets: list[str],
                store: str) -> None:
    """Start a cluster's scraper (``form``: one of :data:`SCRAPERS`) scraping ``targets`` every second and
    remote-writing what it scrapes, labelled ``cluster``, to ``store``."""
    name = f"{form}-{cluster}"
    config: dict[str, Any] = {"global": {"scrape_interval": "1s"},
                              "scrape_configs": [{"job_name": "ampwatch", "static_configs": [{"targets": targets}]}]}
    port, where = free_port(), folder / name
    where.mkdir()
    # The label the way docker-compose.yml and deploy/overlays/central give it: Prometheus's external
    # label, vmagent's -remoteWrite.label.
    if form == "prometheus-agent":
        config["global"]["external_labels"] = {"cluster": cluster}
        # A batch goes within a second (5 s by default), as vmagent's -remoteWrite.flushInterval.
        config["remote_write"] = [{"url": f"{store}/api/v1/write", "queue_config": {"batch_send_deadline": "1s"}}]
        (where / "prometheus.yml").write_text(yaml.safe_dump(config))
        processes.start(name, [binary("prometheus"), "--enable-feature=agent",
                               f"--config.file={where / 'prometheus.yml'}", f"--storage.agent.path={where / 'wal'}",
                               f"--web.listen-address=127.0.0.1:{port}"])
        _ready(processes, name, f"http://127.0.0.1:{port}", "/-/ready")
    elif form == "vmagent":
        (where / "scrape.yml").write_text(yaml.safe_dump(config))
        processes.start(name, [binary("vmagent"), f"-promscrape.config={where / 'scrape.yml'}",
                               f"-remoteWrite.url={store}/api/v1/write", f"-remoteWrite.label=cluster={cluster}",
                               f"-remoteWrite.tmpDataPath={where / 'q'}",
                               f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN"])
        _ready(processes, name, f"http://127.0.0.1:{port}", "/health")
    else:
        raise ValueError(f"a scraper is one of {SCRAPERS}, not {form!r}")


def start_alertmanager(processes: Processes, folder: Path, webhook: str, group_by: list[str]) -> str:
    """Start Alertmanager sending every alert group (at once, and when resolved) to ``webhook``; return its URL."""
    port = free_port()
    (folder / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "hook", "group_by": group_by, "group_wait": "1s", "group_interval": "1s",
                  "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook, "send_resolved": True}]}],
    }))
    processes.start("alertmanager", [binary("prometheus-alertmanager"), f"--config.file={folder / 'alertmanager.yml'}",
                                     f"--storage.path={folder / 'alertmanager'}",
                                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="])
    return _ready(processes, "alertmanager", f"http://127.0.0.1:{port}", "/-/ready")


def start_vmalert(processes: Processes, folder: Path, rules: str, store: str, alertmanager: str) -> str:
    """Start vmalert evaluating the rule file ``rules`` every second against ``store`` (reading it, and writing
    the recording rules' series back to it) and sending alerts to ``alertmanager``; return its URL."""
    port = free_port()
    (folder / "rules.yaml").write_text(rules)
    processes.start("vmalert", [binary("vmalert"), f"-rule={folder / 'rules.yaml'}", f"-datasource.url={store}",
                                f"-remoteWrite.url={store}", f"-notifier.url={alertmanager}",
                                "-evaluationInterval=1s", "-remoteWrite.flushInterval=1s",
                                # An instant query sees the samples of the last 5 s: a few scrapes, as Prometheus's
                                # lookback sees a series until it goes stale.
                                "-datasource.queryStep=5s", f"-httpListenAddr=127.0.0.1:{port}", "-loggerLevel=WARN"])
    return _ready(processes, "vmalert", f"http://127.0.0.1:{port}", "/health")


def instant_query(url: str, expr: str) -> list[dict[str, Any]]:
    """Return the series of an instant query now (Prometheus query API, as VictoriaMetrics answers it)."""
    answer = json.loads(get(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]
