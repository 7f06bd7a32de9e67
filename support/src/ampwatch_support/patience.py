"""How long a test waits for something before it calls it a hang: one place, one factor.

A test waits on a condition, never for a fixed time, and its deadline detects a hang: it is not a
speed test. A loaded machine (CI shares its cores; the suite must pass beside two `yes > /dev/null`)
may only make a test slower, never fail it. The deadlines below are generous for that; on a machine
slower still, set ``AMPWATCH_TEST_SLOWDOWN`` (e.g. ``3``) and every deadline here, and each test's
pytest timeout (the repository's conftest.py), grows by that factor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SETTLE_S", "SLOWDOWN", "START_S", "patience", "wait_until"]

T = TypeVar("T")

SLOWDOWN = max(1.0, float(os.environ.get("AMPWATCH_TEST_SLOWDOWN") or 1))
"""How much slower than a loaded CI machine this one may be (``AMPWATCH_TEST_SLOWDOWN``, at least 1)."""


def patience(seconds: float) -> float:
    """Return ``seconds`` stretched by :data:`SLOWDOWN`: the deadline for what a loaded machine does in that time."""
    return seconds * SLOWDOWN


START_S = patience(120.0)
"""A process gets going: a collector answers /readyz, ranks import torch and report, Prometheus scrapes."""

SETTLE_S = patience(30.0)
"""A running process does what it does within moments: a batch arrives, a retry goes, a relay takes over."""


def wait_until(predicate: Callable[[], T], timeout: float = SETTLE_S,
               what: str | Callable[[], str] = "the condition", every: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true, and return that; AssertionError after ``timeout`` s.

    ``what`` (or what it returns, computed only on failure) says what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(every)


def _scaled_timeouts(items: list[Any], default: float | None) -> None:
    """Stretch each test's pytest timeout (its marker's, else ``default``) by :data:`SLOWDOWN`."""
    import pytest

    if SLOWDOWN == 1:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = marker.args[0] if marker is not None and marker.args else default
        if seconds:
            item.add_marker(pytest.mark.timeout(seconds * SLOWDOWN), append=False)  # the closest one counts
