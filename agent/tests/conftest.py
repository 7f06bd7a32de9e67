"""Shared pieces for the agent's recording tests: a real AMP loop on CPU and bit-exact ground truth."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn


class TwoPart(nn.Module):
    """Two linear layers, so that two optimizers can each own one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class AmpLoop:
    """Drive a real ``torch.amp.GradScaler("cpu")`` under bfloat16 autocast and observe the ground truth."""

    TwoPart = TwoPart

    @staticmethod
    def two_optimizers(model: TwoPart, fused: bool = False) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        """Return an AdamW over ``model.a`` (fused when asked) and an SGD over ``model.b``."""
        opt_a = torch.optim.AdamW(model.a.parameters(), lr=1e-3, fused=fused or None)
        opt_b = torch.optim.SGD(model.b.parameters(), lr=0.01)
        return opt_a, opt_b

    @staticmethod
    def bits(params) -> list[torch.Tensor]:
        """Copy the bit patterns of ``params`` (NaN compares equal to itself this way)."""
        return [p.detach().view(torch.int32).clone() for p in params]

    @staticmethod
    def changed(before: list[torch.Tensor], params) -> bool:
        """Tell whether any parameter's bits differ from ``before``."""
        return any(not torch.equal(b, p.detach().view(torch.int32)) for b, p in zip(before, params, strict=True))

    @staticmethod
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Return a float32 loss computed under bfloat16 autocast."""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().pow(2).mean()

    @staticmethod
    def poison_grad(param: torch.Tensor, value: float = float("inf")) -> None:
        """Put one non-finite value into ``param.grad``."""
        param.grad.view(-1)[0] = value

    def closure(self, model: nn.Module, opt: torch.optim.Optimizer, poison: torch.Tensor | None = None
                ) -> Callable[[], torch.Tensor]:
        """Return a closure for ``opt.step(closure)``: forward and backward in bfloat16 (an inf put into
        ``poison``'s gradient, if given), as Lightning and LBFGS step."""
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = self.forward(model, torch.randn(4, 8))
            loss.backward()
            if poison is not None:
                self.poison_grad(poison)
            return loss
        return closure

    def iteration(self, model: nn.Module, scaler: torch.amp.GradScaler, optimizers: list,
                  x: torch.Tensor, *, after_backward: Callable[[], None] | None = None,
                  new_scale: float | None = None) -> dict[int, bool]:
        """Run scale -> backward -> step each -> update; return {id(opt): parameters changed}."""
        for opt in optimizers:
            opt.zero_grad()
        scaler.scale(self.forward(model, x)).backward()
        if after_backward is not None:
            after_backward()
        truth = {}
        for opt in optimizers:
            params = [p for g in opt.param_groups for p in g["params"]]
            before = self.bits(params)
            scaler.step(opt)
            truth[id(opt)] = self.changed(before, params)
        scaler.update(new_scale) if new_scale is not None else scaler.update()
        return truth


@pytest.fixture
def amp() -> AmpLoop:
    """Return the AMP loop helpers."""
    torch.manual_seed(0)
    return AmpLoop()


@pytest.fixture
def no_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure the agent records locally and sends nothing, whatever the environment says."""
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def watching(no_collector) -> Iterator[Callable]:
    """Return ``agent.watch`` that closes every watch it made at the end of the test, even on failure."""
    from ampwatch import agent

    made = []

    def make(*args, **kwargs):
        kwargs.setdefault("run", "test-run")
        handle = agent.watch(*args, **kwargs)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        with contextlib.suppress(Exception):
            handle.close(timeout=1.0)


def drain(watch_handle) -> list[dict]:
    """Return the events recorded so far (test-only access to the event buffer)."""
    return watch_handle._recorder.events.drain()


@pytest.fixture
def events() -> Callable:
    """Return a function that takes the recorded events of a watch."""
    return drain


def optimizer_counters(watch_handle, name: str) -> dict:
    """Return the protocol counters of the watched optimizer ``name`` (its ``state.optimizers`` entry)."""
    return watch_handle.snapshot()["state"]["optimizers"][name]


@pytest.fixture
def counters() -> Callable:
    """Return a function that reads one optimizer's counters from a watch's snapshot."""
    return optimizer_counters


class HeldRead:
    """A read that has not landed until the test sets ``landed`` (as a GPU's copy lands some time after its step)."""

    def __init__(self, read) -> None:
        self.read, self.landed = read, False

    def done(self) -> bool:
        return self.landed

    def wait(self):
        return self.read.wait()


@pytest.fixture
def late_checks(monkeypatch: pytest.MonkeyPatch) -> list[HeldRead]:
    """Make every scaler-less check land late, as a GPU's does; return their reads, in step order.

    No GPU here: ``check_nonfinite``'s device branch runs on the CPU tensors, and its read of the one bool is
    held back until the test sets ``landed`` (the rest is real).
    """
    from ampwatch.agent import _device, _poison

    held: list[HeldRead] = []

    def landing_late(tensors, flag):
        values = _device.max_abs(tensors)
        held.append(HeldRead(_device.read_later(~torch.isfinite(values).all())))
        return _poison.NonfiniteCheck(read=held[-1], max_abs=values)

    monkeypatch.setattr(_poison, "check_nonfinite", landing_late)
    return held
