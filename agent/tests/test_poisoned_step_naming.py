"""A poisoned step (a job without a GradScaler) with more poisoned gradients than an event names.

The protocol names at most 16 parameters per event (``params``) and counts them all (``params_total``),
whether the step's check is read at once (CPU: the very gradients the step applied, exact counts) or an
iteration later (a GPU's check, held back by hand here: named from what the check kept).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampwatch.contract.protocol import MAX_PARAMS

INF = float("inf")
LAYERS = 10  # 20 parameters, each gradient poisoned


def _poisoned_events(events, watch) -> list[dict]:
    return [e for e in events(watch) if e["kind"] == "poisoned_step"]


@pytest.mark.parametrize("read", ["at once", "late"])
def test_a_poisoned_step_with_more_than_16_poisoned_gradients_names_16_and_counts_them_all(watching, events,
                                                                                         request, read):
    held = request.getfixturevalue("late_checks") if read == "late" else None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, {"net": opt}, model=model)
    poisoned = []  # the truth: per iteration, how many gradients the step was handed held inf/NaN
    for iteration in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(3, 4)).float().pow(2).mean().backward()
        if iteration == 0:
            for p in model.parameters():
                p.grad.view(-1)[0] = INF
        poisoned.append(sum(not bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        opt.step()
        with torch.no_grad():  # the weights put right, as a job reloading its last good checkpoint would
            for p in model.parameters():
                p.nan_to_num_(0.0, 0.0, 0.0)
        if held:
            held[0].landed = True  # iteration 0's check lands before iteration 1's step looks
    assert poisoned == [2 * LAYERS, 0] and 2 * LAYERS > MAX_PARAMS
    (event,) = _poisoned_events(events, w)
    assert event["iteration"] == 0 and event.get("exact", True) is (read == "at once")
    assert len(event["params"]) == MAX_PARAMS and event["params_total"] == poisoned[0]
    assert [p["name"] for p in event["params"]] == [name for name, _ in model.named_parameters()][:MAX_PARAMS]
