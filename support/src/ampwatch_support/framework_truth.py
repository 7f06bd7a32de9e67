"""Ground truth for the framework integration tests: what each optimizer step and each scale change really did.

The frameworks step the optimizer and update the scale inside one call (Lightning's
and Accelerate's ``optimizer.step()``, the HF Trainer's step between two callback
events); :class:`Truth` brackets that call, compares parameter bit patterns (a NaN
parameter compares equal to itself this way) and the scaler's own float32 scale.
"""

from __future__ import annotations

import collections
import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch

__all__ = ["Truth", "bits", "counts_at", "fresh_state", "gpu_like_fp16", "params_of", "rank_at",
           "reset_accelerate_state", "same_bits", "watch_counts"]

INF = float("inf")
COUNTED = ("steps", "skipped", "scheduler_steps_after_skip", "poisoned_steps")
"""Each optimizer's counters the truth knows."""


def params_of(optimizer: Any) -> list[torch.Tensor]:
    """The parameters an optimizer (or a wrapper exposing ``.optimizer``) updates."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return [p for group in optimizer.param_groups for p in group["params"]]


def bits(params) -> list[torch.Tensor]:
    """Copy the bit patterns of ``params``."""
    return [p.detach().view(torch.int32).clone() for p in params]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Truth:
    """Count real steps, skips, poisoned steps, backoffs, growths and scheduler steps taken right after a skip.

    A poisoned step updated the parameters with gradients holding inf/NaN (read after the step: the
    optimizers used here never change a gradient in place). Without a scaler every step is a step.
    """

    def __init__(self) -> None:
        self.steps: collections.Counter = collections.Counter()
        self.skipped: collections.Counter = collections.Counter()
        self.poisoned: collections.Counter = collections.Counter()
        self.scheduler_steps_after_skip: collections.Counter = collections.Counter()
        self.backoffs = self.growths = 0
        self.last_stepped: dict[str, bool] = {}
        self._open: tuple[str, list, list, float] | None = None

    def before_step(self, name: str, params: list[torch.Tensor], scaler: torch.amp.GradScaler | None) -> None:
        """Note the parameters' bits and the scale before the framework steps ``name`` and updates the scale."""
        self._open = (name, params, bits(params), None if scaler is None else scaler.get_scale())

    def after_step(self, scaler: torch.amp.GradScaler | None) -> None:
        """Record whether the step changed any parameter, and how the scale moved."""
        name, params, before, scale = self._open
        self._open = None
        stepped = scaler is None or not same_bits(before, bits(params))  # without a scaler nothing skips
        self.last_stepped[name] = stepped
        (self.steps if stepped else self.skipped)[name] += 1
        self.poisoned[name] += stepped and not all(bool(torch.isfinite(p.grad).all()) for p in params
                                                   if p.grad is not None)
        if scaler is not None:  # bf16 and fp32 jobs have no scaler: steps only
            after = scaler.get_scale()
            self.backoffs += after < scale
            self.growths += after > scale

    def step(self, name: str, params: list[torch.Tensor], scaler: torch.amp.GradScaler | None,
             call: Callable[[], Any]):
        """Run ``call`` (a step that also updates the scale) between :meth:`before_step` and :meth:`after_step`."""
        self.before_step(name, params, scaler)
        result = call()
        self.after_step(scaler)
        return result

    def scheduler_stepped(self, name: str) -> None:
        """Note that a per-step scheduler of ``name`` advanced now."""
        if self.last_stepped.get(name) is False:
            self.scheduler_steps_after_skip[name] += 1

    def counts(self) -> dict[str, Any]:
        """The totals in the shape :func:`counts_at` reads from a collector."""
        names = sorted(set(self.steps) | set(self.skipped))
        return {"backoffs": self.backoffs, "growths": self.growths,
                "optimizers": {n: {"steps": self.steps[n], "skipped": self.skipped[n],
                                   "scheduler_steps_after_skip": self.scheduler_steps_after_skip[n],
                                   "poisoned_steps": self.poisoned[n]}
                               for n in names}}

    def add(self, other: dict[str, Any]) -> dict[str, Any]:
        """Return :meth:`counts` plus ``other`` (an earlier process's counts)."""
        mine = self.counts()
        result = {"backoffs": mine["backoffs"] + other["backoffs"], "growths": mine["growths"] + other["growths"],
                  "optimizers": {}}
        for name in sorted(set(mine["optimizers"]) | set(other["optimizers"])):
            a = mine["optimizers"].get(name, {})
            b = other["optimizers"].get(name, {})
            result["optimizers"][name] = {k: a.get(k, 0) + b.get(k, 0) for k in COUNTED}
        return result


def watch_counts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a watch's snapshot says, in the shape of :meth:`Truth.counts`."""
    state = snapshot["state"]
    return {"backoffs": state["backoffs"], "growths": state["growths"],
            "optimizers": {n: {k: c[k] for k in COUNTED} for n, c in state["optimizers"].items()}}


def rank_at(collector_url: str, run: str, rank: int = 0) -> dict[str, Any]:
    """The collector's account of one rank of ``run`` (totals over all its incarnations)."""
    with urllib.request.urlopen(f"{collector_url}/v1/runs/{run}", timeout=10) as answer:
        ranks = json.loads(answer.read())["ranks"]
    (found,) = [r for r in ranks if r["rank"] == rank]
    return found


def counts_at(rank: dict[str, Any]) -> dict[str, Any]:
    """A collector rank's totals in the shape of :meth:`Truth.counts`."""
    return {"backoffs": rank["backoffs"], "growths": rank["growths"],
            "optimizers": {n: {k: c[k] for k in COUNTED} for n, c in rank["optimizers"].items()}}


@pytest.fixture
def fresh_state(monkeypatch):
    """No AMPWATCH_* settings from the environment, and Accelerate's process state reset before and after."""
    for var in ("AMPWATCH_URL", "AMPWATCH_RUN", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)
    reset_accelerate_state()
    yield monkeypatch
    reset_accelerate_state()


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state, so the next Accelerator (or HF Trainer) may differ in precision.

    Accelerate keeps one state per process and refuses a second Accelerator with
    other settings; its own tests reset it the same way between tests.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def gpu_like_fp16(accelerator: Any, **scaler_kwargs: Any) -> Any:
    """Give ``accelerator`` what ``Accelerator(mixed_precision="fp16")`` gets on a GPU, with a real CPU GradScaler.

    On a GPU, ``Accelerator.__init__`` sets ``native_amp = True`` and makes a
    ``torch.amp.GradScaler``; on CPU it makes none (fp16 runs as fp32). With these
    two attributes set, float16 autocast wraps the prepared model, ``backward``
    scales the loss, ``clip_grad_norm_`` unscales, and every prepared optimizer
    steps through ``scaler.step`` and ``scaler.update``: the GPU code path, on CPU.
    """
    assert accelerator.scaler is None and accelerator.mixed_precision == "fp16"
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    return accelerator
