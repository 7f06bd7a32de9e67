"""A real AMP job's news reaches the collector at once, whatever the heartbeat (real GradScaler, real HTTP)."""

from __future__ import annotations

import time

import pytest
import torch

from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.timeout(120)

HOUR = 3600.0  # a heartbeat no test waits for: whatever arrives came as news


def _job(amp):
    torch.manual_seed(0)
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)


def _events(server: RecordingCollector) -> list[dict]:
    return [e for b in server.acked for e in b["events"]]


def test_a_streaks_first_skip_its_backoff_and_its_end_arrive_without_waiting_for_the_heartbeat(amp, watching):
    with RecordingCollector() as server:
        model, opt, scaler = _job(amp)
        watching(scaler, {"main": opt}, model=model, collector=server.url, push_interval=HOUR)
        x = torch.randn(4, 8)
        amp.iteration(model, scaler, [opt], x)
        assert server.wait_for(lambda s: len(s.acked) == 1, timeout=30)  # the rank shows up at once
        amp.iteration(model, scaler, [opt], x, after_backward=lambda: amp.poison_grad(model.a.weight))
        assert server.wait_for(lambda s: any(e["kind"] == "skip" for e in _events(s)), timeout=30), \
            "the first skip of a streak waited for the heartbeat"
        amp.iteration(model, scaler, [opt], x)  # the streak ends: news too, and the backoff is there by then
        assert server.wait_for(lambda s: any(e["kind"] == "streak_end" for e in _events(s)), timeout=30)
        kinds = [(e["kind"], e.get("cause")) for e in _events(server)]
        assert kinds == [("skip", None), ("scale_change", "backoff"), ("streak_end", None)]
        last = server.acked[-1]["state"]
        assert last["optimizers"]["main"]["skipped"] == 1 and last["loss_scale"] == 2.0 ** 9
        assert last["backoffs"] == 1


def test_clean_iterations_send_nothing_between_heartbeats(amp, watching):
    with RecordingCollector() as server:
        model, opt, scaler = _job(amp)
        watching(scaler, {"main": opt}, model=model, collector=server.url, push_interval=HOUR)
        x = torch.randn(4, 8)
        assert server.wait_for(lambda s: len(s.acked) == 1, timeout=30)
        for _ in range(20):
            amp.iteration(model, scaler, [opt], x)
        time.sleep(1.5)  # more than the news gap: had anything counted as news, it would have gone
        assert len(server.received) == 1


def test_closing_sends_the_final_state_at_once(amp, watching):
    with RecordingCollector() as server:
        model, opt, scaler = _job(amp)
        w = watching(scaler, {"main": opt}, model=model, collector=server.url, push_interval=HOUR)
        for _ in range(3):
            amp.iteration(model, scaler, [opt], torch.randn(4, 8))
        w.close(timeout=30)
        assert server.acked[-1]["closed"] is True
        assert server.acked[-1]["state"]["optimizers"]["main"]["steps"] == 3

