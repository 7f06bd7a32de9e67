"""Name an optimizer's parameters and find the ones holding inf/NaN: a batched check, then exact counts of a few."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from ampwatch.contract.batch import ParamCount

from ._device import nonfinite_counts, nonfinite_indices
from ._shards import is_sharded, local, shard_text

__all__ = ["MAX_NAMED_PARAMS", "NonfiniteReport", "ParameterNames", "Part", "scan_optimizers"]

MAX_NAMED_PARAMS = 16
"""At most this many offending parameters are named per event (protocol: ``params``, at most 16)."""


class ParameterNames:
    """Map parameters to readable names: the model's names when known, else their optimizer position."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self._by_id: dict[int, str] = {}
        for name, param in named_parameters:
            self._by_id.setdefault(id(param), name)

    def known(self, param: torch.Tensor) -> str | None:
        """Return the model's name of ``param``, or None when the model did not name it."""
        return self._by_id.get(id(param))

    def name(self, param: torch.Tensor, group: int, index: int) -> str:
        """Return the model's name of ``param``, else ``param_groups[group][index] [shape]``.

        A sharded parameter (FSDP2) is named with the slice of it this rank holds:
        ``"layers.0.weight shard [8:16, 0:8]"``.
        """
        known = self._by_id.get(id(param))
        name = known if known is not None else f"param_groups[{group}][{index}] {list(param.shape)}"
        if is_sharded(param):
            where = shard_text(param)
            if where is not None:
                name = f"{name} shard {where}"
        return name


@dataclasses.dataclass(slots=True)
class NonfiniteReport:
    """Which parameters of one optimizer hold non-finite values (gradients or weights)."""

    params: list[ParamCount]
    """Up to :data:`MAX_NAMED_PARAMS` entries ``{"name", "inf", "nan"}`` in optimizer order."""
    total: int
    """How many parameters hold at least one inf or NaN (named or not)."""
    flagged: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """All of those parameters (named or not), in optimizer order."""


Part = Literal["grads", "weights"]
"""What of an optimizer's parameters a scan looks at: their gradients or their values."""


def scan_optimizers(targets: Sequence[tuple[torch.optim.Optimizer, Part]], names: ParameterNames,
                    unnamed: Sequence[bool] = ()) -> list[NonfiniteReport]:
    """Report which gradients or weights hold inf/NaN, for each ``(optimizer, part)`` target, in order.

    Two stages over all targets at once: stage 1 flags every tensor holding inf/NaN (one batched
    reduction per device and dtype, one host copy per device); stage 2 counts inf and NaN exactly in the
    first :data:`MAX_NAMED_PARAMS` flagged tensors of each target, in optimizer order (one more small
    copy per device, only when something was flagged). Only those are named; ``total`` counts all flagged.
    Sharded tensors (FSDP2) are looked at in this rank's shard, with no communication. A target whose
    ``unnamed`` entry is true is flagged only (``params`` empty: stage 2 skips it).
    """
    tensors: list[torch.Tensor | None] = []
    spans: list[tuple[int, list[torch.Tensor], list[int]]] = []  # (first position, params, group starts)
    for optimizer, part in targets:
        params: list[torch.Tensor] = []
        group_starts: list[int] = []
        for group in optimizer.param_groups:
            group_starts.append(len(params))
            params.extend(group["params"])
        spans.append((len(tensors), params, group_starts))
        with torch.no_grad():  # a sharded tensor is looked at in this rank's shard only (no communication)
            tensors.extend([None if t is None else local(t)
                            for t in ([p.grad for p in params] if part == "grads" else params)])
    flagged = nonfinite_indices(tensors)
    per_target = []
    for start, params, _ in spans:
        lo, hi = bisect.bisect_left(flagged, start), bisect.bisect_left(flagged, start + len(params))
        per_target.append(flagged[lo:hi])
    limits = [0 if k < len(unnamed) and unnamed[k] else MAX_NAMED_PARAMS for k in range(len(targets))]
    named = [position for positions, limit in zip(per_target, limits, strict=True) for position in positions[:limit]]
    counts = dict(zip(named, nonfinite_counts([tensors[p] for p in named]), strict=True))
    reports = []
    for (start, params, group_starts), positions, limit in zip(spans, per_target, limits, strict=True):
        entries: list[ParamCount] = []
        for position in positions[:limit]:
            index = position - start
            slot = bisect.bisect_right(group_starts, index) - 1
            n_inf, n_nan = counts[position]
            entries.append({"name": names.name(params[index], slot, index - group_starts[slot]),
                            "inf": n_inf, "nan": n_nan})
        reports.append(NonfiniteReport(params=entries, total=len(positions),
                                       flagged=[params[position - start] for position in positions]))
    return reports
