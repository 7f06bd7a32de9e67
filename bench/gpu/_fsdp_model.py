"""The small sharded model and its inputs that ``bench.gpu.fsdp`` and its framework runs share."""

from __future__ import annotations

import torch
from torch import nn

from bench.gpu._amp import params_of

__all__ = ["FED_AT", "STEPS", "local", "micro_batch", "sequential", "shards"]

STEPS = 8
FED_AT = 2  # the last rank's first micro-batch holds an inf


def sequential() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard: a DTensor's local tensor (FSDP2), else the tensor itself (FSDP1's flat or view shards)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shards(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    with torch.no_grad():
        return [local(p) for p in params_of(opt)]


def micro_batch(rank: int, step: int, micro: int, device: torch.device, fed: bool) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))
    if fed:
        x[0, 0] = float("inf")
    return x.to(device)
