"""Skips per optimizer, checked against the ground truth: did the parameters' bits change?

Claims refer to /work/shared/GRADSCALER.md (claims 1, 2, 4, 5, 6, 7, 12).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn


def two_optimizers(model: nn.Module, fused: bool = False):
    opt_a = torch.optim.AdamW(model.a.parameters(), lr=1e-3, fused=fused or None)
    opt_b = torch.optim.SGD(model.b.parameters(), lr=0.01)
    return opt_a, opt_b


def counters(w, name):
    return w.snapshot()["state"]["optimizers"][name]


def test_clean_step_is_reported_as_stepped(amp, watching):
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8))
    assert truth == {id(opt_a): True, id(opt_b): True}
    assert w.stepped(opt_a) is True and w.stepped(opt_b) is True
    assert counters(w, "a")["steps"] == 1 and counters(w, "a")["skipped"] == 0


def test_stepped_is_none_before_the_first_step(amp, watching):
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model)
    w = watching(torch.amp.GradScaler("cpu"), [opt_a, opt_b])
    assert w.stepped(opt_a) is None


def test_one_optimizer_skips_while_the_other_steps_in_the_same_iteration(amp, watching, events):
    """Claim 4: the decision is per optimizer."""
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                          after_backward=lambda: amp.poison_grad(model.b.weight))
    assert truth == {id(opt_a): True, id(opt_b): False}
    assert (w.stepped(opt_a), w.stepped(opt_b)) == (True, False)
    assert counters(w, "a")["skipped"] == 0 and counters(w, "b")["skipped"] == 1
    skips = [e for e in events(w) if e["kind"] == "skip"]
    assert [(e["optimizer"], e["iteration"]) for e in skips] == [("b", 0)]


@pytest.mark.parametrize("poisoned", ["a", "b"])
def test_fused_adamw_skip_is_reported_although_its_step_is_called(amp, watching, poisoned):
    """Fused optimizers are stepped even on a skip (hooks fire), so the agent reads found_inf."""
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model, fused=True)
    stepped_calls = []
    opt_a.register_step_post_hook(lambda *a: stepped_calls.append(1))
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    layer = model.a if poisoned == "a" else model.b
    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                          after_backward=lambda: amp.poison_grad(layer.bias))
    assert stepped_calls == [1]  # the fused optimizer's step ran either way
    assert w.stepped(opt_a) is truth[id(opt_a)] and w.stepped(opt_b) is truth[id(opt_b)]
    assert truth[id(opt_a)] is (poisoned != "a")


def test_fused_adamw_clean_steps_are_counted(amp, watching):
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b})
    for _ in range(3):
        truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8))
        assert truth[id(opt_a)] and w.stepped(opt_a)
    assert (counters(w, "a")["steps"], counters(w, "a")["skipped"]) == (3, 0)


def test_explicit_unscale_and_clipping_still_skip_on_the_recorded_inf(amp, watching):
    """Claim 5: clipping after unscale_ does not prevent the skip."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt, model=model)

    def unscale_and_clip():
        amp.poison_grad(model.a.weight)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=unscale_and_clip)
    assert truth[id(opt)] is False and w.stepped(opt) is False
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8),
                          after_backward=lambda: (scaler.unscale_(opt),
                                                  torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    assert truth[id(opt)] is True and w.stepped(opt) is True


def test_second_unscale_still_raises_with_the_agent_attached(amp, watching):
    """Claim 6: unscale_ twice per step raises RuntimeError, with or without the agent."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    watching(scaler, opt)
    scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)


def test_second_step_before_update_still_raises_and_is_not_counted(amp, watching):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    assert counters(w, "SGD")["steps"] == 1 and counters(w, "SGD")["skipped"] == 0


def test_gradient_accumulation_over_micro_batches_is_one_step_or_one_skip(amp, watching):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    for poison_micro_batch in (None, 2):
        params = list(model.parameters())
        before = amp.bits(params)
        opt.zero_grad()
        for micro in range(4):
            x = torch.randn(4, 8)
            if micro == poison_micro_batch:
                x[0, 0] = float("inf")
            scaler.scale(amp.forward(model, x) / 4).backward()
        scaler.step(opt)
        scaler.update()
        assert w.stepped(opt) is amp.changed(before, params) is (poison_micro_batch is None)
    assert counters(w, "SGD")["steps"] == 1 and counters(w, "SGD")["skipped"] == 1


def test_nan_loss_skips_the_step(amp, watching):
    """Claim 2: a NaN loss usually gives NaN gradients, hence a skip."""
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    x = torch.randn(4, 8)
    x[1, 3] = float("nan")
    assert torch.isnan(amp.forward(model, x))
    truth = amp.iteration(model, scaler, [opt], x)
    assert truth[id(opt)] is False and w.stepped(opt) is False


def test_finite_loss_with_overflowing_gradients_skips(amp, watching):
    """Claim 2: the check is on gradients; a finite loss whose scaled gradients overflow still skips."""
    weight = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([weight], lr=1e-40)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    loss = (weight * 1e35).sum()
    assert torch.isfinite(loss)
    before = amp.bits([weight])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert not amp.changed(before, [weight]) and w.stepped(opt) is False


def test_large_loss_with_finite_gradients_is_not_a_skip(amp, watching):
    """Claim 1: a large loss is not a reason to skip."""
    weight = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([weight], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    w = watching(scaler, opt)
    loss = (weight * 1e6).pow(2).sum() * 1e20  # ~4e32: large, finite gradients ~2e33
    before = amp.bits([weight])
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert amp.changed(before, [weight]) and w.stepped(opt) is True


def test_zero_learning_rate_step_is_not_a_skip(amp, watching):
    """Claim 1: unchanged weights because of the learning rate are a step, not a skip."""
    model = amp.TwoPart()
    opt = torch.optim.Adam(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    truth = amp.iteration(model, scaler, [opt], torch.randn(4, 8))
    assert truth[id(opt)] is False  # bits unchanged...
    assert int(opt.state[model.a.weight]["step"]) == 1  # ...but the optimizer did step
    assert w.stepped(opt) is True


class SGDReturningMarker(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        return "stepped"


def test_scaler_step_returns_the_optimizers_value_and_none_does_not_mean_skipped(amp, watching):
    """Claim 7: scaler.step returns optimizer.step()'s value; SGD returns None even when it steps."""
    model = amp.TwoPart()
    marker = SGDReturningMarker(model.a.parameters(), lr=0.1)
    plain = torch.optim.SGD(model.b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"marker": marker, "plain": plain})
    scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
    assert scaler.step(marker) == "stepped"
    assert scaler.step(plain) is None and w.stepped(plain) is True
    scaler.update()
    scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
    amp.poison_grad(model.a.weight)
    assert scaler.step(marker) is None and w.stepped(marker) is False


def test_consecutive_skips_form_a_streak_with_start_length_and_end(amp, watching, events):
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


def test_streaks_reached_counts_each_ladder_length_when_the_streak_reaches_it(amp, watching):
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


def test_skip_names_the_offending_parameters_with_inf_and_nan_counts(amp, watching, events):
    """Claim 12: name the first non-finite parameters of the skipping optimizer."""
    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model)
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


def test_a_skip_storm_sends_and_inspects_only_the_streaks_rungs_and_its_end(amp, watching, events):
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


def test_attaching_the_agent_leaves_training_bit_identical(amp, no_collector):
    from ampwatch import agent

    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        model = amp.TwoPart()
        opt_a, opt_b = two_optimizers(model)
        fused = torch.optim.AdamW(model.b.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        handle = agent.watch(scaler, [opt_a, fused], model=model, run="t") if watched else None
        try:
            for i in range(12):
                amp.iteration(model, scaler, [opt_a, fused], torch.randn(4, 8),
                              after_backward=(lambda: amp.poison_grad(model.b.bias)) if i in (2, 3, 7) else None)
        finally:
            if handle is not None:
                handle.close()
        return amp.bits(model.parameters()) + [torch.tensor(scaler.get_scale()).view(torch.int32)]

    assert all(torch.equal(x, y) for x, y in zip(train(False), train(True)))


def test_a_failure_inside_the_agent_never_reaches_the_training_loop(amp, watching, monkeypatch, caplog):
    from ampwatch.agent import _device, _inspection

    def broken(*args, **kwargs):
        raise RuntimeError("injected agent fault")

    model = amp.TwoPart()
    opt_a, opt_b = two_optimizers(model, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    monkeypatch.setattr(_inspection, "scan_optimizers", broken)  # breaks skip inspection
    monkeypatch.setattr(_device, "fused_found_inf", broken)  # breaks the step pre-hook
    monkeypatch.setattr(_device, "scale_tensor", broken)  # breaks the update wrapper
    caplog.set_level(logging.ERROR, logger="ampwatch.agent")
    for _ in range(3):
        truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                              after_backward=lambda: amp.poison_grad(model.b.bias))
        # The scaler's own behaviour is intact: b skipped, a stepped, the scale backed off.
        assert truth == {id(opt_a): True, id(opt_b): False}
    assert scaler.get_scale() == 2.0 ** 16 / 8
    errors = w.snapshot()["state"]["delivery"]["agent_errors"]
    assert errors >= 6
    logged = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert 1 <= len(logged) <= 3  # once per failing site, not once per failure
