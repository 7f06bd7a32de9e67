"""The agent never sends what the protocol refuses, and says at watch() time when a collector would refuse the job."""

from __future__ import annotations

import logging

import pytest
import torch

from ampwatch.agent._batch import build_batch, encode_batch
from ampwatch.agent._identity import resolve_identity
from ampwatch.agent._limits import CUT_MARK, MAX_PARAMS, TEXT_LIMITS, cut
from ampwatch_support.recording_collector import RecordingCollector


def _optimizers(count: int) -> tuple[torch.nn.Module, dict[str, torch.optim.Optimizer]]:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(count)])
    return model, {f"opt{i}": torch.optim.SGD(layer.parameters(), lr=0.1) for i, layer in enumerate(model)}


def _limit_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "--max-optimizers-per-rank" in r.getMessage()]


def test_a_watch_of_more_optimizers_than_a_default_collector_holds_warns_once_naming_the_option(watching, caplog):
    with RecordingCollector() as collector:
        _, seventeen = _optimizers(17)
        with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
            watching(torch.amp.GradScaler("cpu"), seventeen, collector=collector.url).close(timeout=2)
        (message,) = _limit_warnings(caplog)
        assert "17 optimizers on this rank, over its default limit of 16" in message
        assert "AMPWATCH_SERVER_MAX_OPTIMIZERS_PER_RANK" in message

        caplog.clear()
        _, sixteen = _optimizers(16)
        with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
            watching(torch.amp.GradScaler("cpu"), sixteen, collector=collector.url).close(timeout=2)
        assert _limit_warnings(caplog) == []


def test_without_a_collector_nothing_is_said_about_collector_limits(watching, caplog):
    _, many = _optimizers(20)
    with caplog.at_level(logging.WARNING, logger="ampwatch.agent"):
        watching(torch.amp.GradScaler("cpu"), many).close(timeout=1)
    assert _limit_warnings(caplog) == []


def test_every_string_the_batch_carries_is_cut_to_its_protocol_limit_with_a_visible_mark():
    identity = resolve_identity("limits", environ={})
    long = "n" * 2000
    events = [
        {"id": 1, "kind": "skip", "time": 1.0, "iteration": 0, "optimizer": "opt", "streak": 1, "inspected": True,
         "params": [{"name": f"{i}-{long}", "inf": 1, "nan": 0} for i in range(20)], "params_total": None,
         "origin": True, "origin_buckets": [0], "origin_params": ["short", f"o-{long}"], "origin_params_total": 2},
        {"id": 2, "kind": "poisoned_step", "time": 1.0, "iteration": 0, "optimizer": "opt", "reason": "nonfinite_grad",
         "params": [{"name": long, "inf": 0, "nan": 3}], "params_total": 1},
        {"id": 3, "kind": "scheduler_after_skip", "time": 1.0, "iteration": 0, "optimizer": "opt", "scheduler": long},
        {"id": 4, "kind": "warning", "time": 1.0, "iteration": 0, "code": long, "message": long * 3},
        {"id": 5, "kind": "skip", "time": 1.0, "iteration": 1, "optimizer": "opt", "streak": 2, "inspected": True,
         "params": [{"name": "short", "inf": 1, "nan": 0}], "params_total": 1},
        {"id": 6, "kind": "skip", "time": 1.0, "iteration": 2, "optimizer": "opt", "streak": 1, "inspected": True,
         "params": [{"name": "short", "inf": 1, "nan": 0}], "params_total": 1,
         "origin": True, "origin_buckets": [0], "origin_params": [long], "origin_params_total": 1},
    ]
    snapshot = {"scaler": {"enabled": True, "kind": long}, "state": {"loss_scale": float("nan")}}
    batch = build_batch(identity, seq=1, snapshot=snapshot, delivery={}, events=events)
    skip, poisoned, scheduler, warning, short, origin_only = batch["events"]
    assert len(skip["params"]) == MAX_PARAMS and skip["params_total"] == 20
    assert [p["name"] for p in skip["params"]] == [cut(f"{i}-{long}", TEXT_LIMITS["param_name"]) for i in range(16)]
    assert skip["origin_params"] == ["short", cut(f"o-{long}", TEXT_LIMITS["param_name"])]
    assert origin_only["origin_params"] == [cut(long, TEXT_LIMITS["param_name"])]
    assert len(poisoned["params"][0]["name"]) == TEXT_LIMITS["param_name"] and poisoned["params"][0]["nan"] == 3
    assert len(scheduler["scheduler"]) == TEXT_LIMITS["scheduler"]
    assert len(warning["code"]) == TEXT_LIMITS["warning_code"]
    assert len(warning["message"]) == TEXT_LIMITS["warning_message"]
    assert len(batch["scaler"]["kind"]) == TEXT_LIMITS["scaler_kind"]
    for text in (skip["params"][0]["name"], skip["origin_params"][1], scheduler["scheduler"], warning["code"],
                 warning["message"]):
        assert text.endswith(CUT_MARK) and text.startswith(("0-nnn", "o-nnn", "nnn"))
    assert short is events[4]  # what fits is passed on as it is, not copied
    assert events[0]["params"][0]["name"] == f"0-{long}"  # the recorder's own events are left alone
    assert b'"loss_scale":"NaN"' in encode_batch(batch)
