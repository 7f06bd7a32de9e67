"""The collector evaluates its built-in alerts as batches land, lists them at /v1/alerts and notifies targets."""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import time
from itertools import pairwise

import pytest
from fastapi.testclient import TestClient

from ampwatch.server import ServerConfig, create_app
from ampwatch.server.__main__ import build_parser
from ampwatch.server._config import config_from_args
from ampwatch.server.alerting.notifications import parse_targets
from ampwatch_support.batches import make_batch, optimizer
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until


def test_a_skip_streak_alert_is_listed_and_sent_at_the_ingest_that_crosses_the_threshold(config_for, receiver):
    # The collector's options reach the notifier: a group wait of 2 s, then one grouped notification.
    config = config_for(webhook=parse_targets(f"webhook:{receiver.url}/hook"), notify_group_wait=2.0)
    assert config.notify_group_interval == 60.0
    with TestClient(create_app(config)) as client:
        streak = {"gen": optimizer(steps=200, skipped=15, consecutive=15, longest=15, streaks=1,
                                   reached={"1": 1, "2": 1, "4": 1, "8": 1})}
        assert client.post("/v1/ingest", json=make_batch(seq=1, iteration=215, optimizers=streak)).status_code == 200
        assert client.get("/v1/alerts").json()["firing"] == []
        streak = {"gen": optimizer(steps=200, skipped=16, consecutive=16, longest=16, streaks=1,
                                   reached={"1": 1, "2": 1, "4": 1, "8": 1, "16": 1})}
        crossed = time.monotonic()  # the alert fires after this, and its group waits 2 s from then
        assert client.post("/v1/ingest", json=make_batch(seq=2, iteration=216, optimizers=streak)).status_code == 200
        # No tick in between: the answer to this very ingest already has the alert firing.
        (alert,) = client.get("/v1/alerts").json()["firing"]
        got = receiver.wait_for(lambda reqs: len(reqs) == 1)
        assert got[0]["time"] - crossed >= 2.0 and got[0]["body"]["groupLabels"]["run"] == "exp-42"
        wait_until(lambda: value(client.get("/metrics").text, "ampwatch_collector_notifications_total",
                                 target=f"webhook:127.0.0.1:{receiver.port}", outcome="sent") == 1.0,
                   what="the sent notification to be counted in /metrics")
    assert alert["name"] == "AmpConsecutiveSkippedSteps" and alert["status"] == "firing"
    assert alert["labels"] == {"run": "exp-42", "rank": "0", "optimizer": "gen", "severity": "warning"}
    assert alert["value"] == 16 and alert["ends_at"] is None
    (sent,) = got[0]["body"]["alerts"]
    assert got[0]["path"] == "/hook" and sent["labels"]["alertname"] == "AmpConsecutiveSkippedSteps"
    assert sent["fingerprint"] == alert["fingerprint"]


def test_a_clean_run_has_no_alerts_and_no_notification(config_for, receiver):
    with TestClient(create_app(config_for(webhook=parse_targets(receiver.url)))) as client:
        passes = _passes_after(client, ingested := threading.Event())
        for seq in range(1, 4):
            batch = make_batch(seq=seq, iteration=100 * seq, optimizers={"gen": optimizer(steps=100 * seq)})
            assert client.post("/v1/ingest", json=batch).status_code == 200
        ingested.set()
        wait_until(lambda: passes, what="a periodic evaluation after the ingests")
        assert client.get("/v1/alerts").json() == {"firing": [], "resolved": []}
    assert receiver.attempts == []  # closed: close() sent whatever notification was due


def _passes_after(client: TestClient, event: threading.Event) -> list[float]:
    """From now on, record each periodic pass of the app's alert service that began after ``event`` was set.

    The real pass runs (the collector calls its service's ``tick`` every period); this only counts it.
    """
    service, passes = client.app.state.alert_service, []
    tick = service.tick

    def counted(state, now=None):
        began = event.is_set()
        tick(state, now)
        if began:
            passes.append(time.monotonic())

    service.tick = counted
    return passes


def test_a_bad_webhook_setting_is_refused_with_what_to_write(monkeypatch):
    monkeypatch.setenv("AMPWATCH_SERVER_WEBHOOK", "teams:http://x")
    with pytest.raises(ValueError, match="kind 'teams' is unknown; use one of webhook, alertmanager, slack"):
        config_from_args(build_parser().parse_args([]))
    with pytest.raises(ValueError, match=r"webhook='teams:http://x' must be a tuple of notification targets"):
        ServerConfig(webhook="teams:http://x")  # text given to the dataclass itself is refused, not half-read


def test_the_status_page_and_its_files_are_served_with_a_strict_content_policy(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "//" not in page.text.split("<body>")[0]  # nothing loaded from another origin (no CDN)
    # The page carries its scripts (small files, in the order index.html lists them) and style sheet inline (one
    # round trip fewer before its first rows), and its policy allows exactly those by hash: no other inline script
    # or style runs.
    listed = re.findall(r'<script src="static/([\w.-]+)"></script>', client.get("/static/index.html").text)
    inline = re.findall(r"<script>(.*?)</script>", page.text, re.S)
    assert listed[-1] == "app.js" and len(listed) > 1 and page.text.count("<script") == len(inline) == len(listed)
    for name, text in zip(listed, inline, strict=True):
        script = client.get(f"/static/{name}")
        assert script.status_code == 200 and text == script.text, name
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy.split("script-src")[1].split(";")[0], name
        assert not any(sink in script.text for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML",
                                                        "document.write")), name
    assert "unsafe-inline" not in policy
    assert policy.split("script-src")[1].split(";")[0].count("'sha256-") == len(listed)
    script = client.get("/static/app.js")
    assert client.get("/static/style.css").status_code == 200
    # Answered from memory with a version: a browser revalidating gets a 304, an unknown file a 404.
    assert script.headers["content-type"].startswith("text/javascript") and script.headers["etag"]
    again = client.get("/static/app.js", headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304 and not again.content
    assert client.get("/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
    assert client.get("/static/app.js", headers={"If-None-Match": '"other"'}).text == script.text
    assert client.get("/static/nope.js").status_code == 404


def test_the_periodic_pass_pauses_after_each_stretch_of_work_and_finds_what_a_pass_without_pauses_finds(monkeypatch):
    from ampwatch.server import _pacing
    from ampwatch.server._state import RankSnapshot
    from ampwatch.server.alerting.evaluator import BuiltinAlerts
    from ampwatch.server.alerting.service import PASS_BREATHER_S, PASS_WORK_S, AlertService

    paced, plain = AlertService().alerts, BuiltinAlerts()
    for alerts in (paced, plain):
        for rank in range(300):
            alerts.observe(RankSnapshot(run="r", rank=rank, last_seen=0.0))
    sleeps: list[float] = []
    monkeypatch.setattr(_pacing.time, "sleep", sleeps.append)  # counted, not slept
    clock = [0.0]  # the pacer's clock, moved by hand: a slice of ranks takes what the test says
    monkeypatch.setattr(_pacing.time, "perf_counter", lambda: clock[0])
    paced.evaluate(now=10_000.0)  # silent; no time passes: no pause
    plain.evaluate(now=10_000.0)
    assert sleeps == []

    def slow_slice() -> None:  # each slice of 16 ranks as long as PASS_WORK_S / 2
        clock[0] += PASS_WORK_S / 2

    monkeypatch.setattr(_pacing.Pacer, "__call__", _timed(_pacing.Pacer.__call__, slow_slice))
    paced.evaluate(now=20_000.0)  # silent for longer than the alert's for:
    plain.evaluate(now=20_000.0)
    assert sleeps == [PASS_BREATHER_S] * 9  # 300 ranks: 19 slices of 16, a pause after every second one
    firing = sorted(a.fingerprint for a in paced.firing())
    assert firing == sorted(a.fingerprint for a in plain.firing())
    assert len(firing) == 300  # every rank is silent by then


def _timed(call, work):
    def between(self) -> None:
        work()
        call(self)
    return between


def test_periodic_passes_start_a_period_apart_however_long_a_pass_takes():
    import asyncio

    from ampwatch.server.alerting.service import AlertService

    service = AlertService(period_s=0.5)
    starts: list[float] = []

    def slow_tick(state, now=None) -> None:  # a pass as long as the period (at 16,384 ranks: about a second)
        starts.append(time.monotonic())
        time.sleep(0.5)

    service.tick = slow_tick  # type: ignore[method-assign]

    async def four_passes() -> None:
        task = asyncio.create_task(service.run(state=None))  # type: ignore[arg-type]
        while len(starts) < 4:
            await asyncio.sleep(0.01)
        task.cancel()

    try:
        asyncio.run(asyncio.wait_for(four_passes(), timeout=60))
    finally:
        service.close()
    gaps = [b - a for a, b in pairwise(starts)]
    # A period *between* passes would make each gap the pass plus the period: 1 s. Alerts the pass decides (a
    # streak fires once two passes in a row found it; a silent rank) would come that much later.
    assert max(gaps) < 0.9, gaps
