"""What a real collector refuses never silently stops delivery: the real agent against a real collector process.

- A name longer than the protocol allows is cut by the agent (with a visible mark), so the event arrives.
- A job past a collector limit that resending cannot fix (too many optimizers) is refused for good: the agent
  logs the collector's own reason once, drops and counts the batches, and does not retry them forever.
"""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
import torch

from ampwatch import agent
from ampwatch.agent._limits import CUT_MARK, TEXT_LIMITS
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BATCHES = 5


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def _train(scaler: torch.amp.GradScaler, model: torch.nn.Module, optimizers: list, iterations: int,
           poison: torch.Tensor | None = None) -> None:
    for _ in range(iterations):
        for opt in optimizers:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 2)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison is not None:
            poison.grad.view(-1)[0] = float("inf")
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()


def test_a_2000_character_parameter_name_in_a_skip_reaches_a_real_collector_cut_with_a_mark(tmp_path):
    long_name = "encoder." + "very_deep_block." * 124 + "0.weight"  # 2,000 characters
    assert len(long_name) == 2000
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        scaler = torch.amp.GradScaler("cpu")
        watch = agent.watch(scaler, {"opt": opt}, named_parameters=[(long_name, model.weight), ("bias", model.bias)],
                            collector=collector.url, run="long-names", push_interval=0.05)
        _train(scaler, model, [opt], 3, poison=model.weight)
        watch.close(timeout=10)
        events = json.loads(_get(collector.url + "/v1/runs/long-names/events?kind=skip"))["events"]
        rank = json.loads(_get(collector.url + "/v1/runs/long-names"))["ranks"][0]
        text = _get(collector.url + "/metrics")
    assert [e["streak"] for e in events] == [1, 2], "a skip event was lost"  # a streak of 3: its rungs 1 and 2
    named = events[0]["params"][0]["name"]
    assert len(named) == TEXT_LIMITS["param_name"] and named.endswith(CUT_MARK)
    assert named == long_name[:TEXT_LIMITS["param_name"] - 1] + CUT_MARK
    # Where it began names the same parameter, cut the same way (a batch with it whole was refused: events lost).
    assert events[0]["began"]["param"] == named
    assert rank["optimizers"]["opt"]["skipped"] == 3 and rank["closed"] is True
    assert rank["delivery"]["rejected_batches"] == 0
    # The exposition's label is cut further, to the collector's label limit.
    assert rank["optimizers"]["opt"]["latest_nonfinite_parameter"] == named[:128]
    assert value(text, "ampwatch_optimizer_skipped_steps_total", run="long-names", rank="0", optimizer="opt") == 3


def test_a_job_of_100_optimizers_is_refused_for_good_logged_once_with_the_collectors_reason_and_counted(
        tmp_path, caplog):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(99)], torch.nn.Linear(2, 1))
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.01) for layer in model]
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        scaler = torch.amp.GradScaler("cpu")
        with caplog.at_level(logging.INFO, logger="ampwatch.agent"):
            watch = agent.watch(scaler, {f"opt{i}": o for i, o in enumerate(optimizers)}, collector=collector.url,
                                run="too-many", push_interval=0.05)
            _train(scaler, model, optimizers, 5)
            sender = watch._sender
            # A batch goes out every push interval: wait until several were refused (each once, never retried).
            wait_until(lambda: sender.rejected_batches >= BATCHES, every=0.02, what=f"{BATCHES} refused batches")
            watch.close(timeout=5)
        text = _get(collector.url + "/metrics")
        runs = json.loads(_get(collector.url + "/v1/runs"))["runs"]
    reasons = [r.getMessage() for r in caplog.records if "would have 100 optimizers" in r.getMessage()]
    assert len(reasons) == 1, reasons
    assert "--max-optimizers-per-rank 16" in reasons[0] and "rejected_batches" in reasons[0]
    assert "AMPWATCH_URL" not in caplog.text  # the collector answered: no guessing about the address
    # watch() said beforehand that a default collector would refuse the job.
    assert any("over its default limit of 16" in r.getMessage() for r in caplog.records)
    assert sender.rejected_batches >= BATCHES and sender.send_failures == 0
    # Every batch reached the collector exactly once: as many 422 answers as batches the agent dropped.
    assert value(text, "ampwatch_collector_ingest_requests_total", code="422") == sender.rejected_batches
    assert value(text, "ampwatch_collector_ingest_requests_total", code="429") is None
    assert runs == []  # nothing of the refused rank was stored
