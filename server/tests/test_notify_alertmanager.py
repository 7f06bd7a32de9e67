"""Notifications reach a real Alertmanager through its v2 API and come out of its webhook receiver."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import pytest

from ampwatch.server.alerting.alert import Alert
from ampwatch.server.alerting.notifications import Notifier, NotifyConfig, Target
from ampwatch_support.patience import START_S, wait_until
from ampwatch_support.webhook_receiver import WebhookReceiver, free_port

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ALERTMANAGER is None, reason="Alertmanager is not installed (.ci/run installs "
                                                    "prometheus-alertmanager from Debian)"),
]

CONFIG = """\
route:
  receiver: test-hook
  group_by: [alertname, run]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: test-hook
    webhook_configs:
      - url: {url}/am-hook
        send_resolved: true
"""


@pytest.fixture
def alertmanager(tmp_path):
    """A real Alertmanager on a free loopback port, its webhook pointing at a receiver in this test."""
    with WebhookReceiver() as receiver:
        (tmp_path / "alertmanager.yml").write_text(CONFIG.format(url=receiver.url))
        port = free_port()
        log = open(tmp_path / "alertmanager.log", "wb")
        proc = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}", f"--storage.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
                try:
                    with urllib.request.urlopen(url + "/-/ready", timeout=1) as answer:
                        return answer.status == 200
                except OSError:
                    return False

            wait_until(ready, START_S, "Alertmanager to be ready", every=0.1)
            yield url, receiver
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()


def test_an_alert_posted_to_alertmanager_reaches_its_webhook_firing_then_resolved(alertmanager):
    url, receiver = alertmanager
    alert = Alert(name="AmpConsecutiveSkippedSteps",
                  labels={"run": "exp-42", "rank": "1", "optimizer": "disc", "severity": "critical"},
                  annotations={"summary": "Optimizer disc skipped 64 steps in a row", "description": "d",
                               "runbook_url": "https://example.invalid/docs/alerts.md#ampconsecutiveskippedsteps"},
                  starts_at=time.time())
    target = Target(kind="alertmanager", url=url)
    with Notifier([target], NotifyConfig(backoff_initial_s=0.1, resend_interval_s=60)) as notifier:
        notifier.submit([alert])
        got = receiver.wait_for(lambda reqs: any(r["body"]["status"] == "firing" for r in reqs), timeout=20)
        notifier.submit([alert.resolved(time.time())])
        got = receiver.wait_for(lambda reqs: any(r["body"]["status"] == "resolved" for r in reqs), timeout=20)
    firing = next(r["body"] for r in got if r["body"]["status"] == "firing")
    (item,) = firing["alerts"]
    assert item["labels"] == {"alertname": "AmpConsecutiveSkippedSteps", "run": "exp-42", "rank": "1",
                              "optimizer": "disc", "severity": "critical"}
    assert item["annotations"]["summary"] == "Optimizer disc skipped 64 steps in a row"
    assert firing["groupLabels"] == {"alertname": "AmpConsecutiveSkippedSteps", "run": "exp-42"}
    resolved = next(r["body"] for r in got if r["body"]["status"] == "resolved")
    assert resolved["alerts"][0]["status"] == "resolved"
    assert notifier.counts()[(target.name, "sent")] == 2 and notifier.counts()[(target.name, "dropped")] == 0
