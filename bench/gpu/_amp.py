"""The AMP loop every GPU check drives: device, model, optimizers, bit-level ground truth, fault injection."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["Amp", "CleanLoop", "OPTIMIZER_KINDS", "ThreePart", "changed", "inject", "make_optimizers", "params_of",
           "snapshot_bits", "step_all"]

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class Amp:
    """The device under test and its mixed-precision settings: float16 autocast and ``GradScaler(<type>)``.

    float16 on CPU too (CPU autocast supports it since torch 2.3): the overflow checks then overflow for real
    on either device, whereas bfloat16 reaches 3e38 and would need fake infs.
    """

    device: torch.device
    dtype: torch.dtype = torch.float16

    @property
    def cuda(self) -> bool:
        """Whether the device is a CUDA GPU."""
        return self.device.type == "cuda"

    def autocast(self) -> torch.autocast:
        """Return the autocast context for a forward pass."""
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scaler(self, **kwargs) -> torch.amp.GradScaler:
        """Return a real ``GradScaler`` for this device type."""
        return torch.amp.GradScaler(self.device.type, **kwargs)

    def sync(self) -> None:
        """Wait for the device's queued work (a no-op on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


class ThreePart(nn.Module):
    """Three linear layers, ``a``, ``b`` and ``c``, so that three optimizers can each own one."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(16, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


# SGD without momentum: torch 2.13's fused SGD creates its momentum buffers with empty_like() on its first
# call and a skipped first step leaves them uninitialised, so the next real step writes garbage into the
# weights (seen on CPU here; the same Python code runs on CUDA). The truth runs start by skipping on purpose.
OPTIMIZER_KINDS = {
    # name -> (class, keyword arguments, part of ThreePart it owns)
    "mixed": (("adamw_foreach", torch.optim.AdamW, {"lr": 1e-3, "foreach": True}, "a"),
              ("adamw_fused", torch.optim.AdamW, {"lr": 1e-3, "fused": True}, "b"),
              ("sgd_fused", torch.optim.SGD, {"lr": 1e-2, "fused": True}, "c")),
    "fused": (("adamw_fused_a", torch.optim.AdamW, {"lr": 1e-3, "fused": True}, "a"),
              ("adamw_fused_b", torch.optim.AdamW, {"lr": 1e-3, "fused": True}, "b"),
              ("sgd_fused", torch.optim.SGD, {"lr": 1e-2, "fused": True}, "c")),
    "foreach": (("adamw_foreach_a", torch.optim.AdamW, {"lr": 1e-3, "foreach": True}, "a"),
                ("adamw_foreach_b", torch.optim.AdamW, {"lr": 1e-3, "foreach": True}, "b"),
                ("sgd_foreach", torch.optim.SGD, {"lr": 1e-2, "foreach": True}, "c")),
}
"""Which optimizers a check uses; ``mixed`` (the truth checks) steps the foreach one first, so that its
synchronising ``found_inf`` read does not make the fused optimizers' answers land before ``update()``."""


def _fused_works(cls: type, device: torch.device) -> str | None:
    """Return None when ``cls(fused=True)`` steps on ``device``, else why not."""
    try:
        p = nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.ones(2, device=device)
        cls([p], lr=0.1, fused=True).step()
        return None
    except Exception as error:  # noqa: BLE001 - any failure means: not available here
        return f"{type(error).__name__}: {error}"


def make_optimizers(model: ThreePart, kind: str, device: torch.device) -> tuple[dict[str, torch.optim.Optimizer],
                                                                               list[str]]:
    """Build the optimizers of ``kind`` over ``model``'s parts; return them and notes on substitutions.

    A fused optimizer that this torch cannot run on ``device`` is replaced by its foreach version, and a
    note says so (torch 2.13 has fused AdamW and SGD on CPU and CUDA, so none is expected).
    """
    optimizers, notes = {}, []
    for name, cls, kwargs, part in OPTIMIZER_KINDS[kind]:
        kwargs = dict(kwargs)
        if kwargs.get("fused"):
            why = _fused_works(cls, device)
            if why is not None:
                kwargs.pop("fused")
                kwargs["foreach"] = True
                notes.append(f"{name}: {cls.__name__}(fused=True) does not run on {device.type} ({why}); "
                             "used foreach=True instead")
        optimizers[name] = cls(getattr(model, part).parameters(), **kwargs)
    return optimizers, notes


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Return the parameters ``optimizer`` owns, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def snapshot_bits(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Copy the bit patterns of float32 ``params`` on their device (no sync; NaN equals itself this way)."""
    return [p.detach().view(torch.int32).clone() for p in params]


def changed(before: list[torch.Tensor], params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Return a device bool tensor: did any parameter's bits change since ``before``? (no sync)"""
    return torch.stack([(b != p.detach().view(torch.int32)).any() for b, p in zip(before, params, strict=True)]).any()


def inject(model: nn.Module, target: str, value: float, count: int = 1) -> None:
    """Write ``value`` into the first ``count`` elements of the gradient of parameter ``target`` (no sync)."""
    grad = dict(model.named_parameters())[target].grad
    grad.view(-1)[:count] = value


def step_all(scaler: torch.amp.GradScaler, optimizers: dict[str, torch.optim.Optimizer],
             after_each: Callable[[str], None] = lambda name: None) -> dict[str, torch.Tensor]:
    """``scaler.step`` each optimizer in order; return {name: device bool tensor "its parameters changed"}."""
    truth = {}
    for name, opt in optimizers.items():
        params = params_of(opt)
        before = snapshot_bits(params)
        scaler.step(opt)
        truth[name] = changed(before, params)
        after_each(name)
    return truth


def overflowing_input(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` scaled so that float16 activations exceed 65504 (inf in the autocast forward)."""
    return x * (FP16_MAX * 4)


class CleanLoop:
    """A training loop with no overflow: ``mixed``/``fused``/``foreach`` optimizers, optionally watched.

    ``run(n)`` does n iterations of zero_grad, autocast forward, scale, backward, step each, update; it never
    asks the agent anything, so whatever the agent costs, it costs it on its own.
    """

    def __init__(self, amp: Amp, kind: str, watched: bool, *, ask: bool = False) -> None:
        torch.manual_seed(0)
        self.amp, self.ask = amp, ask
        self.model = ThreePart().to(amp.device)
        self.optimizers, self.notes = make_optimizers(self.model, kind, amp.device)
        self.scaler = amp.scaler(init_scale=2.0 ** 8)
        self.x = torch.randn(64, 16).to(amp.device)
        self.watch = None
        if watched:
            from ampwatch import agent
            self.watch = agent.watch(self.scaler, self.optimizers, model=self.model, collector=(),
                                     run="bench-gpu-clean")

    def run(self, n: int) -> None:
        """Run ``n`` clean iterations (asking ``stepped()`` after each step only when built with ``ask``)."""
        for _ in range(n):
            for opt in self.optimizers.values():
                opt.zero_grad()
            with self.amp.autocast():
                loss = self.model(self.x).float().pow(2).mean()
            self.scaler.scale(loss).backward()
            for opt in self.optimizers.values():
                self.scaler.step(opt)
                if self.ask:
                    self.watch.stepped(opt)
            self.scaler.update()

    def close(self) -> dict | None:
        """Close the watch (if any) and return its final counters."""
        if self.watch is None:
            return None
        self.watch.close()
        return self.watch.snapshot()["state"]
