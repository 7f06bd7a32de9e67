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
