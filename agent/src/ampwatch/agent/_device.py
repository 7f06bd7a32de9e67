"""The one place that touches private GradScaler attributes and reads device values.

Everything here is feature-detected: when a private attribute disappears in a
future torch release, the agent falls back to public API (at the cost of a
device sync at rare moments) instead of breaking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "PendingRead",
    "ddp_ignored_names",
    "fused_found_inf",
    "found_inf_from_scaler",
    "growth_tracker",
    "has_step_hooks",
    "host_scalar",
    "init_scale",
    "max_abs",
    "nonfinite_counts",
    "nonfinite_indices",
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


def ddp_ignored_names(model: Any) -> frozenset[str]:
    """Return the names (in ``model.module``) of the parameters the DDP ``model`` leaves out of its reduction.

    DDP's ``parameters_to_ignore`` (set at construction from what
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` put on the module); falls back to
    that module attribute itself, then to none. No device read.
    """
    ignored = getattr(model, "parameters_to_ignore", None)
    if ignored is None:
        ignored = getattr(getattr(model, "module", None), "_ddp_params_and_buffers_to_ignore", None)
    return frozenset(name for name in ignored or () if isinstance(name, str))


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
                self._value = self._host.reshape(-1).tolist()  # type: ignore[union-attr] # set with the event
            else:
                self._value = self._source.cpu().reshape(-1).tolist()  # type: ignore[union-attr] # read once
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


# ----- non-finite scan: which tensors hold inf/NaN (stage 1), and how many (stage 2) -------------

_foreach_norm = getattr(torch, "_foreach_norm", None)  # private; absent: the public per-tensor path
_INF = float("inf")

CPU_STACK_MAX_NUMEL = 4096
"""On CPU, tensors up to this many elements are checked in stacks of one shape (a ``torch.stack`` copy,
then row-wise ``amax`` and ``amin``: about 0.2-2 us per tensor), larger ones by one ``torch.aminmax``
each (one vectorised pass plus about 2 us of call overhead). ``_foreach_norm`` is not used on CPU:
there it loops over the infinity-norm kernel of ``torch.linalg.vector_norm``, which is not vectorised
(about 20x slower per element than ``aminmax``), with a tensor allocated per input."""

_STACK_MAX_ELEMENTS = 1 << 20  # a stack copies at most this many elements at once (4 MiB of float32)

_PLAIN_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


def _values(tensor: torch.Tensor) -> torch.Tensor | None:
    """Return a strided floating tensor holding exactly ``tensor``'s values, or None (nothing to check).

    Sparse tensors give their values (an uncoalesced one is coalesced first, which on a GPU costs a sync
    of its own); 8-bit floats are widened (no reduction kernel takes them). Call under ``no_grad``.
    """
    if tensor.is_sparse:
        tensor = tensor.coalesce()._values()
    elif tensor.layout != torch.strided:
        tensor = tensor.values()
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    return tensor.float() if tensor.element_size() == 1 else tensor


def _flags_batched(values: list[torch.Tensor]) -> torch.Tensor:
    """Flag the tensors holding inf/NaN with one ``_foreach_norm(ord=inf)`` call (private op; one dtype).

    max |x| is inf or NaN exactly when x holds an inf or a NaN: the norm propagates NaN, on CPU and in
    the CUDA kernel alike (real tensors only: a complex |x| could overflow). On CUDA this is a few
    fused kernel launches for all the tensors, about the cost of the scaler's own check, and no sync.
    """
    return ~torch.isfinite(torch.stack(_foreach_norm(values, ord=float("inf"))))  # type: ignore[misc] # present here


def _flags_per_tensor(values: list[torch.Tensor]) -> torch.Tensor:
    """Flag the tensors holding inf/NaN with one public ``torch.aminmax`` per tensor (a kernel each, no sync).

    The minimum or maximum is non-finite exactly when the tensor holds an inf or a NaN (aminmax
    propagates NaN).
    """
    extremes = [torch.aminmax(v) for v in values]
    stacked = torch.stack([e.min for e in extremes] + [e.max for e in extremes]).view(2, -1)
    return (~torch.isfinite(stacked)).any(0)


def _flags_stacked(values: list[torch.Tensor]) -> torch.Tensor:
    """Flag the tensors holding inf/NaN, all of one shape, by rows of stacked copies (public ops, no sync).

    A row's max or min is non-finite exactly when the row holds an inf or a NaN (both propagate NaN).
    Copies at most ``_STACK_MAX_ELEMENTS`` elements at a time.
    """
    rows = max(1, _STACK_MAX_ELEMENTS // values[0].numel())
    parts = []
    for start in range(0, len(values), rows):
        chunk = values[start:start + rows]
        stacked = torch.stack(chunk).view(len(chunk), -1)
        parts.append(~(torch.isfinite(stacked.amax(dim=1)) & torch.isfinite(stacked.amin(dim=1))))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _flags(device: torch.device, stackable: bool, values: list[torch.Tensor]) -> torch.Tensor:
    """Flag the tensors of one group (one device and dtype; one shape when ``stackable``)."""
    if stackable:
        return _flags_stacked(values)
    if device.type != "cpu" and _foreach_norm is not None:
        try:
            return _flags_batched(values)
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # no such kernel for this device or dtype: the public path
    return _flags_per_tensor(values)


def nonfinite_indices(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """Return, in order, the positions of the tensors that hold at least one inf or NaN (None holds none).

    Stage 1 of a scan. Cost: one pass over every tensor, batched per (device, dtype): on a GPU one
    ``_foreach_norm`` call, on CPU stacks of small tensors and one ``aminmax`` per larger one (see
    :data:`CPU_STACK_MAX_NUMEL`); then ONE device-to-host copy per device, of one flag per tensor on it.
    Nothing else waits for the device. Python work: a few attribute reads per tensor.
    """
    groups: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}
    strided, plain, small = torch.strided, _PLAIN_DTYPES, CPU_STACK_MAX_NUMEL
    last_key: tuple | None = None
    positions: list[int] = []
    members: list[torch.Tensor] = []
    with torch.no_grad():
        for position, tensor in enumerate(tensors):
            if tensor is None:
                continue
            if tensor.layout is not strided or tensor.dtype not in plain:
                tensor = _values(tensor)
                if tensor is None:
                    continue
                if tensor.is_complex():
                    tensor = torch.view_as_real(tensor.resolve_conj())
            numel = tensor.numel()
            if not numel:
                continue
            device = tensor.device
            # Group: device and dtype; on CPU, small tensors also by shape, to be stacked.
            key = (device, tensor.dtype, tensor.shape if numel <= small and device.type == "cpu" else None)
            if key != last_key:  # neighbours mostly share a group: skip the dict lookup
                last_key = key
                positions, members = groups.setdefault(key, ([], []))
            positions.append(position)
            members.append(tensor)
        per_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for (device, _, shape), (positions, members) in groups.items():
            order, parts = per_device.setdefault(device, ([], []))
            order.extend(positions)
            parts.append(_flags(device, shape is not None, members))
        flagged: list[int] = []
        for order, parts in per_device.values():
            # The one copy for this device: a bool per tensor, read with tolist (no scalar reads).
            host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().tolist()
            flagged.extend(position for position, bad in zip(order, host, strict=True) if bad)
    flagged.sort()
    return flagged


def nonfinite_counts(tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int]]:
    """Count the inf and NaN elements of each tensor (None counts as zero), with one host copy per device.

    Stage 2 of a scan, for the few tensors stage 1 flagged: two passes over each tensor (about 1 ns per
    element on a CPU core), so callers bound how many they pass (at most ``MAX_NAMED_PARAMS``).
    """
    counts: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for position, tensor in enumerate(tensors):
            values = None if tensor is None else _values(tensor)
            if values is None or not values.numel():
                continue
            positions, parts = by_device.setdefault(values.device, ([], []))
            positions.append(position)
            parts.append(torch.stack([torch.count_nonzero(torch.isinf(values)),
                                      torch.count_nonzero(torch.isnan(values))]))
        for positions, parts in by_device.values():
            rows = torch.stack(parts).cpu().tolist()  # one device-to-host copy for this device
            for position, (n_inf, n_nan) in zip(positions, rows, strict=True):
                counts[position] = (int(n_inf), int(n_nan))
    return counts


def max_abs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return max |x| of each tensor, stacked in one tensor on their device (inf or NaN where x held any); no sync.

    One ``_foreach_norm(ord=inf)`` call (private op; NaN propagates; on a GPU a few fused kernel launches for
    all the tensors) and one ``stack``. The tensors must be real, strided and on one device; raises
    RuntimeError, TypeError or NotImplementedError otherwise, or when the op is missing.
    """
    if _foreach_norm is None:
        raise NotImplementedError("torch._foreach_norm is missing")
    with torch.no_grad():
        return torch.stack(_foreach_norm(tensors, ord=_INF))
