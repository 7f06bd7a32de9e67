"""The spike rule for one watched signal (the loss, a gradient norm): a rolling window, a z-score, streak rungs.

One :class:`SpikeSeries` per series: the loss of a rank, the gradient norm of an optimizer, with ``ddp=`` the
rank's own gradient norm before DDP's all-reduce. It is fed one value per iteration (:meth:`SpikeSeries.observe`)
and judges it by the rule of docs/agent.md, "Spikes" (W: the window, S: the sigma):

== ========================================================= ================ =================
#  the iteration's value v                                    spike?           into the window?
== ========================================================= ================ =================
1  None (no value this iteration)                             no; ends a streak no
2  non-finite                                                 yes, z None      no
3  finite, the window holds < W finite values                 no               yes
4  finite, window full, z = (v - mean) / std >= S             yes              as mean + S x std
5  finite, window full, below that (any v below the mean)     no               yes (oldest leaves)
6  a spike in the iteration right after a spiking one         yes, streak + 1
7  spikes at streak positions 1, 2, 4, 8, ...                 sent as events
8  spikes between those rungs                                 counted only
== ========================================================= ================ =================

``std`` is the window's population standard deviation, floored at ``1e-6 x |mean|`` and ``1e-12`` so a constant
series does not spike at every rounding. Pure Python, O(1) per value: running sums over a ring buffer, taken
relative to a shift (the mean at the last exact recompute, so a large mean does not cancel a small spread), and
recomputed exactly once per W values so float drift cannot build up.
"""

from __future__ import annotations

import dataclasses
import math

from ampwatch.contract.batch import SignalLevel
from ampwatch.contract.protocol import is_rung

__all__ = ["Spike", "SpikeSeries", "rounded"]

_RELATIVE_FLOOR = 1e-6
_ABSOLUTE_FLOOR = 1e-12


@dataclasses.dataclass(frozen=True, slots=True)
class Spike:
    """One spiking value, as an event reports it."""

    value: float
    """The iteration's value (may be inf or NaN)."""
    mean: float | None
    """The window's mean before this value (None: the window held no finite value)."""
    std: float | None
    """The window's (floored) standard deviation before this value (None: empty window)."""
    z: float | None
    """``(value - mean) / std``; None for a non-finite value."""
    streak: int
    """Its position in the series' run of spikes in consecutive iterations (1 = first)."""

    @property
    def rung(self) -> bool:
        """Whether it is sent as an event (streak positions 1, 2, 4, 8, ...); the others are only counted."""
        return is_rung(self.streak)

    def fields(self) -> dict[str, float | int | None]:
        """The event fields it gives: ``value``, ``mean``, ``std``, ``z``, ``streak``."""
        return {"value": self.value, "mean": self.mean, "std": self.std, "z": self.z, "streak": self.streak}


class SpikeSeries:
    """The rolling window of one signal and its spike rule (module docstring's table).

    >>> series = SpikeSeries(window=4, sigma=3.0)
    >>> [series.observe(v) for v in (1.0, 1.1, 0.9, 1.0)]
    [None, None, None, None]
    >>> series.observe(9.0).z > 3.0, series.spikes, series.observe(1.0), series.level()
    (True, 1, None, {'mean': 1.028, 'std': 0.1139})
    >>> series.observe(float("nan")).streak, series.observe(float("inf")).streak, series.spikes
    (1, 2, 3)
    """

    __slots__ = ("window", "sigma", "spikes", "streak", "_ring", "_next", "_sums", "_since_exact")

    def __init__(self, window: int, sigma: float) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"the spike window must be a whole number of iterations >= 2, got {window!r}")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (0 < sigma < math.inf):
            raise ValueError(f"the spike sigma must be a number > 0, got {sigma!r}")
        self.window = window
        self.sigma = float(sigma)
        self.spikes = 0
        """Spikes judged so far (every one, sent or not)."""
        self.streak = 0
        """The current run of consecutive spiking iterations (0: the last iteration did not spike)."""
        self._ring = [0.0] * window
        self._next = 0  # where the next value goes (the oldest, once full)
        # (finite values in the window, shift, sum and sum of squares of (value - shift)): one tuple, replaced
        # whole, so the sender thread's level() never reads a half-updated window.
        self._sums = (0, 0.0, 0.0, 0.0)
        self._since_exact = 0  # values added since the sums were last recomputed exactly

    def observe(self, value: float | None) -> Spike | None:
        """Judge one iteration's ``value`` (None: none this iteration) and return its :class:`Spike`, or None."""
        if value is None:
            self.streak = 0
            return None
        value = float(value)
        if not math.isfinite(value):
            mean, std = self._moments()
            return self._spike(value, mean, std, None)
        spike, entered = None, value
        if self._sums[0] == self.window:
            mean, std = self._moments()
            z = (value - mean) / std  # type: ignore[operator] # a full window has both
            if z >= self.sigma:
                spike = self._spike(value, mean, std, z)
                entered = mean + self.sigma * std  # type: ignore[operator] # clipped: one spike cannot hide the next
        if spike is None:
            self.streak = 0
        self._add(entered)
        return spike

    def z(self, value: float) -> float | None:
        """The z-score ``value`` would have against the window now (what :meth:`observe` compares with the sigma);
        None while the window is not full, or for a non-finite value. Judges nothing, changes nothing."""
        value = float(value)
        if self._sums[0] < self.window or not math.isfinite(value):
            return None
        mean, std = self._moments()
        return (value - mean) / std  # type: ignore[operator] # a full window has both

    def level(self) -> SignalLevel | None:
        """The window's mean and (unfloored) standard deviation, 4 significant digits; None below two values."""
        sums = self._sums
        if sums[0] < 2:
            return None
        mean, variance = _mean_variance(sums)
        return {"mean": rounded(mean), "std": rounded(math.sqrt(variance))}

    def __len__(self) -> int:
        """Finite values in the window."""
        return self._sums[0]

    def _spike(self, value: float, mean: float | None, std: float | None, z: float | None) -> Spike:
        self.spikes += 1
        self.streak += 1
        return Spike(value=value, mean=mean, std=std, z=z, streak=self.streak)

    def _moments(self) -> tuple[float | None, float | None]:
        """The window's mean and floored standard deviation (None, None: empty)."""
        sums = self._sums
        if not sums[0]:
            return None, None
        mean, variance = _mean_variance(sums)
        return mean, max(math.sqrt(variance), _RELATIVE_FLOOR * abs(mean), _ABSOLUTE_FLOOR)

    def _add(self, value: float) -> None:
        ring, slot = self._ring, self._next
        count, shift, total, squares = self._sums
        if count == self.window:
            old = ring[slot] - shift
            total -= old
            squares -= old * old
        else:
            count += 1
        ring[slot] = value
        self._next = (slot + 1) % self.window
        delta = value - shift
        self._sums = (count, shift, total + delta, squares + delta * delta)
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._recompute()

    def _recompute(self) -> None:
        """Recompute the sums exactly, shifted by the window's mean (amortised: once per ``window`` values)."""
        count = self._sums[0]
        values = self._ring if count == self.window else self._ring[:count]
        shift = math.fsum(values) / count
        deltas = [v - shift for v in values]
        self._sums = (count, shift, math.fsum(deltas), math.fsum(d * d for d in deltas))
        self._since_exact = 0


def _mean_variance(sums: tuple[int, float, float, float]) -> tuple[float, float]:
    count, shift, total, squares = sums
    offset = total / count
    return shift + offset, max(squares / count - offset * offset, 0.0)


def rounded(value: float) -> float:
    """``value`` to 4 significant digits (what a level sends: its bytes, not its precision, matter).

    >>> rounded(3.14159), rounded(123456.0), rounded(0.000123456)
    (3.142, 123500.0, 0.0001235)
    """
    return float(f"{value:.4g}")
