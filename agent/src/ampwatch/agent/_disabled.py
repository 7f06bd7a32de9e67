"""What ``watch()`` returns under ``AMPWATCH_DISABLED=1``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DisabledWatch"]


class DisabledWatch:
    """What ``watch()`` returns under ``AMPWATCH_DISABLED=1``: records nothing, patches nothing."""

    closed = False

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """Return None: nothing is recorded."""
        return None

    def batch(self, ids: Any) -> None:
        """Do nothing: nothing is recorded."""

    def loss(self, loss: torch.Tensor | float) -> None:
        """Do nothing."""

    def grad_norm(self, total_norm: torch.Tensor | float, optimizer: Any = None) -> None:
        """Do nothing."""

    def snapshot(self) -> dict[str, Any]:
        """Return an empty snapshot."""
        return {"scaler": {}, "state": {}}

    def summary(self) -> str:
        """Say that the agent is disabled."""
        return "ampwatch agent disabled (AMPWATCH_DISABLED)"

    def close(self, timeout: float | None = None) -> None:
        """Do nothing."""

    def __enter__(self) -> DisabledWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
