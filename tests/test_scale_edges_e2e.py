"""End to end: a real agent whose float32 scale underflows to 0.0, or is set to NaN, stays visible at a real collector.

Before, the agent sent such scales as null or 0.0 and the collector refused every batch from then on
(422, "loss_scale: Input should be greater than 0"): the rank went dark exactly when it was broken.
"""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
import torch

from ampwatch import agent
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def _train(scaler, model, opt, iterations: int, poison: bool, new_scale: float | None = None) -> None:
    for _ in range(iterations):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            model.weight.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update(new_scale) if new_scale is not None else scaler.update()


@pytest.mark.parametrize("case", ["underflow", "nan"])
def test_every_scale_the_scaler_can_hold_reaches_the_collector_and_alerts(tmp_path, monkeypatch, case):
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    with CollectorProcess(str(tmp_path / "c.db"), args=["--alert-thresholds", "demo"]) as collector:
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        watch = agent.watch(scaler, {"main": opt}, collector=collector.url, run=case, push_interval=0.2)
        if case == "underflow":
            _train(scaler, model, opt, 200, poison=True)  # about 166 backoffs from 2**16 reach 0.0
            assert scaler.get_scale() == 0.0
        else:
            _train(scaler, model, opt, 3, poison=False, new_scale=float("nan"))
            assert math.isnan(scaler.get_scale())
        # The demo thresholds' windows are seconds long.
        wait_until(lambda: any(a["name"] == "AmpLossScaleCollapsed"
                               for a in json.loads(_get(collector.url + "/v1/alerts"))["firing"]),
                   what=lambda: f"AmpLossScaleCollapsed to fire: {_get(collector.url + '/v1/alerts')}", every=0.5)
        watch.close()
        (rank,) = json.loads(_get(f"{collector.url}/v1/runs/{case}"))["ranks"]
        assert rank["closed"] and rank["delivery"]["rejected_batches"] == 0, rank

        text = _get(collector.url + "/metrics")
        labels = {"run": case, "rank": "0"}
        scale = value(text, "ampwatch_loss_scale", **labels)
        assert (scale == 0.0) if case == "underflow" else math.isnan(scale)
        assert value(text, "ampwatch_iteration", **labels) == (200 if case == "underflow" else 3)
