"""Non-finite floats at the collector's edges: the protocol's JSON strings, the exposition, PromQL's arithmetic.

A GradScaler's float32 scale can be 0.0, subnormal, infinite or NaN. JSON has no
NaN or infinity, Prometheus writes them ``NaN``/``+Inf``, and PromQL's ``min``,
``max`` and ``/`` treat them as Go does, not as Python does (``min([nan, 1])``
depends on the order; ``1 / 0`` raises). The built-in alerts and the per-run
series use these helpers so that they agree with the Prometheus rules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["NONFINITE_STRINGS", "wire_float", "exposition_float", "promql_min", "promql_max", "promql_divide"]

NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""How the protocol writes non-finite floats in JSON (as Protocol Buffers' JSON mapping does)."""


def wire_float(value: float | None) -> float | str | None:
    """Return ``value`` as the protocol writes it in JSON: NaN and infinities as strings, else unchanged."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def exposition_float(value: float) -> str:
    """Return ``value`` as the Prometheus text format writes it: ``NaN``, ``+Inf``, ``-Inf``, else ``repr``."""
    if math.isfinite(value):
        return repr(value)
    return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")


def promql_min(values: Iterable[float]) -> float:
    """Return PromQL's ``min``: NaN only when every value is NaN (``values`` must not be empty)."""
    values = list(values)
    numbers = [v for v in values if v == v]
    return min(numbers) if numbers else values[0]


def promql_max(values: Iterable[float]) -> float:
    """Return PromQL's ``max``: NaN only when every value is NaN (``values`` must not be empty)."""
    values = list(values)
    numbers = [v for v in values if v == v]
    return max(numbers) if numbers else values[0]


def promql_divide(a: float, b: float) -> float:
    """Return ``a / b`` as PromQL (IEEE 754) computes it: ``x / 0`` is +-Inf, ``0 / 0`` and ``Inf / Inf`` NaN."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
