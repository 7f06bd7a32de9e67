"""A compiled optimizer step (PyTorch's compiled-optimizer recipe: ``torch.compile`` of a function that calls
``opt.step()``) is watched as an eager one, on the eager, aot_eager and inductor backends (CPU).

Dynamo meets the agent's step pre-hook inside the compiled step: traced, or run as Python between graphs
with every function it calls compiled on its own. Either way a gradient check read at trace time would be
baked in, and every later step would look like the traced (clean) one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # inductor compiles C++: seconds per graph

BACKENDS = ["eager", "aot_eager", "inductor"]
STEPS = 7
POISONED = (2, 5)  # iterations whose gradients get an inf after backward


def _repair(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """0 for every inf/NaN in the weights and Adam's moments, so that each poisoned step stands alone."""
    with torch.no_grad():
        for p in model.parameters():
            p.nan_to_num_(0.0, 0.0, 0.0)
        for state in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].nan_to_num_(0.0, 0.0, 0.0)


def compiled_job(watching, backend: str, how: str, *, watched: bool = True) -> dict:
    """The recipe's loop, bf16; ``how``: "none" (no scaler: ``watch(None)``), "disabled" (a disabled scaler),
    "scaled" (an enabled one: ``scaler.step(opt)`` with ``opt.step`` compiled) or "scaled-whole" (a compiled
    function calling ``scaler.step(opt)``, ``scaler.update()`` and a per-step LR scheduler's ``step()``).

    Return the ground truth (the iterations whose gradients held inf/NaN at the step; with a scaler: the
    iterations that did not change the weights), the watch and the weights' bits at the end.
    """
    torch._dynamo.reset()  # a fresh cache: each job's step is compiled for it, never run from another's entry
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))  # the recipe's tensor LR: no recompiles
    scaled = how.startswith("scaled")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaled) if how != "none" else None
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    # grad_norm=True: the spike watch's norm, computed in the step pre-hook, must not be traced either.
    w = watching(scaler, {"net": opt}, model=model, schedulers=schedule, grad_norm=True) if watched else None
    if how == "scaled-whole":
        @torch.compile(backend=backend)
        def step() -> None:
            scaler.step(opt)
            scaler.update()
            schedule.step()
    elif scaler is not None:
        opt.step = torch.compile(opt.step, backend=backend)

        def step() -> None:
            scaler.step(opt)
            scaler.update()
    else:
        @torch.compile(backend=backend)
        def step() -> None:
            opt.step()

    truth = []
    for i in range(STEPS):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if i in POISONED:
            model[2].bias.grad[1] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        if (scaled and not changed) or (not scaled and not finite):
            truth.append(i)
        _repair(model, opt)
    if w is not None:
        w.close()
    return {"truth": truth, "watch": w, "bits": [p.detach().view(torch.int32).clone() for p in model.parameters()]}


def _same_bits(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["bits"], b["bits"], strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_step_reports_every_poisoned_step_and_trains_as_the_unwatched_compiled_twin(
        watching, events, backend):
    unwatched = compiled_job(watching, backend, "none", watched=False)
    for how in ("none", "disabled"):  # watch(None) and a disabled scaler: the same check of every step
        job = compiled_job(watching, backend, how)
        assert job["truth"] == unwatched["truth"] == list(POISONED)
        state = job["watch"].snapshot()["state"]
        assert state["optimizers"]["net"]["poisoned_steps"] == len(job["truth"]), how
        assert state["optimizers"]["net"]["steps"] == STEPS and state["delivery"]["agent_errors"] == 0
        assert "grad_norm" in state["optimizers"]["net"], how
        poisoned = [e for e in events(job["watch"]) if e["kind"] == "poisoned_step"]
        assert [(e["iteration"], e["params"]) for e in poisoned] == [
            (i, [{"name": "2.bias", "inf": 1, "nan": 0}]) for i in POISONED]
        assert _same_bits(job, unwatched), f"{how}: the watched compiled step changed training"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["scaled", "scaled-whole"])
def test_a_compiled_step_under_a_scaler_reports_every_skip_and_trains_as_the_unwatched_compiled_twin(
        watching, backend, how):
    watched = compiled_job(watching, backend, how)
    unwatched = compiled_job(watching, backend, how, watched=False)
    assert watched["truth"] == unwatched["truth"] == list(POISONED)
    counters = watched["watch"].snapshot()["state"]["optimizers"]["net"]
    assert (counters["steps"], counters["skipped"]) == (STEPS - len(POISONED), len(POISONED))
    # The schedule steps in the compiled function right after each skip.
    assert counters["scheduler_steps_after_skip"] == (len(POISONED) if how == "scaled-whole" else 0)
    assert watched["watch"].snapshot()["state"]["delivery"]["agent_errors"] == 0
    assert _same_bits(watched, unwatched)


def test_a_torch_whose_dynamo_cannot_load_still_gets_every_step_checked(watching, events, monkeypatch):
    """A torch built without Dynamo cannot run here: ``torch.compiler.disable`` raising stands in for it."""
    def no_dynamo(*args, **kwargs):
        raise ImportError("torch._dynamo is not available on this build")

    monkeypatch.setattr(torch.compiler, "disable", no_dynamo)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = watching(None, {"net": opt}, model=model)  # does not fail: nothing could compile the step anyway
    truth = []
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if i == 1:
            model.bias.grad[0] = float("inf")
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            truth.append(i)
        opt.step()
    assert truth == [1, 2]  # the inf went into the weights: the next gradients are non-finite too
    assert [e["iteration"] for e in events(w) if e["kind"] == "poisoned_step"] == truth
