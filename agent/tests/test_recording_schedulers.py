"""LR scheduler steps count as "after a skip" only right after a real skip, never before the first step."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def test_a_scheduler_stepped_before_the_first_scaler_step_is_not_counted_as_after_a_skip(amp, watching, events):
    # Warm-up code often steps a scheduler before training starts: no optimizer has stepped or skipped yet
    # (last_stepped is None, not False), so nothing ran ahead of a real update.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"opt": opt}, schedulers={"opt": sched})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about a scheduler stepped before its optimizer
        sched.step()
        sched.step()
    assert w.stepped(opt) is None
    amp.iteration(model, scaler, [opt], torch.randn(4, 8))  # a clean step: still nothing after a skip
    sched.step()
    assert w.snapshot()["state"]["optimizers"]["opt"]["scheduler_steps_after_skip"] == 0
    assert [e for e in events(w) if e["kind"] == "scheduler_after_skip"] == []
    assert sched.last_epoch == 3  # the scheduler itself stepped every time


def test_a_scheduler_dict_without_an_interval_is_per_step_unlike_lightnings_default(amp, watching):
    # Lightning reads {"scheduler": s} as per epoch; watch() reads it as per step, like a bare scheduler
    # (docs/agent.md): a per-epoch scheduler must say "interval": "epoch".
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    declared = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu")
    w = watching(scaler, {"opt": opt}, schedulers={"opt": [{"scheduler": plain},
                                                           {"scheduler": declared, "interval": "epoch"}]})
    amp.iteration(model, scaler, [opt], torch.randn(4, 8), after_backward=lambda: amp.poison_grad(model[0].weight))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: a scheduler stepped while its optimizer never did
        plain.step()
        declared.step()
    assert w.stepped(opt) is False
    assert w.snapshot()["state"]["optimizers"]["opt"]["scheduler_steps_after_skip"] == 1
