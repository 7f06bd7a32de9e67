"""Loss-scale transitions, the disabled scaler and LR schedulers (docs/gradscaler.md, claims 3, 8, 9, 10, 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def model_and_two_optimizers():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.01)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.01)
    return model, opt_a, opt_b


def transitions(recorded):
    return [(e["cause"], e["before"], e["after"], e["iteration"]) for e in recorded if e["kind"] == "scale_change"]


def test_overflow_in_both_optimizers_backs_off_once(amp, watching, events):
    """Claims 3 and 4: one update() backs off once however many optimizers overflowed."""
    model, opt_a, opt_b = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b})

    def both():
        amp.poison_grad(model[0].weight)
        amp.poison_grad(model[2].weight)

    truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8), after_backward=both)
    assert truth == {id(opt_a): False, id(opt_b): False}
    assert scaler.get_scale() == 32768.0
    state = w.snapshot()["state"]
    assert (state["backoffs"], state["growths"], state["loss_scale"], state["iteration"]) == (1, 0, 32768.0, 1)
    assert transitions(events(w)) == [("backoff", 65536.0, 32768.0, 0)]


def test_a_backoff_alone_does_not_say_which_optimizer_skipped(amp, watching):
    """Claim 8: comparing the scale before/after update() cannot tell two optimizers apart; stepped() can."""
    model, opt_a, opt_b = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b})
    for poisoned, other in ((model[0], opt_b), (model[2], opt_a)):
        before = scaler.get_scale()
        truth = amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                              after_backward=lambda poisoned=poisoned: amp.poison_grad(poisoned.bias))
        assert scaler.get_scale() < before  # same signal either way...
        assert w.stepped(other) is truth[id(other)] is True  # ...but the agent knows who stepped


def test_growth_after_growth_interval_clean_iterations_is_a_growth_transition(amp, watching, events):
    model, opt_a, _ = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    w = watching(scaler, opt_a)
    scales = []
    for _ in range(7):
        amp.iteration(model, scaler, [opt_a], torch.randn(4, 8))
        scales.append(scaler.get_scale())
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert transitions(events(w)) == [("growth", 8.0, 16.0, 2), ("growth", 16.0, 32.0, 5)]
    state = w.snapshot()["state"]
    assert (state["growths"], state["backoffs"], state["loss_scale"]) == (2, 0, 32.0)


def test_unchanged_scale_is_not_reported_as_a_skip(amp, watching, events):
    """Claim 3: "the scale did not change" does not mean "skipped"."""
    model, opt_a, _ = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu", growth_interval=1000)
    w = watching(scaler, opt_a)
    for _ in range(4):
        truth = amp.iteration(model, scaler, [opt_a], torch.randn(4, 8))
        assert truth[id(opt_a)] is True and scaler.get_scale() == 65536.0
    recorded = events(w)
    assert not [e for e in recorded if e["kind"] in ("skip", "scale_change")]
    assert w.snapshot()["state"]["optimizers"]["SGD"]["skipped"] == 0


def test_manual_update_new_scale_is_a_manual_transition_not_a_backoff(amp, watching, events):
    """Claim 9: update(new_scale=...) sets the scale by hand, even in an iteration that overflowed.

    Setting the value the scale already has changes nothing and is not counted.
    """
    model, opt_a, _ = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt_a)
    amp.iteration(model, scaler, [opt_a], torch.randn(4, 8), new_scale=1024.0)
    truth = amp.iteration(model, scaler, [opt_a], torch.randn(4, 8), new_scale=128.0,
                          after_backward=lambda: amp.poison_grad(model[0].weight))
    assert truth[id(opt_a)] is False and scaler.get_scale() == 128.0
    amp.iteration(model, scaler, [opt_a], torch.randn(4, 8))  # keyword-free default update
    amp.iteration(model, scaler, [opt_a], torch.randn(4, 8), new_scale=128.0)  # sets what it already was
    assert transitions(events(w)) == [("manual", 65536.0, 1024.0, 0), ("manual", 1024.0, 128.0, 1)]
    state = w.snapshot()["state"]
    assert (state["manual_sets"], state["backoffs"], state["optimizers"]["SGD"]["skipped"]) == (2, 0, 1)


def test_disabled_scaler_is_reported_as_disabled_and_never_as_skipped(amp, watching, events):
    """Claim 10: enabled=False checks nothing; every step is a step, get_scale() is 1.0. The watch checks each
    step instead, as without a scaler (test_disabled_scaler.py): the inf is a poisoned step, not a skip."""
    model, opt_a, _ = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = watching(scaler, opt_a)
    truth = amp.iteration(model, scaler, [opt_a], torch.randn(4, 8),
                          after_backward=lambda: amp.poison_grad(model[0].bias))
    # The inf went into the weights: nothing was checked, the optimizer stepped.
    assert truth[id(opt_a)] is True and scaler.get_scale() == 1.0
    assert w.stepped(opt_a) is True
    snap = w.snapshot()
    assert snap["scaler"]["enabled"] is False
    assert snap["state"]["loss_scale"] is None and snap["state"]["optimizers"]["SGD"]["skipped"] == 0
    assert snap["state"]["iteration"] == 1
    assert [e["kind"] for e in events(w)] == ["scaler_disabled", "poisoned_step"]
    assert snap["state"]["optimizers"]["SGD"]["poisoned_steps"] == 1


def test_calibration_skips_at_the_start_are_a_short_streak_then_steps_resume(amp, watching, events):
    """Claim 11: the scale starts high, backs off until gradients fit, then training proceeds."""
    weight = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([weight], lr=1e-36)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    w = watching(scaler, {"w": opt})
    truth = []
    for _ in range(4):
        opt.zero_grad()
        # Scaled gradient 1.5e34 * scale overflows float32 (3.4e38) at 2**16 and 2**15, not at 2**14.
        scaler.scale((weight * 1.5e34).sum()).backward()
        before = amp.bits([weight])
        scaler.step(opt)
        truth.append(amp.changed(before, [weight]))
        assert w.stepped(opt) is truth[-1]
        scaler.update()
    assert truth == [False, False, True, True]
    c = w.snapshot()["state"]["optimizers"]["w"]
    assert (c["skipped"], c["steps"], c["consecutive_skipped"], c["longest_streak"]) == (2, 2, 0, 2)
    assert [(e["start_iteration"], e["length"]) for e in events(w) if e["kind"] == "streak_end"] == [(0, 2)]
    assert w.snapshot()["state"]["loss_scale"] == scaler.get_scale() == 2.0 ** 14


def test_scale_of_a_scaler_that_already_ran_is_picked_up_when_attaching(amp, watching, events):
    model, opt_a, _ = model_and_two_optimizers()
    scaler = torch.amp.GradScaler("cpu")
    amp.iteration(model, scaler, [opt_a], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model[0].bias))
    w = watching(scaler, opt_a)
    assert w.snapshot()["state"]["loss_scale"] == 32768.0
    amp.iteration(model, scaler, [opt_a], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model[0].bias))
    assert transitions(events(w)) == [("backoff", 32768.0, 16384.0, 0)]


def test_scheduler_step_after_a_skip_is_counted_and_reported(amp, watching, events):
    """Claim 8: a per-update scheduler should not advance on a skipped step."""
    model, opt_a, opt_b = model_and_two_optimizers()
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.9)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda i: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"a": opt_a, "b": opt_b}, schedulers={"a": sched_a, "b": [sched_b]})
    for inject in (False, True, False):
        amp.iteration(model, scaler, [opt_a, opt_b], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model[0].bias)) if inject else None)
        sched_a.step()  # the common bug: unconditional
        sched_b.step()
    state = w.snapshot()["state"]["optimizers"]
    assert state["a"]["scheduler_steps_after_skip"] == 1 and state["b"]["scheduler_steps_after_skip"] == 0
    (event,) = [e for e in events(w) if e["kind"] == "scheduler_after_skip"]
    assert (event["optimizer"], event["scheduler"], event["iteration"]) == ("a", "StepLR", 2)


def test_scheduler_guarded_by_stepped_is_never_counted(amp, watching):
    model, opt_a, _ = model_and_two_optimizers()
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt_a, schedulers=sched)
    for inject in (False, True, True, False):
        amp.iteration(model, scaler, [opt_a], torch.randn(4, 8),
                      after_backward=(lambda: amp.poison_grad(model[0].bias)) if inject else None)
        if w.stepped(opt_a):
            sched.step()
    assert w.snapshot()["state"]["optimizers"]["SGD"]["scheduler_steps_after_skip"] == 0
    assert sched.last_epoch == 2


def test_a_per_epoch_scheduler_stepped_after_the_epochs_last_iteration_skipped_is_not_counted(amp, watching, events):
    """Issue 11, item 9: an epoch scheduler ran nothing ahead of a skipped step; a per-step one did."""
    model, opt_a, _ = model_and_two_optimizers()
    per_epoch = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    per_step = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda i: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt_a, schedulers=[{"scheduler": per_epoch, "interval": "epoch"},
                                             {"scheduler": per_step, "interval": "step"}])
    for _epoch in range(2):
        for i in range(3):
            last = i == 2
            amp.iteration(model, scaler, [opt_a], torch.randn(4, 8),
                          after_backward=(lambda: amp.poison_grad(model[0].bias)) if last else None)
            per_step.step()
        per_epoch.step()
    assert w.snapshot()["state"]["optimizers"]["SGD"]["scheduler_steps_after_skip"] == 2
    assert {e["scheduler"] for e in events(w) if e["kind"] == "scheduler_after_skip"} == {"LambdaLR"}
    assert "step" not in vars(per_epoch)


def test_a_scheduler_interval_other_than_step_or_epoch_is_refused(watching):
    _, opt_a, _ = model_and_two_optimizers()
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1)
    with pytest.raises(ValueError, match="interval must be 'step' or 'epoch'"):
        watching(torch.amp.GradScaler("cpu"), opt_a, schedulers={"scheduler": sched, "interval": "batch"})


def test_close_restores_the_scheduler_and_scaler_methods(amp, watching):
    model, opt_a, _ = model_and_two_optimizers()
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, opt_a, schedulers=sched)
    assert "step" in vars(sched) and "step" in vars(scaler) and "update" in vars(scaler)
    w.close()
    assert "step" not in vars(sched) and "step" not in vars(scaler) and "update" not in vars(scaler)
    assert not opt_a._optimizer_step_pre_hooks
