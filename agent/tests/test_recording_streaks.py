"""Consecutive skips as streaks: start, length and end, the ladder lengths reached, and a storm sent as its rungs."""

from __future__ import annotations

import torch


def test_consecutive_skips_form_a_streak_with_start_length_and_end(amp, watching, events, counters):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"net": opt})
    pattern = [False, True, True, True, False, True, False]  # True: inject inf
    for inject in pattern:
        amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model.b.bias)) if inject else None)
    c = counters(w, "net")
    assert (c["steps"], c["skipped"], c["streaks"], c["longest_streak"], c["consecutive_skipped"]) == (3, 4, 2, 3, 0)
    recorded = events(w)
    # A streak is sent as its rungs (1, 2, 4, ...) and its end; the 3rd skip is in the counters and the end only.
    assert [e["streak"] for e in recorded if e["kind"] == "skip"] == [1, 2, 1]
    ends = [(e["start_iteration"], e["length"], e["iteration"]) for e in recorded if e["kind"] == "streak_end"]
    assert ends == [(1, 3, 4), (5, 1, 6)]


def test_streaks_reached_counts_each_ladder_length_when_the_streak_reaches_it(amp, watching, counters):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"net": opt})
    poison = lambda: amp.poison_grad(model.b.bias)  # noqa: E731
    for _ in range(5):  # a streak of 5 skips, still running
        amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=poison)
    assert counters(w, "net")["streaks_reached"] == {"1": 1, "2": 1, "4": 1}
    amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=poison)
    assert counters(w, "net")["streaks_reached"] == {"1": 2, "2": 1, "4": 1}


def test_a_skip_storm_sends_and_inspects_only_the_streaks_rungs_and_its_end(amp, watching, events, counters):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)  # stays large through the storm
    w = watching(scaler, opt)
    for _ in range(40):
        amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model.b.bias))
    amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    recorded = events(w)
    skips = [e for e in recorded if e["kind"] == "skip"]
    assert [(e["streak"], e["iteration"], e["inspected"]) for e in skips] == \
        [(n, n - 1, True) for n in (1, 2, 4, 8, 16, 32)]
    assert skips[0]["params"] and all(e["params"] == skips[0]["params"] for e in skips)
    assert [(e["start_iteration"], e["length"]) for e in recorded if e["kind"] == "streak_end"] == [(0, 40)]
    # 40 backoffs in 40 iterations: one event at the run's 1st, 2nd, 4th, ... 32nd and one for the last 8.
    changes = [(e["iteration"], e.get("count", 1), e["before"], e["after"]) for e in recorded
               if e["kind"] == "scale_change"]
    assert changes == [(0, 1, 2.0 ** 100, 2.0 ** 99), (1, 1, 2.0 ** 99, 2.0 ** 98), (3, 2, 2.0 ** 98, 2.0 ** 96),
                       (7, 4, 2.0 ** 96, 2.0 ** 92), (15, 8, 2.0 ** 92, 2.0 ** 84), (31, 16, 2.0 ** 84, 2.0 ** 68),
                       (39, 8, 2.0 ** 68, 2.0 ** 60)]
    c = counters(w, "SGD")
    assert (c["skipped"], c["streaks_reached"]) == (40, {"1": 1, "2": 1, "4": 1, "8": 1, "16": 1, "32": 1})
    assert w.snapshot()["state"]["backoffs"] == 40
