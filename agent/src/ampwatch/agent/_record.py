"""One watched optimizer's counters and per-iteration flags, as the recorder keeps them."""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch

from ampwatch.contract.batch import OptimizerCounters
from ampwatch.contract.protocol import STREAK_LADDER

__all__ = ["OptimizerRecord"]


@dataclasses.dataclass(slots=True, eq=False)
class OptimizerRecord:
    """Counters and per-iteration flags of one watched optimizer."""

    name: str
    optimizer_ref: weakref.ref
    """The optimizer, held weakly: its own step hook holds this record, which must not hold it in turn."""
    steps: int = 0
    skipped: int = 0
    consecutive: int = 0
    longest: int = 0
    streaks: int = 0
    streak_start: int = 0
    reached: list[int] = dataclasses.field(default_factory=lambda: [0] * len(STREAK_LADDER))
    scheduler_steps_after_skip: int = 0
    poisoned: int = 0
    last_stepped: bool | None = None
    last_step_iteration: int | None = None
    poison_reported_for: int | None = None  # step iteration already reported as poisoned
    last_streak_inspection: float = float("-inf")  # when the last naming scan at a streak start ended
    check_weights: bool = False  # a streak began this iteration: look at the weights its last step left
    check_after: bool = False  # without a scaler: the step got a closure, check its gradients after it
    poison_run: int = 0  # without a scaler: consecutive poisoned steps (events go at 1, 2, 4, 8, ...)
    origin_sent: tuple | None = None  # origin of the streak's last skip event: a change is news, a repeat is not
    # Per scaler.step call, written by the wrappers and the step pre-hook.
    hook_fired: bool = False
    found_inf: torch.Tensor | None = None
    stepped_this_iteration: bool = False
    # Fused optimizers on an asynchronous device: outcomes still on their way to the host.
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)

    @classmethod
    def of(cls, name: str, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """Return a fresh record of ``optimizer`` named ``name``."""
        return cls(name=name, optimizer_ref=weakref.ref(optimizer))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The watched optimizer. A record is read only from that optimizer's own hooks and the scaler's calls
        with it, so the optimizer is alive whenever this is read (the weak reference is for the garbage collector)."""
        return self.optimizer_ref()  # type: ignore[return-value]

    def counters(self) -> OptimizerCounters:
        """Return this optimizer's protocol counters as plain values."""
        reached = list(self.reached)  # list copy is atomic under the GIL
        counters: OptimizerCounters = {
            "steps": self.steps,
            "skipped": self.skipped,
            "consecutive_skipped": self.consecutive,
            "longest_streak": self.longest,
            "streaks": self.streaks,
            "streaks_reached": {str(n): c for n, c in zip(STREAK_LADDER, reached, strict=True) if c},
            "scheduler_steps_after_skip": self.scheduler_steps_after_skip,
            "poisoned_steps": self.poisoned,
        }
        return counters
