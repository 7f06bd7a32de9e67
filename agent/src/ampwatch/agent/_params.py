"""Name an optimizer's parameters and find the ones holding inf/NaN, in one host copy."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from ._device import nonfinite_counts

__all__ = ["MAX_NAMED_PARAMS", "NonfiniteReport", "ParameterNames", "scan_optimizers"]

MAX_NAMED_PARAMS = 16
"""At most this many offending parameters are named per event (protocol: ``params``, at most 16)."""


class ParameterNames:
    """Map parameters to readable names: the model's names when known, else their optimizer position."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        self._by_id: dict[int, str] = {}
        for name, param in named_parameters:
            self._by_id.setdefault(id(param), name)

    def name(self, param: torch.Tensor, group: int, index: int) -> str:
        """Return the model's name of ``param``, else ``param_groups[group][index] [shape]``."""
        known = self._by_id.get(id(param))
        if known is not None:
            return known
        return f"param_groups[{group}][{index}] {list(param.shape)}"


@dataclasses.dataclass(slots=True)
class NonfiniteReport:
    """Which parameters of one optimizer hold non-finite values (gradients or weights)."""

    params: list[dict[str, object]]
    """Up to :data:`MAX_NAMED_PARAMS` entries ``{"name", "inf", "nan"}`` in optimizer order."""
    total: int
    """How many parameters hold at least one inf or NaN."""


def _report(named: list[tuple[str, tuple[int, int]]]) -> NonfiniteReport:
    bad = [(name, n_inf, n_nan) for name, (n_inf, n_nan) in named if n_inf or n_nan]
    return NonfiniteReport(
        params=[{"name": n, "inf": i, "nan": m} for n, i, m in bad[:MAX_NAMED_PARAMS]], total=len(bad))


def scan_optimizers(optimizers: Sequence[torch.optim.Optimizer], names: ParameterNames, *,
                    grads: bool = True, weights: bool = False,
                    ) -> list[tuple[NonfiniteReport | None, NonfiniteReport | None]]:
    """Report non-finite gradients and/or weights of each optimizer, with one host copy per device.

    Returns one ``(grad_report, weight_report)`` pair per optimizer; an entry is
    None when it was not asked for.
    """
    labels: list[str] = []
    tensors: list[torch.Tensor | None] = []
    spans: list[tuple[int, int]] = []
    for optimizer in optimizers:
        start = len(labels)
        for g, group in enumerate(optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                labels.append(names.name(param, g, j))
                tensors.append(param.grad if grads else None)
                tensors.append(param if weights else None)
        spans.append((start, len(labels)))
    counts = nonfinite_counts(tensors)
    grad_counts, weight_counts = counts[0::2], counts[1::2]
    result = []
    for start, end in spans:
        span = list(range(start, end))
        result.append((
            _report([(labels[i], grad_counts[i]) for i in span]) if grads else None,
            _report([(labels[i], weight_counts[i]) for i in span]) if weights else None,
        ))
    return result
