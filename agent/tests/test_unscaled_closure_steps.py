"""A job without a GradScaler that steps with a closure (``optimizer.step(closure)``, as Lightning and LBFGS do),
step after step: the watch reads each step's gradients after it, through one step post-hook for the whole run."""

from __future__ import annotations

import torch

STEPS = 6
POISONED_AT = 3


def test_every_closure_step_is_checked_through_one_post_hook_registered_once(amp, watching, events):
    model = amp.TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, opt, model=model)
    post_hooks = []
    for step in range(STEPS):
        opt.step(amp.closure(model, opt, poison=model.b.weight if step == POISONED_AT else None))
        post_hooks.append(len(opt._optimizer_step_post_hooks))
        with torch.no_grad():  # the weights put right, as a job reloading its last good checkpoint would
            for p in model.parameters():
                p.nan_to_num_(0.0, 0.0, 0.0)
    assert post_hooks == [1] * STEPS
    poisoned = [(e["iteration"], e["params"]) for e in events(w) if e["kind"] == "poisoned_step"]
    assert poisoned == [(POISONED_AT, [{"name": "b.weight", "inf": 1, "nan": 0}])]
    assert w.snapshot()["state"]["optimizers"]["SGD"]["steps"] == STEPS
    w.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
