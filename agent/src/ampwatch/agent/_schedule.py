"""When the sender builds a batch: news soon, the cumulative state at least once per heartbeat.

Pure bookkeeping on a clock the caller passes in (no threads, no I/O), so the load
generator of ``bench/experiments/fleet.py`` replays exactly the agent's schedule.

The ranks of one job act together: they start within a second of each other and, under
DDP, skip at the same iteration. So that a collector is not asked for a whole job's requests
at once, each rank draws its own offsets, wider for bigger jobs (:data:`RANKS_PER_SECOND`):
its first batch within a few seconds (a big job: within a minute), its heartbeats on its own
grid (news does not move it), its news within a second (a job of more than 500 ranks: within
:data:`NEWS_HOLD` + :data:`NEWS_SPREAD`, 1.55 s).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S, is_rung

__all__ = ["NEWS_GAP", "NEWS_HOLD", "NEWS_SPREAD", "RANKS_PER_SECOND", "PushSchedule", "default_heartbeat", "is_news"]

NEWS_GAP = 1.0
"""Seconds: at most one batch per gap however much news comes (a storm of events does not multiply
requests). News after a quiet spell goes after the hold, so a skip reaches the collector within a
second; news that comes sooner waits for the end of the gap and shares one batch."""

NEWS_HOLD = 0.05
"""Seconds a news batch waits at least after its first news, so the rest of the iteration joins it:
the backoff that ``update()`` records right after a streak's first skip, the other optimizers' skips."""

NEWS_SPREAD = 1.5
"""Seconds: the widest a job spreads its ranks' news (:data:`RANKS_PER_SECOND`), so news still goes
within 2 s (:data:`NEWS_HOLD` + 1.5 s, and the answer's latency) whatever the job's size. Under DDP
every rank's news of a whole-job skip comes at the same iteration: at 1,024 ranks a spread of 0.95 s
asked a collector for about 1,080 batches in that second, 1.5 s for about 680, and the storm's ingest
p99 fell from 667-700 to 487-501 ms (docs/benchmarks.md, section 7)."""

RANKS_PER_SECOND = 500
"""Ranks of one job whose first batches a collector is asked to take per second: a job of N ranks
spreads its first batches over N / 500 s (at most 4 heartbeats) and its news over N / 500 s (at
most :data:`NEWS_SPREAD`). Two ranks: 2 ms; 16,384 ranks: 33 s and 1.5 s. A rank's first contact
costs a collector more than an update (its rows are created), and a collector on two cores keeps up
with a few thousand updates a second. It is also the most heartbeats per second a job asks of one
collector by default (:func:`default_heartbeat`); docs/benchmarks.md (the fleet section) has the
figures behind it."""


def default_heartbeat(ranks_per_collector: float) -> float:
    """Return the push interval when ``AMPWATCH_PUSH_INTERVAL`` is not set, for a job of this many ranks per collector.

    15 s, or longer for a job whose heartbeats alone would ask one collector for more than
    :data:`RANKS_PER_SECOND` batches a second: that many ranks' heartbeats per second, at most
    ``MAX_HEARTBEAT_INTERVAL_S`` (30 s, so that the 120 s silence threshold stays 4 heartbeats). At
    16,384 ranks on one collector: 30 s, 546 heartbeats a second instead of 1,092 (what that does to a
    collector: docs/benchmarks.md, section 9). News goes within a second whatever this is.

    >>> [round(default_heartbeat(n), 1) for n in (8, 4096, 7500, 10000, 16384, 1_000_000)]
    [15.0, 15.0, 15.0, 20.0, 30.0, 30.0]
    """
    spread = ranks_per_collector / RANKS_PER_SECOND
    return min(float(MAX_HEARTBEAT_INTERVAL_S), max(float(HEARTBEAT_INTERVAL_S), spread))


def is_news(event: Mapping[str, Any]) -> bool:
    """Return whether ``event`` asks for a batch now rather than at the next heartbeat.

    News is what changes an alert or what an operator is shown: a skip that starts a streak
    or reaches a ladder rung (streak 1, 2, 4, 8, ...), a streak's end, a poisoned step, a
    warning, a scale set by hand or restored, a disabled scaler, the close, a loss or gradient-norm
    spike (sent at its rungs only; a rank's own one is what the collector compares across ranks). The routine rest
    rides along with the next batch: the backoff of each skipped iteration (the skip that
    starts the streak and its rungs carry the streak's backoffs, see :data:`NEWS_HOLD`),
    growths, the skips between rungs, scheduler steps after a skip. Costs a dict lookup.
    """
    kind = event.get("kind")
    if kind == "skip":
        streak = event.get("streak")
        return isinstance(streak, int) and is_rung(streak)
    if kind == "scale_change":
        return event.get("cause") not in ("backoff", "growth")
    return kind != "scheduler_after_skip"


class PushSchedule:
    """The next time a batch is due, given when the last one was built and when news came.

    ``heartbeat`` is the push interval (``AMPWATCH_PUSH_INTERVAL``): heartbeats fall on a
    grid of that period starting at the first batch; one is left out when another batch went
    less than half a period before it, so the wait between batches is at most 1.5 periods.
    News makes a batch due ``news_hold`` (plus this rank's share of the job's spread, at most
    ``news_spread``) after it, but never sooner than ``news_gap`` after the last batch. A gap,
    hold or spread longer than the heartbeat is cut to it, so a short push interval (tests, the
    demo) sends news as often as it sends state. ``ranks`` is the job's world size.

    >>> s = PushSchedule(heartbeat=15.0)
    >>> s.begin(100.0); s.due()  # one rank: the first batch goes at once
    100.0
    >>> s.built(100.0); s.due()
    115.0
    >>> s.news(100.2); s.due()  # news within the gap waits for its end
    101.0
    >>> s.built(101.0); s.due()  # the heartbeat grid does not move
    115.0
    >>> s.news(110.0); s.due()  # news after a quiet spell waits only the hold
    110.05
    >>> s.built(110.05); s.due()  # a heartbeat 5 s after a batch is left out
    130.0
    """

    __slots__ = ("heartbeat", "news_gap", "news_delay", "first_delay", "last_built", "news_since",
                 "next_heartbeat")

    def __init__(self, heartbeat: float, news_gap: float = NEWS_GAP, news_hold: float = NEWS_HOLD, *,
                 ranks: int = 1, news_spread: float = NEWS_SPREAD, rng: random.Random | None = None) -> None:
        rng = rng if rng is not None else random.Random()
        self.heartbeat = heartbeat
        self.news_gap = min(news_gap, heartbeat)
        news_hold = min(news_hold, self.news_gap)
        spread = max(0, ranks - 1) / RANKS_PER_SECOND
        self.news_delay = news_hold + rng.uniform(0.0, min(spread, news_spread, self.heartbeat - news_hold))
        self.first_delay = rng.uniform(0.0, min(spread, 4 * heartbeat))
        self.last_built = float("-inf")
        self.news_since: float | None = None  # when the first news not yet in a batch came
        self.next_heartbeat = float("-inf")  # set by begin()

    def begin(self, now: float) -> None:
        """Start the clock: the first batch is due after this rank's share of the job's spread."""
        self.next_heartbeat = now + self.first_delay

    def news(self, now: float) -> None:
        """Note news at ``now`` (later news before the next batch changes nothing)."""
        if self.news_since is None:
            self.news_since = now

    def due(self) -> float:
        """Return when the next batch is due (in the caller's clock)."""
        if self.news_since is None:
            return self.next_heartbeat
        return min(self.next_heartbeat, max(self.news_since + self.news_delay, self.last_built + self.news_gap))

    def built(self, now: float) -> None:
        """Note that a batch was built at ``now``: it carried all news so far."""
        self.last_built = now
        self.news_since = None
        if self.next_heartbeat == float("-inf"):  # never begun: the grid starts here
            self.next_heartbeat = now
        if self.next_heartbeat < now + self.heartbeat / 2:  # this batch stands in for the heartbeats until then
            self.next_heartbeat += self.heartbeat * math.ceil((now + self.heartbeat / 2 - self.next_heartbeat)
                                                              / self.heartbeat)
