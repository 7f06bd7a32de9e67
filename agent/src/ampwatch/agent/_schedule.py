"""When the sender builds a batch: news soon, the cumulative state at least once per heartbeat.

Pure bookkeeping on a clock the caller passes in (no threads, no I/O), so the load
generator of ``bench/fleet.py`` replays exactly the agent's schedule.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["NEWS_GAP", "NEWS_HOLD", "PushSchedule", "is_news"]

NEWS_GAP = 1.0
"""Seconds: at most one batch per gap however much news comes (a storm of events does not multiply
requests). The first news after a quiet spell goes at once, so a skip reaches the collector well within
2 s; news that comes sooner waits for the end of the gap and shares one batch."""

NEWS_HOLD = 0.05
"""Seconds a news batch waits after its first news, so the rest of the iteration joins it: the backoff
that ``update()`` records right after a streak's first skip, the skips of the other optimizers."""


def is_news(event: Mapping[str, Any]) -> bool:
    """Return whether ``event`` asks for a batch now rather than at the next heartbeat.

    News is what changes an alert or what an operator is shown: a skip that starts a streak
    or reaches a ladder rung (streak 1, 2, 4, 8, ...), a streak's end, a poisoned step, a
    warning, a scale set by hand or restored, a disabled scaler, the close. The routine rest
    rides along with the next batch: the backoff of each skipped iteration (the skip that
    starts the streak and its rungs carry the streak's backoffs, see :data:`NEWS_HOLD`),
    growths, the skips between rungs, scheduler steps after a skip. Costs a dict lookup.
    """
    kind = event.get("kind")
    if kind == "skip":
        streak = event.get("streak")
        return isinstance(streak, int) and streak > 0 and streak & (streak - 1) == 0
    if kind == "scale_change":
        return event.get("cause") not in ("backoff", "growth")
    return kind != "scheduler_after_skip"


class PushSchedule:
    """The next time a batch is due, given when the last one was built and when news came.

    ``heartbeat`` is the longest wait between batches (``AMPWATCH_PUSH_INTERVAL``); news
    makes a batch due ``news_hold`` after it, but never sooner than ``news_gap`` after the
    last batch. A gap or hold longer than the heartbeat is cut to it, so a short push
    interval (tests, the demo) sends news as often as it sends state.

    >>> s = PushSchedule(heartbeat=15.0)
    >>> s.due()  # nothing built yet: the first batch goes at once
    -inf
    >>> s.built(100.0); s.due()
    115.0
    >>> s.news(100.2); s.due()  # news within the gap waits for its end
    101.0
    >>> s.built(101.0); s.news(110.0); s.due()  # news after a quiet spell waits only the hold
    110.05
    """

    __slots__ = ("heartbeat", "news_gap", "news_hold", "last_built", "news_since")

    def __init__(self, heartbeat: float, news_gap: float = NEWS_GAP, news_hold: float = NEWS_HOLD) -> None:
        self.heartbeat = heartbeat
        self.news_gap = min(news_gap, heartbeat)
        self.news_hold = min(news_hold, self.news_gap)
        self.last_built = float("-inf")
        self.news_since: float | None = None  # when the first news not yet in a batch came

    def news(self, now: float) -> None:
        """Note news at ``now`` (later news before the next batch changes nothing)."""
        if self.news_since is None:
            self.news_since = now

    def due(self) -> float:
        """Return when the next batch is due (in the caller's clock)."""
        heartbeat = self.last_built + self.heartbeat
        if self.news_since is None:
            return heartbeat
        return min(heartbeat, max(self.news_since + self.news_hold, self.last_built + self.news_gap))

    def built(self, now: float) -> None:
        """Note that a batch was built at ``now``: it carried all news so far."""
        self.last_built = now
        self.news_since = None
