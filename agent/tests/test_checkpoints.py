"""Checkpointing a watched job: every state_dict equals an unwatched twin's, saves, loads, and carries no agent.

A twin job (same seed, same data, same injected overflows) runs unwatched beside
the watched one; mid-run both are checkpointed the way training scripts do
(``torch.save`` of model, optimizers, scheduler and scaler state dicts).
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from torch.optim import lr_scheduler as lrs

SCHEDULERS = {
    "StepLR": lambda o: lrs.StepLR(o, 2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, [2, 4]),
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda i: 0.9 ** i),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda i: 0.95),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, 0.9),
    "ConstantLR": lambda o: lrs.ConstantLR(o, 0.5, total_iters=3),
    "LinearLR": lambda o: lrs.LinearLR(o, 0.25, total_iters=4),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=8),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, 10),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, 3),
    "CyclicLR": lambda o: lrs.CyclicLR(o, 0.01, 0.1, step_size_up=3, cycle_momentum=False),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.1, total_steps=50),
    "SequentialLR": lambda o: lrs.SequentialLR(o, [lrs.ConstantLR(o, 0.5, total_iters=2), lrs.ExponentialLR(o, 0.9)],
                                               milestones=[2]),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler([lrs.StepLR(o, 2), lrs.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, patience=0),
}
POISON_AT = {1, 4}  # iterations whose gradients get an inf: the watched job skips and backs off there


class Job:
    """A small AMP job: two optimizers, one scheduler of the kind under test on each, a CPU GradScaler."""

    def __init__(self, amp, kind: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.kind = kind
        self.model = amp.TwoPart()
        self.opts = {"a": torch.optim.SGD(self.model.a.parameters(), lr=0.1, momentum=0.9),
                     "b": torch.optim.AdamW(self.model.b.parameters(), lr=0.01)}
        self.scheds = {name: SCHEDULERS[kind](opt) for name, opt in self.opts.items()}
        self.scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        self.iteration = 0

    def step(self, amp) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(self.iteration))
        poison = self.iteration in POISON_AT
        for opt in self.opts.values():
            opt.zero_grad()
        loss = amp.forward(self.model, x)
        self.scaler.scale(loss).backward()
        if poison:
            amp.poison_grad(self.model.a.weight)
            amp.poison_grad(self.model.b.weight)
        for opt in self.opts.values():
            self.scaler.step(opt)
        self.scaler.update()
        for sched in self.scheds.values():
            sched.step(loss.item()) if isinstance(sched, lrs.ReduceLROnPlateau) else sched.step()
        self.iteration += 1

    def checkpoint(self) -> dict:
        return {"model": self.model.state_dict(), "scaler": self.scaler.state_dict(),
                **{f"opt_{n}": o.state_dict() for n, o in self.opts.items()},
                **{f"sched_{n}": s.state_dict() for n, s in self.scheds.items()}}

    def load(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        for n in self.opts:
            self.opts[n].load_state_dict(checkpoint[f"opt_{n}"])
            self.scheds[n].load_state_dict(checkpoint[f"sched_{n}"])

    def lrs(self) -> list[float]:
        return [g["lr"] for o in self.opts.values() for g in o.param_groups]


def same(a, b) -> bool:
    """Deep equality of checkpoint contents (tensors by value, NaN equal to NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def watch_job(watching, job: Job):
    return watching(job.scaler, job.opts, model=job.model, schedulers=job.scheds)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_a_watched_jobs_checkpoint_equals_an_unwatched_twins_and_saves(amp, watching, kind):
    watched, twin = Job(amp, kind), Job(amp, kind)
    w = watch_job(watching, watched)
    for _ in range(6):
        watched.step(amp)
        twin.step(amp)
    assert w.snapshot()["state"]["optimizers"]["a"]["skipped"] == len(POISON_AT)
    ours, theirs = watched.checkpoint(), twin.checkpoint()
    assert same(ours, theirs), f"{kind}: a watched job's checkpoint differs from an unwatched one's"
    buffer = io.BytesIO()
    torch.save(ours, buffer)  # raised "Can't pickle local object ..." when the wrappers leaked into it
    pickle.dumps(ours)
    buffer.seek(0)
    assert same(torch.load(buffer, weights_only=False), theirs)


@pytest.mark.parametrize("kind", ["LambdaLR", "SequentialLR", "ChainedScheduler", "OneCycleLR",
                                  "ReduceLROnPlateau", "StepLR"])
def test_a_checkpoint_loaded_elsewhere_carries_no_agent_and_resumes_like_the_twin(amp, watching, kind):
    watched, twin = Job(amp, kind), Job(amp, kind)
    w = watch_job(watching, watched)
    for _ in range(3):
        watched.step(amp)
        twin.step(amp)
    resumed = Job(amp, kind, seed=1)  # a new process would build fresh objects, then load the checkpoint
    resumed.load(copy.deepcopy(watched.checkpoint()))
    resumed.iteration = watched.iteration
    for obj in (resumed.scaler, *resumed.scheds.values()):
        assert not {"step", "update", "state_dict", "load_state_dict", "__getstate__"} & set(vars(obj))
    assert not any(o._optimizer_step_pre_hooks for o in resumed.opts.values())
    watched_lrs = watched.lrs()
    iteration = w.snapshot()["state"]["iteration"]
    for _ in range(3):
        resumed.step(amp)
        twin.step(amp)
    assert watched.lrs() == watched_lrs, "stepping the loaded copy moved the watched job's learning rates"
    assert w.snapshot()["state"]["iteration"] == iteration
    assert same(resumed.checkpoint(), twin.checkpoint())


def test_a_deep_copied_scheduler_state_loaded_into_another_scheduler_does_not_step_the_watched_one(amp, watching):
    watched = Job(amp, "StepLR")
    watch_job(watching, watched)
    other_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    other = lrs.StepLR(other_opt, 1, gamma=0.5)
    other.load_state_dict(copy.deepcopy(watched.scheds["a"].state_dict()))
    before = watched.lrs()
    for _ in range(3):
        other_opt.step()
        other.step()
    assert watched.lrs() == before
    assert "step" not in vars(other)


def test_closing_restores_every_attribute_and_the_state_dicts_stay_equal(amp, watching):
    watched, twin = Job(amp, "SequentialLR"), Job(amp, "SequentialLR")
    w = watch_job(watching, watched)
    watched.step(amp)
    twin.step(amp)
    w.close()
    assert not {"step", "update", "load_state_dict", "__getstate__"} & set(vars(watched.scaler))
    for sched in watched.scheds.values():
        assert not {"step", "state_dict", "__getstate__"} & set(vars(sched))
    assert same(watched.checkpoint(), twin.checkpoint())
