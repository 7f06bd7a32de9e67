"""Skips per optimizer, checked against the ground truth: did the parameters' bits change?

Claims refer to docs/gradscaler.md (claims 1, 2, 4, 5, 6, 7).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_clean_step_is_reported_as_stepped(amp, watching, counters):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, model=model)
    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8))
    assert truth == {id(opt_a): True, id(opt_b): True}
    assert w.stepped(opt_a) is True and w.stepped(opt_b) is True
    assert counters(w, "a")["steps"] == 1 and counters(w, "a")["skipped"] == 0


def test_stepped_is_none_before_the_first_step(amp, watching):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
    w = watching(torch.amp.GradScaler("cpu"), [opt_a, opt_b])
    assert w.stepped(opt_a) is None


def test_one_optimizer_skips_while_the_other_steps_in_the_same_iteration(amp, watching, events, counters):
    """Claim 4: the decision is per optimizer."""
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model)
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
    opt_a, opt_b = amp.two_optimizers(model, fused=True)
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


def test_fused_adamw_clean_steps_are_counted(amp, watching, counters):
    model = amp.TwoPart()
    opt_a, opt_b = amp.two_optimizers(model, fused=True)
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


def test_second_step_before_update_still_raises_and_is_not_counted(amp, watching, counters):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt)
    scaler.scale(amp.forward(model, torch.randn(4, 8))).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    assert counters(w, "SGD")["steps"] == 1 and counters(w, "SGD")["skipped"] == 0


def test_gradient_accumulation_over_micro_batches_is_one_step_or_one_skip(amp, watching, counters):
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
