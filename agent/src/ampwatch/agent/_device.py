"""The one place that touches private GradScaler attributes and reads device values.

Everything here is feature-detected: when a private attribute disappears in a
future torch release, the agent falls back to public API (at the cost of a
device sync at rare moments) instead of breaking.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = [
    "PendingRead",
    "fused_found_inf",
    "found_inf_from_scaler",
    "growth_tracker",
    "has_step_hooks",
    "host_scalar",
    "init_scale",
    "nonfinite_counts",
    "read_later",
    "scale_tensor",
    "steps_with_amp_scaling",
]


def steps_with_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Tell whether the scaler calls ``optimizer.step()`` even on a skip (fused / AMP-aware optimizers)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Tell whether ``optimizer`` can take step hooks (its ``Optimizer.__init__`` ran; wrappers may skip it)."""
    return isinstance(getattr(optimizer, "_optimizer_step_pre_hooks", None), dict)


def fused_found_inf(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Return the ``found_inf`` tensor the scaler hands an AMP-aware optimizer, or None.

    It exists only during the ``optimizer.step()`` call made by ``scaler.step``,
    so this must be called from a step pre-hook.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf if isinstance(found_inf, torch.Tensor) else None


def found_inf_from_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """Return the summed per-device ``found_inf`` the scaler recorded for ``optimizer``, or None."""
    # Only used for optimizers on the deprecated ``grad_scaler=`` step contract,
    # which get no ``found_inf`` attribute.
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return None
    per_device = states.get(id(optimizer), {}).get("found_inf_per_device") or {}
    tensors = [t for t in per_device.values() if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    return torch.stack([t.to(tensors[0].device).reshape(()) for t in tensors]).sum()


def scale_tensor(scaler: Any) -> torch.Tensor | None:
    """Return the scaler's live scale tensor (no sync), or None when absent or not yet created."""
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def growth_tracker(scaler: Any) -> int:
    """Return how many clean iterations the scaler has counted toward its next growth (0 when unknown).

    Reads the live tracker (one sync on a GPU): call it at ``watch()``/``rebind()`` only.
    """
    live = getattr(scaler, "_growth_tracker", None)
    if isinstance(live, torch.Tensor):
        return int(read_later(live).wait()[0])
    value = getattr(scaler, "_init_growth_tracker", 0)
    return value if isinstance(value, int) else 0


def init_scale(scaler: Any) -> float:
    """Return the scale the scaler starts from (``init_scale``)."""
    value = getattr(scaler, "_init_scale", None)
    if isinstance(value, (int, float)):
        return float(value)
    return float(scaler.get_scale())  # public fallback; one sync, only at watch() time


class PendingRead:
    """A device value on its way to the host; read it once :meth:`done` says so.

    CPU tensors are read at once (no sync). CUDA tensors are copied without
    blocking into pinned host memory and an event marks when the copy landed.
    Other devices have no such path here: the value is read by :meth:`wait`,
    which synchronises, so callers only ask for those at rare moments.
    """

    __slots__ = ("_value", "_host", "_event", "_source")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._value: list[float] | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._source: torch.Tensor | None = None
        device = tensor.device.type
        if device == "cpu":
            # tolist() on a CPU tensor does not go through aten._local_scalar_dense (and needs no detach).
            value = tensor.tolist() if tensor.dim() < 2 else tensor.reshape(-1).tolist()
            self._value = value if isinstance(value, list) else [value]
            return
        tensor = tensor.detach()
        if device == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            # Keep a copy so later in-place updates (e.g. of the scale) do not change what we read.
            self._source = tensor.clone()

    def done(self) -> bool:
        """Tell, without blocking, whether :meth:`value` can be read without a sync."""
        if self._value is not None:
            return True
        return self._event is not None and bool(self._event.query())

    def wait(self) -> list[float]:
        """Return the value, synchronising with the device if it has not arrived yet."""
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
                self._value = self._host.reshape(-1).tolist()
            else:
                self._value = self._source.cpu().reshape(-1).tolist()
            self._host = self._event = self._source = None
        return self._value


def host_scalar(tensor: torch.Tensor) -> float:
    """Return the first element of a CPU tensor (no ``aten._local_scalar_dense``, so no sync)."""
    value = tensor.tolist()
    while isinstance(value, list):
        value = value[0]
    return float(value)


def read_later(tensor: torch.Tensor) -> PendingRead:
    """Start moving ``tensor`` to the host without a sync where the device allows it."""
    return PendingRead(tensor)


def _plain(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce()._values() if grad.is_sparse else grad


def nonfinite_counts(tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int]]:
    """Count inf and NaN elements of each tensor (None counts as zero) with one host copy per device."""
    counts: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None and t.numel() and (t.is_floating_point() or t.is_complex()):
            by_device.setdefault(t.device, []).append(i)
    with torch.no_grad():
        for device, indices in by_device.items():
            parts = []
            for i in indices:
                t = _plain(tensors[i].detach())
                parts.append(torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]))
            # One device-to-host copy for all parameters on this device.
            rows = torch.stack(parts).cpu().tolist()
            for i, (n_inf, n_nan) in zip(indices, rows):
                counts[i] = (int(n_inf), int(n_nan))
    return counts
