"""Loss and gradient-norm spikes (issue 40) in real training loops: a real ``GradScaler("cpu")`` under bfloat16
autocast, or none; a spike is planted (one batch's inputs x100, one iteration's gradients x1,000 by a tensor hook)
and must be reported at exactly that iteration, and a healthy run reports none.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampwatch.contract.batch import GradNormSpikeEvent, LossSpikeEvent, fields, required

WINDOW = 8


@pytest.fixture(autouse=True)
def _small_window(monkeypatch):
    monkeypatch.setenv("AMPWATCH_SPIKE_WINDOW", str(WINDOW))
    for var in ("AMPWATCH_SPIKE_SIGMA", "AMPWATCH_GRAD_NORM"):
        monkeypatch.delenv(var, raising=False)


def _spikes(w, kind: str | None = None) -> list[dict]:
    return [e for e in w._recorder.events.drain() if e["kind"] in ((kind,) if kind else ("loss_spike",
                                                                                        "grad_norm_spike"))]


def _train(amp, w, model, opt, scaler, *, iterations: int, loud: frozenset[int] = frozenset(),
           steep: frozenset[int] = frozenset(), micro: int = 1, hand_over: bool | str = False,
           inf_at: frozenset[int] = frozenset()) -> list[float]:
    """Train; ``loud``: iterations whose inputs are x100; ``steep``: iterations whose gradients are x1,000 (a tensor
    hook on the first layer's weight); ``inf_at``: iterations with an inf input (a skip). Returns each iteration's
    loss (the sum of its micro-batches'), as the job computed it."""
    losses = []
    for i in range(iterations):
        if w is not None:
            w.batch([100 * i + k for k in range(micro)])
        opt.zero_grad()
        handle = model.a.weight.register_hook(lambda g: g * 1000) if i in steep else None
        total = 0.0
        for _ in range(micro):
            x = torch.randn(4, 8) * (100 if i in loud else 1)
            if i in inf_at:
                x[0, 0] = float("inf")
            loss = amp.forward(model, x)
            total += loss.item()
            if scaler is None and w is not None:
                w.loss(loss)  # without a scaler the job hands its loss over
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if handle is not None:
            handle.remove()
        losses.append(total)
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        if hand_over and hand_over != "after" and w is not None:
            w.grad_norm(norm)
        if scaler is not None:
            scaler.step(opt)
            if hand_over == "after" and w is not None:
                w.grad_norm(norm, opt)  # after the step, before update(): still this iteration's
            scaler.update()
        else:
            opt.step()
    return losses


def _job(amp, lr: float = 1e-4):
    model = amp.TwoPart()
    return model, torch.optim.SGD(model.parameters(), lr=lr)


@pytest.mark.parametrize("scaled", [True, False], ids=["grad_scaler", "no_scaler"])
def test_a_batch_with_inputs_x100_gives_exactly_one_loss_spike_at_its_iteration_with_its_samples(amp, watching,
                                                                                                  scaled):
    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    w = watching(scaler, opt, model=model)
    losses = _train(amp, w, model, opt, scaler, iterations=20, loud=frozenset({14}))
    (spike,) = _spikes(w)
    window = losses[14 - WINDOW:14]
    mean = sum(window) / WINDOW
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / WINDOW)
    assert (spike["kind"], spike["iteration"], spike["streak"]) == ("loss_spike", 14, 1)
    assert spike["value"] == pytest.approx(losses[14], rel=1e-6)
    assert (spike["mean"], spike["std"]) == (pytest.approx(mean, rel=1e-6), pytest.approx(std, rel=1e-6))
    assert spike["z"] == pytest.approx((losses[14] - mean) / std, rel=1e-5) and spike["z"] >= 6.0
    assert spike["samples"]["ids"] == [1400]
    assert required(LossSpikeEvent) <= set(spike) <= set(fields(LossSpikeEvent))
    state = w.snapshot()["state"]
    assert state["loss_spikes"] == 1 and set(state["loss"]) == {"mean", "std"}
    assert "spikes: loss 1" in w.summary()


def test_a_healthy_run_reports_no_spike_and_sends_the_loss_level_but_no_spike_counter(amp, watching):
    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model, grad_norm=True)
    losses = _train(amp, w, model, opt, scaler, iterations=3 * WINDOW)
    assert _spikes(w) == []
    state = w.snapshot()["state"]
    last = losses[-WINDOW:]
    assert state["loss"]["mean"] == pytest.approx(sum(last) / WINDOW, rel=1e-3)
    assert "loss_spikes" not in state
    counters = state["optimizers"]["SGD"]
    assert "grad_norm_spikes" not in counters and set(counters["grad_norm"]) == {"mean", "std"}


@pytest.mark.parametrize("scaled", [True, False], ids=["grad_scaler", "no_scaler"])
def test_gradients_x1000_at_one_iteration_give_a_grad_norm_spike_there_computed_or_handed_over(amp, watching,
                                                                                               scaled):
    for how in ("computed", "before the step", "after the step"):
        torch.manual_seed(0)
        model, opt = _job(amp)
        scaler = torch.amp.GradScaler("cpu") if scaled else None
        w = watching(scaler, opt, model=model, grad_norm=how == "computed")
        hand_over = {"computed": False, "before the step": "before", "after the step": "after"}[how]
        if not scaled and hand_over == "after":
            continue  # without a scaler a norm after the step is the next iteration's: clip_grad_norm_ comes first
        _train(amp, w, model, opt, scaler, iterations=16, steep=frozenset({12}), hand_over=hand_over)
        spikes = _spikes(w, "grad_norm_spike")
        seen = [(s["iteration"], s["optimizer"], s["local"], s["streak"]) for s in spikes]
        assert seen == [(12, "SGD", False, 1)], how
        assert spikes[0]["z"] >= 6.0 and spikes[0]["samples"]["ids"] == [1200]
        assert required(GradNormSpikeEvent) <= set(spikes[0]) <= set(fields(GradNormSpikeEvent))
        assert w.snapshot()["state"]["optimizers"]["SGD"]["grad_norm_spikes"] == 1
        w.close()


def test_the_norm_of_a_step_the_scaler_skipped_is_never_judged_but_the_non_finite_loss_is(amp, watching):
    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model, grad_norm=True)
    _train(amp, w, model, opt, scaler, iterations=12, inf_at=frozenset({10}), hand_over=True)
    events = w._recorder.events.drain()
    assert [e["kind"] for e in events if e["kind"] in ("skip", "loss_spike", "grad_norm_spike")] == \
        ["skip", "loss_spike"]
    (loss_spike,) = [e for e in events if e["kind"] == "loss_spike"]
    assert (loss_spike["iteration"], loss_spike["z"], math.isnan(loss_spike["value"])) == (10, None, True)
    assert "grad_norm_spikes" not in w.snapshot()["state"]["optimizers"]["SGD"]


def test_with_accumulation_the_loss_is_the_sum_of_the_micro_batches_losses(amp, watching):
    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    losses = _train(amp, w, model, opt, scaler, iterations=WINDOW, micro=3)
    level = w.snapshot()["state"]["loss"]
    assert level["mean"] == pytest.approx(sum(losses) / WINDOW, rel=1e-3)


def test_a_run_of_non_finite_losses_is_sent_at_its_rungs_and_every_one_counted(amp, watching):
    model, opt = _job(amp)
    w = watching(None, opt, model=model)
    for i in range(12):
        opt.zero_grad()
        loss = amp.forward(model, torch.randn(4, 8))
        w.loss(loss * float("nan") if i >= 2 else loss)
        opt.step()  # no backward: nothing reaches the weights
    assert [(s["iteration"], s["streak"]) for s in _spikes(w)] == [(2, 1), (3, 2), (5, 4), (9, 8)]
    assert w.snapshot()["state"]["loss_spikes"] == 10


def test_an_iteration_without_a_loss_ends_a_run_of_spikes(amp, watching):
    model, opt = _job(amp)
    w = watching(None, opt, model=model)
    for i in range(8):
        opt.zero_grad()
        loss = amp.forward(model, torch.randn(4, 8))
        if i != 4:  # iteration 4 hands over no loss
            w.loss(loss * float("nan") if i >= 2 else loss)
        opt.step()
    assert [(s["iteration"], s["streak"]) for s in _spikes(w)] == [(2, 1), (3, 2), (5, 1), (6, 2)]


def test_grad_norm_refuses_a_bad_norm_or_an_unknown_optimizer_by_name(amp, watching):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    w = watching(torch.amp.GradScaler("cpu"), {"a": opt_a, "b": opt_b}, model=model)
    with pytest.raises(ValueError, match="needs optimizer= when the watch has several optimizers; watched: a, b"):
        w.grad_norm(1.0)
    with pytest.raises(ValueError, match="optimizer='c'"):
        w.grad_norm(1.0, "c")
    with pytest.raises(ValueError, match="does not know"):
        w.grad_norm(1.0, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="shape \\(2,\\)"):
        w.grad_norm(torch.ones(2), opt_a)
    with pytest.raises(TypeError, match="got a str"):
        w.grad_norm("1.0", opt_a)
    w.grad_norm(torch.tensor(1.0), "b")
    w.grad_norm(2, opt_a)


@pytest.mark.parametrize(("var", "value", "message"), [
    ("AMPWATCH_SPIKE_WINDOW", "1", "AMPWATCH_SPIKE_WINDOW must be a whole number of iterations >= 2"),
    ("AMPWATCH_SPIKE_WINDOW", "ten", "AMPWATCH_SPIKE_WINDOW must be an integer"),
    ("AMPWATCH_SPIKE_SIGMA", "0", "AMPWATCH_SPIKE_SIGMA must be a number of standard deviations > 0"),
    ("AMPWATCH_SPIKE_SIGMA", "inf", "AMPWATCH_SPIKE_SIGMA must be a number of standard deviations > 0"),
    ("AMPWATCH_GRAD_NORM", "maybe", "AMPWATCH_GRAD_NORM must be one of"),
])
def test_a_bad_spike_setting_is_refused_naming_the_variable(amp, watching, monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    model, opt = _job(amp)
    with pytest.raises(ValueError, match=message):
        watching(torch.amp.GradScaler("cpu"), opt, model=model)


def test_the_spike_settings_default_to_the_contracts_thresholds(monkeypatch):
    from ampwatch.agent._config import AgentConfig
    from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
    config = AgentConfig.from_env(environ={})
    assert (config.spike_window, config.spike_sigma, config.grad_norm) == (
        DEFAULT_THRESHOLDS.spike_window_iterations, DEFAULT_THRESHOLDS.spike_sigma, False)
    assert AgentConfig.from_env(environ={"AMPWATCH_SPIKE_WINDOW": "32", "AMPWATCH_SPIKE_SIGMA": "4.5",
                                         "AMPWATCH_GRAD_NORM": "1"}).spike_window == 32


def test_a_fused_optimizers_computed_norm_is_of_its_unscaled_gradients(amp, watching):
    """A fused (AMP-aware) optimizer's pre-hook sees its gradients still scaled: the norm is divided by the scale."""
    model = amp.TwoPart()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = watching(scaler, opt, model=model, grad_norm=True)
    truth = []
    for _ in range(WINDOW):
        opt.zero_grad()
        scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
        scaled = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        truth.append(scaled.item() / scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    level = w.snapshot()["state"]["optimizers"]["AdamW"]["grad_norm"]
    assert level["mean"] == pytest.approx(sum(truth) / WINDOW, rel=1e-3)


def test_a_failing_spike_watch_never_reaches_the_loop_and_the_steps_are_still_counted(amp, watching, monkeypatch):
    from ampwatch.agent import _spike_watch

    def broken(*args, **kwargs):
        raise RuntimeError("injected agent fault")

    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model, grad_norm=True)
    monkeypatch.setattr(_spike_watch, "grad_norm_of", broken)  # the pre-hook's norm
    monkeypatch.setattr(_spike_watch.SpikeSeries, "observe", broken)  # every judgment, and the loss's
    _train(amp, w, model, opt, scaler, iterations=4, hand_over=True)
    state = w.snapshot()["state"]
    assert state["optimizers"]["SGD"]["steps"] == 4 and state["iteration"] == 4
    assert state["delivery"]["agent_errors"] >= 8  # the norm computed, handed over and the loss, each iteration


def test_the_levels_go_in_one_batch_every_four_heartbeats_and_in_the_last(amp, watching):
    from ampwatch.contract.protocol import LEVEL_HEARTBEATS
    from ampwatch_support.recording_collector import RecordingCollector

    heartbeat = 0.1
    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    with RecordingCollector() as server:
        w = watching(scaler, opt, model=model, collector=server.url, push_interval=heartbeat, grad_norm=True)
        # Train until the collector holds a dozen batches, however slow the machine (no time is assumed).
        while len(server.acked) < 12:
            _train(amp, w, model, opt, scaler, iterations=WINDOW)
        w.close()
        batches = list(server.acked)
    with_levels = [b for b in batches if "loss" in b["state"]]
    assert with_levels and len(with_levels) < len(batches)
    for b in batches:  # the gradient norm's level goes with the loss's, in the same batches
        (counters,) = b["state"]["optimizers"].values()
        assert ("grad_norm" in counters) == (b in with_levels)
    # Between two batches that carry them, at least LEVEL_HEARTBEATS - 0.5 heartbeats passed (a news batch or a
    # heartbeat in between carries none); the last batch carries them.
    times = [b["sent_at"] for b in with_levels if not b["closed"]]  # the last batch carries them whenever it goes
    assert all(later - earlier >= (LEVEL_HEARTBEATS - 0.5) * heartbeat - 0.02
               for earlier, later in zip(times, times[1:], strict=False))
    assert batches[-1]["closed"] and batches[-1] in with_levels


def test_a_watch_closed_between_two_level_batches_still_sends_its_levels_last(amp, watching):
    from ampwatch_support.recording_collector import RecordingCollector

    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    with RecordingCollector() as server:
        # A heartbeat far longer than the test: the first batch is the only one due to carry levels (it has none
        # yet), so only the closing rule can put them in the last one.
        w = watching(scaler, opt, model=model, collector=server.url, push_interval=60, grad_norm=True)
        _train(amp, w, model, opt, scaler, iterations=2 * WINDOW)
        w.close()
        batches = list(server.acked)
    assert batches[-1]["closed"] and set(batches[-1]["state"]["loss"]) == {"mean", "std"}
    (counters,) = batches[-1]["state"]["optimizers"].values()
    assert set(counters["grad_norm"]) == {"mean", "std"}


def test_the_first_level_goes_in_the_next_batch_after_the_window_has_one(amp, watching):
    from ampwatch_support.recording_collector import RecordingCollector

    model, opt = _job(amp)
    scaler = torch.amp.GradScaler("cpu")
    with RecordingCollector() as server:
        # No heartbeat within the test: the first batch (at start) holds no level yet; the next one is news.
        w = watching(scaler, opt, model=model, collector=server.url, push_interval=60, grad_norm=True)
        assert server.wait_for(lambda s: len(s.acked) >= 1)
        _train(amp, w, model, opt, scaler, iterations=WINDOW + 1, inf_at=frozenset({WINDOW}))  # a skip: news
        assert server.wait_for(lambda s: any(e["kind"] == "skip" for b in s.acked for e in b["events"]))
        news = next(b for b in server.acked if any(e["kind"] == "skip" for e in b["events"]))
        w.close()
    assert "loss" not in server.acked[0]["state"] and not news["closed"]
    assert set(news["state"]["loss"]) == {"mean", "std"}, "the first level waited for a fourth heartbeat"
