"""A disabled GradScaler (``enabled=False``, the usual bf16 recipe) is watched exactly as a job without one.

nanoGPT and many training scripts build ``GradScaler(enabled=(dtype == "float16"))``: in bf16 the scaler
scales nothing and skips nothing (GRADSCALER.md claim 10), so an inf/NaN gradient goes into the weights.
The watch checks every step for it, as ``watch(None, ...)`` does, and reports no loss scale.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

INF = float("inf")
STEPS = 8
POISONED = (2, 5)  # iterations whose gradients get an inf after backward


def _repair(model: nn.Module) -> None:
    """Put finite values back into the weights, so that each poisoned step stands alone (the same in every twin)."""
    with torch.no_grad():
        for p in model.parameters():
            p.nan_to_num_(0.0, 0.0, 0.0)


def nanogpt_loop(watching, how: str) -> dict:
    """nanoGPT's loop in bf16: ``how`` is "disabled" (its scaler, watched), "none" (``watch(None)``) or "unwatched".

    Return the ground truth (the iterations whose gradients held inf/NaN at the step), the watch and the bits
    of the weights at the end.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dtype = "bfloat16"
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))  # nanoGPT's line: disabled in bf16
    w = None
    if how != "unwatched":
        w = watching(scaler if how == "disabled" else None, {"net": opt}, model=model)
    truth = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in POISONED:
            model[2].bias.grad[1] = INF
        scaler.unscale_(opt)  # nanoGPT clips: a no-op unscale_, then the clip spreads the inf as NaN
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            truth.append(step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        _repair(model)
    bits = [p.detach().view(torch.int32).clone() for p in model.parameters()]
    return {"truth": truth, "watch": w, "bits": bits, "optimizer": opt}


def _poisoned(events_of, w) -> list[tuple]:
    return [(e["iteration"], e["streak"], e["reason"], e["params"])
            for e in events_of(w) if e["kind"] == "poisoned_step"]


def test_a_disabled_scaler_reports_every_poisoned_bf16_step_exactly_as_a_watch_without_one(watching, events):
    disabled, unscaled = nanogpt_loop(watching, "disabled"), nanogpt_loop(watching, "none")
    unwatched = nanogpt_loop(watching, "unwatched")
    assert disabled["truth"] == unscaled["truth"] == list(POISONED)  # ground truth: the clip made both NaN
    w = disabled["watch"]
    state, twin = w.snapshot()["state"], unscaled["watch"].snapshot()["state"]
    assert state["optimizers"]["net"]["poisoned_steps"] == len(disabled["truth"]) == 2
    assert state["optimizers"] == twin["optimizers"] and state["iteration"] == twin["iteration"] == STEPS
    recorded = _poisoned(events, w)
    # The clip multiplied every gradient by 0 (1 / an infinite norm): the inf became a NaN, the rest 0.
    named = [{"name": "2.bias", "inf": 0, "nan": 1}]
    assert recorded == _poisoned(events, unscaled["watch"]) == [(2, 1, "nonfinite_grad", named),
                                                                (5, 1, "nonfinite_grad", named)]
    # Nothing skips and nothing is scaled: no loss scale, no transition, the scaler said disabled.
    assert state["loss_scale"] is None and (state["backoffs"], state["growths"], state["manual_sets"]) == (0, 0, 0)
    assert w.snapshot()["scaler"] == {"enabled": False, "kind": "GradScaler", "init_scale": None,
                                      "growth_factor": None, "backoff_factor": None, "growth_interval": None}
    assert w.stepped(disabled["optimizer"]) is True
    assert "GradScaler disabled" in w.summary() and "every step is checked" in w.summary()
    # Training is bit-identical to the unwatched twin.
    for watched in (disabled, unscaled):
        assert all(torch.equal(a, b) for a, b in zip(watched["bits"], unwatched["bits"], strict=True))


def test_the_disabled_scaler_is_said_once_and_its_update_ends_no_iteration_of_its_own(watching, events):
    """Claim 10: the scaler's update() does nothing; the iteration is counted by the steps, as without a scaler."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = watching(scaler, {"net": opt}, model=model)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scaler.scale(model(torch.randn(4, 8)).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        scaler.update()  # a second update() in one iteration: counts nothing
        opt.zero_grad()
    assert scaler.get_scale() == 1.0
    assert w.snapshot()["state"]["iteration"] == 3
    assert [e["kind"] for e in events(w)] == ["scaler_disabled"]


def _scaled_iteration(model, opt, scaler, *, poison: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    if poison:
        model.bias.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize("order", ["disabled-then-enabled", "enabled-then-disabled"])
def test_rebinding_between_a_disabled_and_an_enabled_scaler_switches_between_checked_steps_and_skips(
        watching, events, order):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    disabled, enabled = torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu")
    first, second = (disabled, enabled) if order == "disabled-then-enabled" else (enabled, disabled)
    w = watching(first, {"net": opt}, model=model)
    for k in range(3):
        _scaled_iteration(model, opt, first, poison=k == 1)
        _repair(model)
    w.rebind(second)
    for k in range(3):
        _scaled_iteration(model, opt, second, poison=k == 1)
        _repair(model)
    counters = w.snapshot()["state"]["optimizers"]["net"]
    # The disabled scaler's poisoned iteration stepped with the inf (poisoned); the enabled one's skipped it.
    assert (counters["steps"], counters["skipped"], counters["poisoned_steps"]) == (5, 1, 1)
    recorded = events(w)
    poisoned = [e["iteration"] for e in recorded if e["kind"] == "poisoned_step"]
    skipped = [e["iteration"] for e in recorded if e["kind"] == "skip"]
    assert (poisoned, skipped) == (([1], [4]) if order == "disabled-then-enabled" else ([4], [1]))
    assert w.snapshot()["state"]["iteration"] == 6
    assert w.snapshot()["scaler"]["enabled"] is (second is enabled)
    assert [e["kind"] for e in recorded].count("scaler_disabled") == 1
    # No scale transition is made of the change: a disabled scaler has no scale to come from or go to.
    assert [e for e in recorded if e["kind"] == "scale_change" and e["cause"] == "restored"] == []
