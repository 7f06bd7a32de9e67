"""Thresholds and windows of every ampwatch alert, as plain data, and their named profiles.

The single source of truth for alert thresholds: the Prometheus rules in
``dashboards/generated/`` are generated from :data:`DEFAULT_THRESHOLDS`, and the
collector's built-in evaluator reads the same values (or a profile, or a JSON
file of overrides: ``--alert-thresholds``).

Durations are whole seconds (``*_s``) so that Python code can use them
directly; :func:`promql_duration` renders them for PromQL and the alert texts.

Example::

    from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS, AlertThresholds
    strict = AlertThresholds(skip_streak_warning=8, skip_streak_window_s=300)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .protocol import HEARTBEAT_INTERVAL_S, STREAK_LADDER

__all__ = ["AlertThresholds", "DEFAULT_THRESHOLDS", "DEMO_THRESHOLDS", "PROFILES", "promql_duration"]


@dataclass(frozen=True)
class AlertThresholds:
    """Hold the thresholds and windows of the ampwatch alerts (each field checked against its limits on creation)."""

    calibration_iterations: int = 100
    """Iterations at the start of a rank during which loss-scale backoffs are the
    normal calibration of a dynamic scale (init 2**16: a model whose gradients
    overflow at that scale backs off several times in its first iterations) and
    never count as sustained backoff."""

    skip_streak_warning: int = 16
    """Consecutive skipped steps of one optimizer that raise a warning. 16 because a
    start-up calibration from the default init_scale 2**16 that does not end in a
    collapse (scale < 1, its own alert) skips fewer than 16 times in a row.
    Must be on STREAK_LADDER."""

    skip_streak_critical: int = 64
    """Consecutive skipped steps of one optimizer that raise a critical alert: the
    model has made no update for this many iterations. Must be on STREAK_LADDER
    and above skip_streak_warning."""

    storm_rank_share: float = 0.5
    """Share of a run's ranks (and at least two) that hold a per-rank alert at a severity (a skip streak, a high
    skip ratio, a collapsed scale) at or above which the run has one run-wide alert of that severity instead of an
    alert per rank: DDP ranks skip, back off and collapse together."""

    storm_edge_for_s: int = 30
    """How long a per-rank alert that a run-wide one speaks for waits at the edges of a whole-job event. In
    Prometheus it is its ``for:`` (its own when longer): a scrape that lands between the ranks' batches at the
    event's start or end shows part of the job in trouble for an evaluation or two, and the rank-by-rank alerts
    of that moment never fire. Keep it at least twice the evaluation interval. In the collector, a per-rank alert
    the run-wide one held back waits this long after it last did (its batches are seen as they arrive)."""

    skip_streak_window_s: int = 600
    """How long a streak that reached a threshold keeps the alert firing, so that a
    streak that began and ended between two scrapes is still reported."""

    backoff_window_s: int = 900
    """Window over which backoffs and growths of each rank are counted for
    sustained backoff."""

    backoff_min_count: int = 3
    """Backoffs of one rank within backoff_window_s (and no growth) that make the
    rank count as backing off repeatedly."""

    backoff_rank_share: float = 0.5
    """Share of a run's open ranks that must be backing off repeatedly for the
    run to alert; 0.5 keeps a single bad rank of a large job from paging
    (DDP ranks see the same all-reduced gradients and back off together)."""

    backoff_for_s: int = 120
    """How long sustained backoff must hold before the alert fires."""

    collapsed_loss_scale: float = 1.0
    """A loss scale below this means the scale has collapsed: gradients are not
    scaled up any more and AMP is fighting a real numerical problem."""

    collapsed_for_s: int = 30
    """How long a collapsed scale must last before the alert fires: a collapse of a minute fires in Prometheus
    too, where a 15 s scrape and evaluation see it held for 45 s at least."""

    desync_scale_ratio: float = 2.0
    """Largest / smallest loss scale across the open ranks of one run at or above
    which the ranks disagree (2.0 = one backoff apart)."""

    desync_for_s: int = 300
    """How long ranks must disagree before the alert fires; the agent reads the
    scale without a device sync, so ranks may differ for an iteration."""

    skip_ratio: float = 0.1
    """Share of scaler.step() calls of one optimizer that were skipped, over
    skip_ratio_window_s, at or above which the alert fires."""

    skip_ratio_window_s: int = 1800
    """Window of the skipped-step ratio."""

    skip_ratio_min_steps: int = 200
    """scaler.step() calls in the window below which the ratio is not judged: one
    isolated skip in a handful of steps is not a high ratio, and a calibration
    (< 16 skips) stays under 10% of 200 calls."""

    skip_ratio_for_s: int = 600
    """How long a high skip ratio must last before the alert fires."""

    silent_after_s: int = 8 * HEARTBEAT_INTERVAL_S
    """Seconds without a batch from a rank that has not closed after which it is
    silent: 8 heartbeats of the agent's default push interval (15 s), so a rank
    whose batches wait out a collector restart or a few retries with backoff
    is not called silent. The agent sends from a background thread, so a busy
    or paused training loop still reports. Keep it at least 4 times the agents'
    ``AMPWATCH_PUSH_INTERVAL``."""

    silent_for_s: int = 60
    """How long a rank must stay silent before the alert fires."""

    scheduler_window_s: int = 900
    """How long a scheduler step after a skipped step keeps its alert firing."""

    poisoned_window_s: int = 1800
    """How long a poisoned step (an update with non-finite gradients) keeps its
    critical alert firing."""

    origin_window_s: int = 1800
    """Window over which the skips a rank started (its own gradients non-finite
    before DDP's all-reduce, ``ampwatch_rank_origin_iterations_total``) are counted.
    Not above the longest other window, so the collector's per-rank history stays as long."""

    conflict_window_s: int = 1800
    """How long a rank conflict (a second process claiming a run and rank that another
    process still sends to) keeps its warning firing."""

    origin_min_count: int = 3
    """Skipped iterations a rank must have started within the window: one bad
    sample is news, the same rank again and again is a ticket."""

    origin_rank_share: float = 0.25
    """At most this share of the run's open ranks (and at least one rank) may have
    started skips in the window: when most ranks do, the cause is the job (data,
    learning rate), not a GPU or a host."""

    spike_window_iterations: int = 128
    """The agent's (``AMPWATCH_SPIKE_WINDOW``): iterations in each signal's rolling window (the loss, each
    optimizer's gradient norm). No spike is judged before the window holds this many finite values (a non-finite
    value is a spike from the first iteration). OLMo-core's ``SkipStepOptimizer`` uses 128."""

    spike_sigma: float = 6.0
    """The agent's (``AMPWATCH_SPIKE_SIGMA``): a value at least this many standard deviations above its window's
    mean is a spike. OLMo-core's ``SkipStepOptimizer`` uses 6."""

    spike_window_s: int = 600
    """How long a loss or gradient-norm spike keeps its alert firing."""

    outlier_sigma: float = 12.0
    """The collector's: a rank's own gradient norm (before DDP's all-reduce) at a spike of it is a gradient outlier
    when it is at least this many robust deviations (1.4826 x MAD, floored by the ranks' own deviation) above the
    median of the other ranks' rolling means. Twice the spike sigma: a spike is already ``spike_sigma`` deviations
    above its own rank's mean, and ranks of one job are alike, so at 6 a healthy rank's own spike stood about as far
    from the others (5 of 5 healthy 4-rank runs of 2,000 iterations named one, at 6.4 to 7.1); a faulty rank's
    gradients x10 stand about 20 out, x1,000 about 1,000 (docs/alerts.md)."""

    outlier_rank_share: float = 0.25
    """At most this share of the run's ranks (and at least one rank) may have their own gradient norm spike at
    one iteration for any of them to be an outlier: when more do, the job spiked, not a rank."""

    outlier_after_iterations: int = 16
    """The collector's: a rank's own gradient-norm spike within this many iterations after another rank's is taken
    for its consequence, not an outlier: the all-reduced update the other rank's gradients made reached every
    rank's weights, and a job that diverges so spikes on each rank in turn. A chain of such spikes extends it."""

    outlier_window_s: int = 1800
    """How long a gradient outlier keeps its alert firing."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _LIMITS[field.name].check(field.name, getattr(self, field.name))
        if self.skip_streak_critical <= self.skip_streak_warning:
            raise ValueError(
                f"skip_streak_critical={self.skip_streak_critical} must be above "
                f"skip_streak_warning={self.skip_streak_warning}"
            )


@dataclass(frozen=True)
class _Limit:
    """What one kind of threshold may hold: a number (whole or not), and within which range."""

    whole: str
    """What a value that is not a whole number is told it must be ("": any number will do)."""
    holds: Callable[[float], bool]
    """Whether a number is in the range (False for NaN and, where the range is open, infinities)."""
    outside: str
    """What a value out of the range is told."""

    def check(self, name: str, value: object) -> None:
        """Raise a ValueError naming the field ``name`` unless ``value`` is within this limit."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} must be a number")
        if self.whole and not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be {self.whole}")
        if not self.holds(value):
            raise ValueError(f"{name}={value!r} {self.outside}")


_RUNG = _Limit("a whole number", lambda v: v in STREAK_LADDER,
               f"is not on the collector's streak ladder; use one of {', '.join(map(str, STREAK_LADDER))} "
               "(powers of two up to 1024)")
_WINDOW = _Limit("a whole number of seconds", lambda v: v > 0, "must be > 0 seconds")
_WAIT = _Limit("a whole number of seconds >= 0", lambda v: v >= 0, "must be a whole number of seconds >= 0")
# At least one: a rank that backed off (or started a skip) 0 times is no news, and every windowed alert then needs
# a counter to rise, which lets the collector skip the windows of ranks where none did.
_COUNT = _Limit("a whole number >= 1", lambda v: v >= 1, "must be a whole number >= 1")
_ITERATIONS = _Limit("a whole number >= 0", lambda v: v >= 0, "must be a whole number >= 0")
_WINDOW_ITERATIONS = _Limit("a whole number >= 2", lambda v: v >= 2, "must be a whole number >= 2 (a deviation needs "
                            "two values)")
_SHARE = _Limit("", lambda v: 0 < v <= 1, "must be in (0, 1]")
_SCALE = _Limit("", lambda v: 0 < v < math.inf, "must be > 0 and finite")
_APART = _Limit("", lambda v: 1 < v < math.inf, "must be > 1 and finite")

_LIMITS: Mapping[str, _Limit] = {
    "calibration_iterations": _ITERATIONS,
    "skip_streak_warning": _RUNG, "skip_streak_critical": _RUNG,
    "storm_rank_share": _SHARE, "storm_edge_for_s": _WAIT,
    "skip_streak_window_s": _WINDOW,
    "backoff_window_s": _WINDOW, "backoff_min_count": _COUNT, "backoff_rank_share": _SHARE, "backoff_for_s": _WAIT,
    "collapsed_loss_scale": _SCALE, "collapsed_for_s": _WAIT,
    "desync_scale_ratio": _APART, "desync_for_s": _WAIT,
    "skip_ratio": _SHARE, "skip_ratio_window_s": _WINDOW, "skip_ratio_min_steps": _ITERATIONS,
    "skip_ratio_for_s": _WAIT,
    "silent_after_s": _WINDOW, "silent_for_s": _WAIT,
    "scheduler_window_s": _WINDOW, "poisoned_window_s": _WINDOW, "conflict_window_s": _WINDOW,
    "origin_window_s": _WINDOW, "origin_min_count": _COUNT, "origin_rank_share": _SHARE,
    "spike_window_iterations": _WINDOW_ITERATIONS, "spike_sigma": _SCALE, "spike_window_s": _WINDOW,
    "outlier_sigma": _SCALE, "outlier_rank_share": _SHARE, "outlier_window_s": _WINDOW,
    "outlier_after_iterations": _COUNT,
}
"""What each field of :class:`AlertThresholds` may hold: every field has its limit here, checked in one place."""

_FIELDS = {field.name for field in dataclasses.fields(AlertThresholds)}
if set(_LIMITS) != _FIELDS:
    raise RuntimeError("every field of AlertThresholds needs its limit in _LIMITS (and only those); "
                       f"missing: {sorted(_FIELDS - set(_LIMITS))}, extra: {sorted(set(_LIMITS) - _FIELDS)}")


#: The thresholds the committed rules in ``dashboards/generated/`` are built from.
DEFAULT_THRESHOLDS = AlertThresholds()

#: Seconds instead of minutes, so a job of a minute (``make demo``) shows alerts firing AND resolving.
#: Never for production: a 5 s streak window forgets a streak before a 15 s scrape sees it.
#:
#: Sized in iterations of the demo's job (examples/demo.py), so that a loaded machine slows the job but
#: cannot change which alerts fire: its scale grows after every 30 clean iterations and backs off at
#: iterations 80-87. The streak alert fires on the streak counters at the batch that carries the 4th skip
#: (no window needed). Sustained backoff needs two backoffs (two iterations) in its 3 s window and no growth
#: (the last one is 21 iterations before the trouble), and fires at the first evaluation where that holds
#: (for 0 s): true for any pace from 0.1 to 2.5 s an iteration (tests/test_demo.py plays the job at several).
DEMO_THRESHOLDS = dataclasses.replace(
    DEFAULT_THRESHOLDS, calibration_iterations=10, skip_streak_warning=4, skip_streak_critical=16,
    skip_streak_window_s=5, backoff_window_s=3, backoff_min_count=2, backoff_for_s=0,
    collapsed_for_s=2, desync_for_s=10, skip_ratio_window_s=60, skip_ratio_for_s=5,
    silent_after_s=30, silent_for_s=5, scheduler_window_s=10, poisoned_window_s=30, origin_window_s=60,
    conflict_window_s=60, storm_edge_for_s=2, spike_window_iterations=32, spike_window_s=30, outlier_window_s=60)

PROFILES: Mapping[str, AlertThresholds] = {"default": DEFAULT_THRESHOLDS, "demo": DEMO_THRESHOLDS}
"""Named thresholds: what ``--alert-thresholds`` accepts besides a JSON file of overrides."""


def promql_duration(seconds: int) -> str:
    """Render whole seconds as a PromQL duration (``900`` -> ``"15m"``)."""
    if seconds < 0:
        raise ValueError(f"duration {seconds!r} must be >= 0 seconds")
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
