"""Poisoned steps (issue 8): an optimizer that stepped with non-finite gradients, or was left non-finite."""

from __future__ import annotations

import torch
from torch import nn


def setup(amp, watching):
    model = amp.TwoPart()
    opt_a = torch.optim.AdamW(model.a.parameters())
    opt_b = torch.optim.SGD(model.b.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    return model, opt_a, opt_b, scaler, w


def nan_in_b_then_clip_whole_model(model: nn.Module, scaler, opt_a, opt_b) -> None:
    """The unsafe recipe: unscale both optimizers, then clip the whole model at once."""
    model.b.bias.grad[0] = float("nan")
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def all_finite(module: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


def test_whole_model_clipping_that_spreads_nan_is_caught_on_the_iteration_it_happens(amp, watching, events):
    """The issue's reproduction: b's NaN reaches a's gradients after a's inf check; a steps with NaN."""
    model, opt_a, opt_b, scaler, w = setup(amp, watching)
    amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                  after_backward=lambda: nan_in_b_then_clip_whole_model(model, scaler, opt_a, opt_b))
    assert not all_finite(model.a) and all_finite(model.b)  # ground truth: a was poisoned, b skipped
    assert w.stepped(opt_a) is True and w.stepped(opt_b) is False
    (poisoned,) = [e for e in events(w) if e["kind"] == "poisoned_step"]
    assert (poisoned["optimizer"], poisoned["iteration"], poisoned["reason"]) == ("a", 0, "nonfinite_grad")
    assert poisoned["params"] == [{"name": "a.weight", "inf": 0, "nan": 64}, {"name": "a.bias", "inf": 0, "nan": 8}]
    assert poisoned["params_total"] == 2
    counters = w.snapshot()["state"]["optimizers"]
    assert counters["a"]["poisoned_steps"] == 1 and counters["b"]["poisoned_steps"] == 0


def test_a_poisoned_optimizer_is_reported_once_though_it_skips_ever_after(amp, watching, events):
    model, opt_a, opt_b, scaler, w = setup(amp, watching)
    amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                  after_backward=lambda: nan_in_b_then_clip_whole_model(model, scaler, opt_a, opt_b))
    for _ in range(3):
        truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8))
        assert truth == {id(opt_a): False, id(opt_b): False}  # NaN weights: every step skips now
    assert len([e for e in events(w) if e["kind"] == "poisoned_step"]) == 1
    assert w.snapshot()["state"]["optimizers"]["a"]["poisoned_steps"] == 1


def test_per_optimizer_clipping_produces_no_poisoned_step(amp, watching, events):
    """The safe pattern: clip each optimizer's own parameters after its unscale_."""
    model, opt_a, opt_b, scaler, w = setup(amp, watching)

    def nan_then_clip_each():
        model.b.bias.grad[0] = float("nan")
        for opt, part in ((opt_a, model.a), (opt_b, model.b)):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(part.parameters(), 1.0)

    for i in range(3):
        amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                      after_backward=nan_then_clip_each if i == 0 else None)
    assert all_finite(model)
    recorded = events(w)
    assert [e["optimizer"] for e in recorded if e["kind"] == "skip"] == ["b"]
    assert not [e for e in recorded if e["kind"] == "poisoned_step"]
    assert w.snapshot()["state"]["optimizers"]["a"]["poisoned_steps"] == 0


def test_a_step_that_leaves_weights_non_finite_is_caught_when_its_skips_begin(amp, watching, events):
    """The other cheap signal: the first skip of a streak finds the weights already non-finite."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=1e38)  # finite gradients, overflowing update
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"net": opt}, model=model)
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8) * 1e3)
    assert truth[id(opt)] is True and not all_finite(model)
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    assert truth[id(opt)] is False
    (poisoned,) = [e for e in events(w) if e["kind"] == "poisoned_step"]
    assert (poisoned["optimizer"], poisoned["iteration"], poisoned["reason"]) == ("net", 0, "nonfinite_param")
    assert poisoned["params_total"] >= 1 and poisoned["params"][0]["inf"] + poisoned["params"][0]["nan"] > 0


def test_clean_iterations_report_no_poisoned_step(amp, no_collector):
    """No false alarm; that the check adds no sync to clean iterations is proven in test_recording_cost."""
    from ampwatch import agent

    model = amp.TwoPart()
    opt_a = torch.optim.AdamW(model.a.parameters())
    opt_b = torch.optim.SGD(model.b.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with agent.watch(scaler, {"a": opt_a, "b": opt_b}, model=model, run="t") as w:
        for _ in range(5):
            amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8))
        kinds = {e["kind"] for e in w._recorder.events.drain()}
    assert "poisoned_step" not in kinds and "skip" not in kinds


def test_a_step_poisoned_right_after_a_rate_limited_skip_is_counted(amp, watching, events):
    """The FAQ's scenario (issue 11, item 4): a start-up skip at iteration 0, b poisoned at iteration 2.

    a's skip at iteration 2 comes within the naming interval of its skip at iteration 0, so its
    parameters are not named; the check of the optimizers that stepped must run all the same.
    """
    model, opt_a, opt_b, scaler, w = setup(amp, watching)
    w._recorder.inspect_interval = 3600.0  # "no pause": the same however slow this machine is

    def nan_in_a_then_clip_whole_model():
        model.a.bias.grad[0] = float("nan")
        scaler.unscale_(opt_a)
        scaler.unscale_(opt_b)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def start_up_overflow():
        amp.poison_grad(model.a.weight)
        amp.poison_grad(model.b.weight)

    truths = []
    for i in range(4):
        hook = {0: start_up_overflow, 2: nan_in_a_then_clip_whole_model}.get(i)
        truths.append(amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8), after_backward=hook))
        if i == 2:  # ground truth: b stepped with the NaN gradients clipping spread; a skipped
            assert truths[2] == {id(opt_a): False, id(opt_b): True}
            assert all_finite(model.a) and not all_finite(model.b)
    assert truths[0] == {id(opt_a): False, id(opt_b): False} and truths[1] == {id(opt_a): True, id(opt_b): True}
    recorded = events(w)
    (late_skip,) = [e for e in recorded if e["kind"] == "skip" and e["iteration"] == 2]
    assert (late_skip["optimizer"], late_skip["inspected"], late_skip["params"]) == ("a", False, [])
    (poisoned,) = [e for e in recorded if e["kind"] == "poisoned_step"]
    assert (poisoned["optimizer"], poisoned["iteration"], poisoned["reason"]) == ("b", 2, "nonfinite_grad")
    assert poisoned["params_total"] == 2 and {p["name"] for p in poisoned["params"]} == {"b.weight", "b.bias"}
    counters = w.snapshot()["state"]["optimizers"]
    assert counters["b"]["poisoned_steps"] == 1 and counters["a"]["poisoned_steps"] == 0


def test_weights_left_non_finite_are_caught_at_a_streak_start_whose_naming_is_rate_limited(amp, watching, events):
    """The streak-start weight check is never rate-limited: only the naming of the skip is."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=1e38)  # finite gradients, overflowing update
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"net": opt}, model=model)
    w._recorder.inspect_interval = 3600.0
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.b.bias))
    assert truth[id(opt)] is False  # iteration 0: a named skip starts the interval
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8) * 1e3)
    assert truth[id(opt)] is True and not all_finite(model)  # iteration 1: the poisoning step
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    assert truth[id(opt)] is False  # iteration 2: a new streak, not named
    recorded = events(w)
    assert [e["inspected"] for e in recorded if e["kind"] == "skip"] == [True, False]
    (poisoned,) = [e for e in recorded if e["kind"] == "poisoned_step"]
    assert (poisoned["optimizer"], poisoned["iteration"], poisoned["reason"]) == ("net", 1, "nonfinite_param")
    assert w.snapshot()["state"]["optimizers"]["net"]["poisoned_steps"] == 1


def test_a_step_into_non_finite_weights_while_another_optimizer_skips_is_one_nonfinite_param(amp, watching, events):
    """Issue 11, item 10: b steps with finite gradients into non-finite weights in the iteration a skips."""
    model = amp.TwoPart()
    opt_a = torch.optim.AdamW(model.a.parameters())
    opt_b = torch.optim.SGD(model.b.parameters(), lr=1e38)  # finite gradients, overflowing update
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8) * 1e3,
                          after_backward=lambda: amp.poison_grad(model.a.bias))
    assert truth == {id(opt_a): False, id(opt_b): True}
    assert all(torch.isfinite(p.grad).all() for p in model.b.parameters())  # b's gradients were finite
    assert not all_finite(model.b) and all_finite(model.a)  # but its step left its weights non-finite
    poisoned = [e for e in events(w) if e["kind"] == "poisoned_step"]
    assert [(e["optimizer"], e["iteration"], e["reason"]) for e in poisoned] == [("b", 0, "nonfinite_param")]
    assert poisoned[0]["params_total"] >= 1
    assert all(p["name"].startswith("b.") and p["inf"] + p["nan"] > 0 for p in poisoned[0]["params"])
    counters = w.snapshot()["state"]["optimizers"]
    assert counters["b"]["poisoned_steps"] == 1 and counters["a"]["poisoned_steps"] == 0
