"""Counting host-device syncs: what the agent must not add to a clean iteration.

The agent's tests, the overhead benchmarks and the GPU check (``bench.gpu``) count with this one counter.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter"]


class SyncCounter(TorchDispatchMode):
    """Count ``aten._local_scalar_dense`` calls (a host-device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))
