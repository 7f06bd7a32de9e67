"""A skip names its offending parameters with inf/NaN counts (docs/gradscaler.md, claim 12), rate-limited."""

from __future__ import annotations

import torch
from torch import nn


def test_skip_names_the_offending_parameters_with_inf_and_nan_counts(amp, watching, events):
    """Claim 12: name the first non-finite parameters of the skipping optimizer."""
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)

    def inject():
        model.b.weight.grad[0, :3] = float("inf")
        model.b.bias.grad[1] = float("nan")

    amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8), after_backward=inject)
    (skip,) = [e for e in events(w) if e["kind"] == "skip"]
    assert skip["optimizer"] == "b" and skip["inspected"] is True and skip["params_total"] == 2
    assert skip["params"] == [{"name": "b.weight", "inf": 3, "nan": 0}, {"name": "b.bias", "inf": 0, "nan": 1}]


def test_parameters_are_named_by_optimizer_position_without_a_model(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.b.bias))
    (skip,) = [e for e in events(w) if e["kind"] == "skip"]
    assert skip["params"] == [{"name": "param_groups[0][3] [4]", "inf": 1, "nan": 0}]


def test_named_parameters_argument_names_parameters(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, named_parameters=[("head.bias", model.b.bias)])
    amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.b.bias))
    (skip,) = [e for e in events(w) if e["kind"] == "skip"]
    assert skip["params"][0]["name"] == "head.bias"


def test_at_most_sixteen_offending_parameters_are_named_but_all_are_counted(amp, watching, events):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)
    x = torch.randn(2, 4)
    x[0, 0] = float("inf")
    amp.iteration(model, scaler, [opt], x)
    (skip,) = [e for e in events(w) if e["kind"] == "skip"]
    assert len(skip["params"]) == 16 and skip["params_total"] == 20
    assert skip["params"][0]["name"] == "0.weight"


def test_new_streak_starts_are_inspected_at_most_once_per_interval(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    for i in range(6):  # skip, step, skip, step, ...: three one-skip streaks within one interval
        amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model.b.bias)) if i % 2 == 0 else None)
    assert [e["inspected"] for e in events(w) if e["kind"] == "skip"] == [True, False, False]


def test_the_streak_start_interval_counts_from_the_end_of_a_long_naming_scan(amp, watching, events, monkeypatch):
    """A naming scan longer than the interval must not run again at the next streak start.

    The agent's clock is replaced by one that moves only while a scan names a parameter (2 s each,
    twice the interval): counted from the start of the scan, every streak start would be named.
    """
    from ampwatch.agent import _inspection

    class ScanClock:
        now = 0.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

    monkeypatch.setattr(_inspection, "time", ScanClock)
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = watching(torch.amp.GradScaler("cpu"), opt)
    names = w._recorder.names
    real_name = names.name

    def slow_name(*args):
        ScanClock.now += 2.0
        return real_name(*args)

    monkeypatch.setattr(names, "name", slow_name)
    assert w._recorder.inspect_interval == 1.0
    for i in range(6):  # skip, step, skip, step, ...: three one-skip streaks, no time between scans
        amp.iteration(model, w._recorder.scaler, [opt], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model.b.bias)) if i % 2 == 0 else None)
    assert [e["inspected"] for e in events(w) if e["kind"] == "skip"] == [True, False, False]
    assert ScanClock.now == 2.0  # one naming scan, of one parameter
