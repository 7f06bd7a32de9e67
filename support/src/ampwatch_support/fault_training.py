"""A real AMP training loop with the real agent attached, for fault-injection tests.

Every ``POISON_EVERY``-th iteration gets an inf in one gradient, so the real
``torch.amp.GradScaler("cpu")`` skips the step and backs off; with
``growth_interval=GROWTH_INTERVAL`` the scale grows back once per cycle, so it
neither collapses nor overflows however long the loop runs. The ground truth
(which iterations skipped, how the scale moved) is read with public API only.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["Trainer", "POISON_EVERY"]

POISON_EVERY = 24
GROWTH_INTERVAL = 12


class Trainer:
    """One rank's loop: a small MLP, SGD, bfloat16 autocast, a watched GradScaler."""

    def __init__(self, **watch_kwargs: Any) -> None:
        from ampwatch import agent
        torch.manual_seed(0)
        torch.set_num_threads(1)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=GROWTH_INTERVAL)
        self.x = torch.randn(256, 64)
        self.watch = agent.watch(self.scaler, {"main": self.optimizer}, model=self.model, **watch_kwargs)
        self.iteration = 0
        self.skipped_at: list[int] = []
        self.backoffs = self.growths = 0
        self.seconds: dict[str, list[float]] = {}  # phase -> iteration times

    def step(self, phase: str, x: torch.Tensor | None = None) -> None:
        """Run one iteration on ``x`` (default: a fixed batch), poisoned when its index says so; time it."""
        poison = self.iteration % POISON_EVERY == POISON_EVERY - 1
        began = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(self.x if x is None else x).float().pow(2).mean()
        self.scaler.scale(loss).backward()
        if poison:
            self.model[0].weight.grad.view(-1)[0] = float("inf")
        self.scaler.step(self.optimizer)
        before = self.scaler.get_scale()
        self.scaler.update()
        self.seconds.setdefault(phase, []).append(time.perf_counter() - began)
        after = self.scaler.get_scale()
        self.backoffs += after < before
        self.growths += after > before
        if poison:
            self.skipped_at.append(self.iteration)
        self.iteration += 1

    def run_for(self, seconds: float, phase: str, at_least: int = 0) -> None:
        """Train for ``seconds`` of wall time, and for at least ``at_least`` iterations however slow the machine is."""
        end, first = time.monotonic() + seconds, self.iteration
        while time.monotonic() < end or self.iteration - first < at_least:
            self.step(phase)

    def median(self, *phases: str) -> float:
        """Median iteration time over ``phases``."""
        return statistics.median(t for p in phases for t in self.seconds[p])

    def truth(self) -> dict[str, Any]:
        """What a collector must end up showing for this rank."""
        return {"iterations": self.iteration, "skipped_at": self.skipped_at, "steps": self.steps,
                "backoffs": self.backoffs, "growths": self.growths}

    @property
    def steps(self) -> int:
        return self.iteration - len(self.skipped_at)
