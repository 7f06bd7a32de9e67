"""/metrics: values from the state, promtool-clean, gzipped when asked, per-run views, streak ladder, docs agree."""

from __future__ import annotations

import asyncio
import gzip
import json
import pathlib
import re
import shutil
import subprocess
import urllib.request

import pytest

from ampwatch.contract.metrics import METRICS, OPTIMIZER_SKIPPED_STEPS, OPTIMIZER_STEPS
from ampwatch_support.batches import make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _two_ranks(client):
    first = make_batch(
        rank=0, iteration=12, loss_scale=32768.0, backoffs=1, growths=2, send_failures=0,
        optimizers={"gen": optimizer(steps=10, skipped=2, consecutive=2, longest=2, streaks=1,
                                     reached={"1": 1, "2": 1}, grad_norm_spikes=4,
                                     grad_norm={"mean": 1.5, "std": 0.25},
                                     local_grad_norm={"mean": 3.0, "std": 0.5}),
                    "disc": optimizer(steps=12)},
        events=[skip_event(1, params=("decoder.fc.weight",)), skip_event(2, streak=2, params=("enc.bias",))])
    first["state"].update(loss_spikes=3, loss={"mean": 2.5, "std": 0.125})
    client.post("/v1/ingest", json=first)
    client.post("/v1/ingest", json=make_batch(rank=1, incarnation="c" * 32, iteration=12, loss_scale=8192.0,
                                              optimizers={"gen": optimizer(steps=12), "disc": optimizer(steps=12)}))


def test_metrics_show_each_ranks_counters_and_gauges(client):
    _two_ranks(client)
    answer = client.get("/metrics", follow_redirects=False)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = answer.text
    r0 = {"run": "exp-42", "rank": "0"}
    assert value(text, "ampwatch_optimizer_steps_total", optimizer="gen", **r0) == 10
    assert value(text, "ampwatch_optimizer_skipped_steps_total", optimizer="gen", **r0) == 2
    assert value(text, "ampwatch_optimizer_consecutive_skipped_steps", optimizer="gen", **r0) == 2
    assert value(text, "ampwatch_optimizer_longest_skip_streak", optimizer="gen", **r0) == 2
    assert value(text, "ampwatch_optimizer_skip_streaks_total", optimizer="gen", min_length="2", **r0) == 1
    # A rung no streak reached is not exposed (the rules catch a rung's first count as a new non-zero series).
    assert value(text, "ampwatch_optimizer_skip_streaks_total", optimizer="gen", min_length="4", **r0) is None
    assert value(text, "ampwatch_loss_scale", **r0) == 32768.0
    assert value(text, "ampwatch_loss_scale_backoffs_total", **r0) == 1
    assert value(text, "ampwatch_loss_scale_growths_total", **r0) == 2
    assert value(text, "ampwatch_iteration", **r0) == 12
    assert value(text, "ampwatch_rank_closed", **r0) == 0
    assert value(text, "ampwatch_loss_spikes_total", **r0) == 3
    assert value(text, "ampwatch_optimizer_grad_norm_spikes_total", optimizer="gen", **r0) == 4
    assert value(text, "ampwatch_rank_gradient_outliers_total", **r0) == 0
    # The rolling levels, as the newest process sent them; only where it sent one.
    assert (value(text, "ampwatch_loss_mean", **r0), value(text, "ampwatch_loss_std", **r0)) == (2.5, 0.125)
    assert value(text, "ampwatch_optimizer_grad_norm_mean", optimizer="gen", **r0) == 1.5
    assert value(text, "ampwatch_optimizer_grad_norm_std", optimizer="gen", **r0) == 0.25
    assert value(text, "ampwatch_optimizer_local_grad_norm_mean", optimizer="gen", **r0) == 3.0
    assert value(text, "ampwatch_optimizer_local_grad_norm_std", optimizer="gen", **r0) == 0.5
    r1 = {"run": "exp-42", "rank": "1"}
    assert value(text, "ampwatch_optimizer_grad_norm_mean", optimizer="disc", **r0) is None
    assert value(text, "ampwatch_loss_mean", **r1) is None and value(text, "ampwatch_loss_spikes_total", **r1) == 0
    # Only the latest offending parameter: one series per rank and optimizer.
    assert value(text, "ampwatch_nonfinite_gradient_info", optimizer="gen", parameter="enc.bias", **r0) == 1
    assert "decoder.fc.weight" not in text
    assert value(text, "ampwatch_rank_info", host="node-a", local_rank="0", world_size="2", scaler_enabled="true",
                 scaler_kind="GradScaler", agent_version="0.1.0", **r0) == 1
    assert 'job="' not in text and 'instance="' not in text


def test_per_run_views_count_reporting_ranks_streaks_and_the_scale_spread(client):
    _two_ranks(client)
    text = client.get("/metrics").text
    assert value(text, "ampwatch_run_ranks_reporting", run="exp-42") == 2
    assert value(text, "ampwatch_run_ranks_in_skip_streak", run="exp-42") == 1
    assert value(text, "ampwatch_run_loss_scale_min", run="exp-42") == 8192.0
    assert value(text, "ampwatch_run_loss_scale_max", run="exp-42") == 32768.0
    assert value(text, "ampwatch_collector_batches_applied_total") == 2
    assert value(text, "ampwatch_collector_events_applied_total") == 2
    assert value(text, "ampwatch_collector_ranks_tracked") == 2
    assert value(text, "ampwatch_collector_database_size_bytes") > 0


def test_the_streak_ladder_lines_follow_a_rung_that_moves_an_optimizer_that_appears_and_a_restart(client):
    def rung(text, optimizer, length):
        return value(text, "ampwatch_optimizer_skip_streaks_total", run="exp-42", rank="0", optimizer=optimizer,
                     min_length=length)

    client.post("/v1/ingest", json=make_batch(seq=1, optimizers={"gen": optimizer(reached={"1": 1})}))
    first = client.get("/metrics").text
    assert (rung(first, "gen", "1"), rung(first, "gen", "2"), rung(first, "disc", "1")) == (1, None, None)
    client.post("/v1/ingest", json=make_batch(seq=2, optimizers={"gen": optimizer(reached={"1": 2, "2": 1}),
                                                                 "disc": optimizer(reached={"1": 1})}))
    second = client.get("/metrics").text
    assert (rung(second, "gen", "1"), rung(second, "gen", "2"), rung(second, "disc", "1")) == (2, 1, 1)
    # A new process of the same rank counts from zero again: the rank's totals add up both.
    client.post("/v1/ingest", json=make_batch(seq=1, incarnation="d" * 32, optimizers={"gen": optimizer(
        reached={"1": 1})}))
    third = client.get("/metrics").text
    assert (rung(third, "gen", "1"), rung(third, "gen", "2"), rung(third, "disc", "1")) == (3, 1, 1)


def test_a_disabled_scaler_exposes_no_loss_scale(client):
    batch = make_batch(loss_scale=None)
    batch["scaler"]["enabled"] = False
    client.post("/v1/ingest", json=batch)
    text = client.get("/metrics").text
    assert value(text, "ampwatch_loss_scale", run="exp-42", rank="0") is None
    assert value(text, "ampwatch_optimizer_steps_total", run="exp-42", rank="0", optimizer="gen") == 0


def test_the_exposition_passes_promtool_check_metrics(client):
    promtool = pytest.importorskip("shutil").which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus' (.ci/run does)")
    _two_ranks(client)
    result = subprocess.run([promtool, "check", "metrics"], input=client.get("/metrics").text, text=True,
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_every_exposed_family_is_in_the_contract_and_docs_metrics_and_every_documented_rank_series_is_exposed(
        client):
    from prometheus_client.parser import text_string_to_metric_families
    doc = (ROOT / "docs/metrics.md").read_text()
    documented = set(re.findall(r"^\| `(ampwatch_[a-z_]+)`", doc, re.M))
    documented |= set(re.findall(r"`(ampwatch_run_loss_scale_m(?:in|ax))`", doc))
    _two_ranks(client)

    def exposed_now() -> set[str]:
        names = set()
        for family in text_string_to_metric_families(client.get("/metrics").text):
            names |= {s.name for s in family.samples if not s.name.endswith(("_created", "_bucket", "_count", "_sum"))}
        return names

    # The device series follow the suspects' judgement, which judges new evidence no sooner than 5 times its last
    # judgement took (docs/collector.md, GET /v1/suspects): on a loaded machine a scrape right after the batches can
    # come before it.
    def with_devices() -> set[str] | None:
        names = exposed_now()
        return names if "ampwatch_device_suspect" in names else None

    exposed = wait_until(with_devices, what="the device series of the judged suspects in /metrics")
    assert {metric.name for metric in METRICS} == documented  # the contract's list is the documented list
    assert exposed - documented == set()
    assert {n for n in documented if not n.startswith("ampwatch_collector")} - exposed == set()


def _hold_ranks(state, ranks: int) -> None:
    """Put ``ranks`` ranks of run exp-42 straight into the state (HTTP posts would only slow a test down)."""
    import time

    from ampwatch.server._batch_parse import parse_batch
    from ampwatch.server._incarnation import next_incarnation
    from ampwatch.server._state import RankState
    for rank in range(ranks):
        batch = parse_batch(json.dumps(make_batch(
            rank=rank, world_size=ranks, incarnation=f"{rank:032x}",
            optimizers={"gen": optimizer(steps=rank + 5, skipped=rank % 3), "disc": optimizer(steps=2 * rank)})))
        held = RankState(batch.run, batch.rank)
        held.install(next_incarnation(None, batch, time.time(), 128))
        state.adopt(held)


def test_scraping_1024_ranks_exposes_each_ranks_own_counters_once(client):
    # Correctness at the size of a big job; how long the scrape takes is measured by bench.scrape, not here.
    state = client.app.state.collector_state
    _hold_ranks(state, 1024)
    text = client.get("/metrics").text
    assert 'ampwatch_run_ranks_reporting{run="exp-42"} 1024\n' in text
    # Read by regular expression: parsing 50,000 samples with prometheus_client's parser takes seconds.
    line = re.compile(rf'^({OPTIMIZER_STEPS.name}|{OPTIMIZER_SKIPPED_STEPS.name})'
                      r'\{run="exp-42",rank="(\d+)",optimizer="(\w+)"\} (\S+)$', re.M)
    exposed: dict[tuple[str, int, str], float] = {}
    for family, rank, name, sample in line.findall(text):
        key = (family, int(rank), name)
        assert key not in exposed, f"{key} exposed twice"
        exposed[key] = float(sample)
    expected = {}
    for rank in range(1024):
        expected |= {(OPTIMIZER_STEPS.name, rank, "gen"): rank + 5, (OPTIMIZER_STEPS.name, rank, "disc"): 2 * rank,
                     (OPTIMIZER_SKIPPED_STEPS.name, rank, "gen"): rank % 3,
                     (OPTIMIZER_SKIPPED_STEPS.name, rank, "disc"): 0}
    assert exposed == expected


def _pauses_at_a_millisecond_per_item(monkeypatch) -> list[float]:
    """Record the render's pauses instead of sleeping them; its clock a millisecond further at each reading."""
    from ampwatch.server import _pacing

    pauses: list[float] = []
    monkeypatch.setattr(_pacing.time, "sleep", pauses.append)
    ticks = iter(range(10 ** 9))
    monkeypatch.setattr(_pacing.time, "perf_counter", lambda: next(ticks) / 1000)
    return pauses


def test_a_render_that_pauses_for_the_event_loop_is_the_same_text_as_one_that_does_not(client, monkeypatch):
    from ampwatch.server._metrics import RENDER_PAUSE_S, RENDER_WORK_S, Exposition

    state, own = client.app.state.collector_state, client.app.state.own
    _hold_ranks(state, 1100)
    assert client.app.state.exposition.pause_s == RENDER_PAUSE_S > 0  # the app's render, in a worker thread
    pauses = _pauses_at_a_millisecond_per_item(monkeypatch)
    paced = Exposition(state, own, 60.0, clock=lambda: 1e9, pause_s=RENDER_PAUSE_S).render_ranks(1e9)
    every = round(RENDER_WORK_S * 1000)  # items between two pauses: one clock reading, a millisecond, per item
    assert len(pauses) >= 1100 // every and set(pauses) == {RENDER_PAUSE_S}
    count = len(pauses)
    assert paced == Exposition(state, own, 60.0, clock=lambda: 1e9).render_ranks(1e9)
    assert len(pauses) == count  # the plain render did not pause


def test_a_render_pauses_for_the_event_loop_only_while_it_is_busy(client, monkeypatch):
    from ampwatch.server._metrics import RENDER_PAUSE_S, Exposition

    state, own = client.app.state.collector_state, client.app.state.own
    _hold_ranks(state, 1100)
    pauses = _pauses_at_a_millisecond_per_item(monkeypatch)
    loop_busy = [False]
    exposition = Exposition(state, own, 60.0, clock=lambda: 1e9, pause_s=RENDER_PAUSE_S, busy=lambda: loop_busy[0])
    idle = exposition.render_ranks(1e9)
    assert pauses == []  # the loop had nothing to do: no pause
    loop_busy[0] = True
    assert exposition.render_ranks(1e9) == idle and len(pauses) >= 100


def test_the_apps_render_sees_the_loop_busy_while_an_ingest_request_is_in_flight(client):
    exposition, ingest = client.app.state.exposition, client.app.state.ingest
    assert exposition.busy is not None and not exposition.busy()

    async def a_request_whose_body_is_on_its_way() -> tuple[bool, bool, int]:
        asked, body_sent = asyncio.Event(), asyncio.Event()

        async def receive() -> dict:
            asked.set()
            await body_sent.wait()
            return {"type": "http.request", "body": b"{}", "more_body": False}

        answers: list[dict] = []

        async def send(message: dict) -> None:
            answers.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/ingest", "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]}
        request = asyncio.ensure_future(ingest(scope, receive, send))
        await asyncio.wait_for(asked.wait(), 60)
        during = exposition.busy()
        body_sent.set()
        await asyncio.wait_for(request, 60)
        return during, exposition.busy(), answers[0]["status"]

    during, after, status = client.portal.call(a_request_whose_body_is_on_its_way)
    assert during and not after and status == 422  # "{}" is no batch: answered, and no longer in flight


def _scrape(url: str, accept_encoding: str | None) -> tuple[dict, bytes]:
    headers = {"Accept-Encoding": accept_encoding} if accept_encoding is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=30) as answer:
        return dict(answer.headers.items()), answer.read()


def _rank_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if 'run="exp-42"' in line)


def test_metrics_are_gzipped_when_the_scraper_asks_and_plain_text_otherwise(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus' (.ci/run does)")
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        body = json.dumps(make_batch(rank=0, optimizers={"gen": optimizer(steps=10, skipped=2)})).encode()
        urllib.request.urlopen(urllib.request.Request(collector.url + "/v1/ingest", data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=30)
        # Prometheus's own header; then what a plain client or curl without --compressed sends.
        zipped_headers, zipped = _scrape(collector.url, "gzip")
        plain_headers, plain = _scrape(collector.url, None)
        refused_headers, refused = _scrape(collector.url, "gzip;q=0, identity")
    assert zipped_headers.get("content-encoding") == "gzip"
    assert "content-encoding" not in plain_headers and "content-encoding" not in refused_headers
    text = gzip.decompress(zipped).decode()
    assert _rank_lines(text) == _rank_lines(plain.decode()) == _rank_lines(refused.decode())
    assert value(text, "ampwatch_optimizer_skipped_steps_total", run="exp-42", rank="0", optimizer="gen") == 2
    for exposition in (text, plain.decode()):
        check = subprocess.run([promtool, "check", "metrics"], input=exposition, text=True, capture_output=True,
                               timeout=60)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), \
            check.stdout + check.stderr


def test_a_render_after_some_ranks_changed_equals_a_fresh_render_and_shows_their_new_counters(client):
    """Each rank's lines are kept between scrapes while its view is the same: a changed rank must not show
    its old lines, a rank that left must not linger."""
    import time

    from ampwatch.server._batch_parse import parse_batch
    from ampwatch.server._incarnation import next_incarnation
    from ampwatch.server._metrics import Exposition

    state, own = client.app.state.collector_state, client.app.state.own
    _hold_ranks(state, 200)
    kept = Exposition(state, own, 60.0, clock=lambda: 1e9, keep_lines_from=100)
    first = kept.render_ranks(1e9)
    assert all(lines.lines for lines in kept._lines.values())  # 200 ranks >= 100: every rank's lines kept
    for rank in (3, 150):  # a newer batch of the same process: steps 1,000, a skip of "disc"
        held = state.get("exp-42", rank)
        old = held.view.current
        batch = parse_batch(json.dumps(make_batch(
            rank=rank, world_size=200, incarnation=f"{rank:032x}", seq=2,
            optimizers={"gen": optimizer(steps=1000, skipped=rank % 3), "disc": optimizer(steps=2 * rank, skipped=1)})))
        held.install(next_incarnation(old, batch, time.time(), 128))
    again = kept.render_ranks(1e9)
    assert again != first
    assert again == Exposition(state, own, 60.0, clock=lambda: 1e9).render_ranks(1e9)
    assert f'{OPTIMIZER_STEPS.name}{{run="exp-42",rank="150",optimizer="gen"}} 1000\n' in again
    assert f'{OPTIMIZER_SKIPPED_STEPS.name}{{run="exp-42",rank="3",optimizer="disc"}} 1\n' in again


def test_below_keep_lines_from_a_render_keeps_no_ranks_lines(client):
    from ampwatch.server._metrics import KEEP_LINES_FROM, Exposition

    state, own = client.app.state.collector_state, client.app.state.own
    _hold_ranks(state, 300)
    assert KEEP_LINES_FROM > 300
    exposition = Exposition(state, own, 60.0, clock=lambda: 1e9)
    text = exposition.render_ranks(1e9)
    assert 'rank="299"' in text
    assert not any(lines.lines or lines.view is not None for lines in exposition._lines.values())
