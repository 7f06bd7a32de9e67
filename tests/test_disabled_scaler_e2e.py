"""End to end: a real bf16 job with a disabled GradScaler (``enabled=False``) reports its poisoned steps to a real
collector, with no loss scale and no scale alert, and the status page says every step is checked.

Before, a disabled scaler was sent as "nothing checked": the poisoned step never reached the collector.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from ampwatch import agent
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import samples, scrape, value
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.patience import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RUN = "bf16-disabled-scaler"
POISONED = (2, 5)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read().decode())


def _closed_run(url: str) -> dict | None:
    """The run as the collector shows it, once its rank has closed; None before (404 before its first batch)."""
    try:
        run = _get(f"{url}/v1/runs/{RUN}")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    return run if run["closed"] else None


def _train(url: str) -> list[int]:
    """A bf16 job with nanoGPT's ``GradScaler(enabled=False)``, watched and sent to ``url``; return the truth."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    watch = agent.watch(scaler, {"net": opt}, model=model, collector=url, run=RUN, push_interval=0.2)
    truth = []
    for step in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in POISONED:
            model[2].weight.grad[0, 0] = float("inf")
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            truth.append(step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.no_grad():  # finite weights again: each poisoned step stands alone
            for p in model.parameters():
                p.nan_to_num_(0.0, 0.0, 0.0)
    watch.close()
    return truth


@pytest.fixture
def collector(tmp_path, monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    with CollectorProcess(str(tmp_path / "c.db"), args=["--alert-thresholds", "demo"]) as process:
        yield process


def test_a_disabled_scalers_poisoned_steps_reach_the_collector_with_no_scale_and_no_scale_alert(collector):
    truth = _train(collector.url)
    assert truth == list(POISONED)
    run = wait_until(lambda: _closed_run(collector.url), what="the rank's final batch")
    (rank,) = run["ranks"]
    assert rank["optimizers"]["net"]["poisoned_steps"] == len(truth) and rank["optimizers"]["net"]["skipped"] == 0
    assert rank["loss_scale"] is None and rank["scaler"]["enabled"] is False and rank["scaler"]["kind"] == "GradScaler"
    firing = wait_until(lambda: _get(collector.url + "/v1/alerts")["firing"], what="an alert to fire")
    assert {a["name"] for a in firing} == {"AmpPoisonedStep"}  # no scale alert: there is no scale
    text = scrape(collector.url)
    assert value(text, "ampwatch_optimizer_poisoned_steps_total", run=RUN, rank="0", optimizer="net") == len(truth)
    assert value(text, "ampwatch_loss_scale", run=RUN, rank="0") is None  # no loss scale series for this rank
    assert value(text, "ampwatch_loss_scale_backoffs_total", run=RUN, rank="0") == 0
    info = [labels for name, labels in samples(text) if name == "ampwatch_rank_info" and ("run", RUN) in labels]
    assert [(dict(i)["scaler_enabled"], dict(i)["scaler_kind"]) for i in info] == [("false", "GradScaler")]


@needs_browser
def test_the_status_page_says_a_disabled_scalers_steps_are_checked(collector):
    _train(collector.url)
    wait_until(lambda: _closed_run(collector.url), what="the rank's final batch")
    with open_page(f"{collector.url}/#run={RUN}") as (page, problems):
        page.wait_for_selector("#events tr.event[data-kind=scaler_disabled]", timeout=15_000)
        cells = page.locator("#ranks tr.rank[data-rank='0'] td")
        assert cells.nth(2).text_content() == "disabled (every step checked)"
        assert cells.nth(3).text_content() == "-"  # no loss scale
        event = page.locator("#events tr.event[data-kind=scaler_disabled]")
        assert "nothing skips; every step is checked" in event.text_content()
    assert problems == []
