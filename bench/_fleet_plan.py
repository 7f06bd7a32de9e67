"""What one simulated rank of ``bench._fleet_ranks`` trains, and when its agent sends.

A :class:`Plan` is a rank's training timeline (iterations at a fixed period from its own start,
skip streaks at given iterations) and everything that follows from it: the events the agent's
recorder emits and the cumulative counters at any iteration, so a batch can be built for any
moment without stepping a model. A :class:`Delivery` is the agent's push schedule, as it was up
to issue 18 (``before``) and as it is (``after``): :data:`DELIVERIES`.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

from bench._rank_batch import OFFENDING_PARAM

from ampwatch.agent._schedule import NEWS_GAP, NEWS_HOLD, is_news
from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S

__all__ = ["DELIVERIES", "Delivery", "Plan", "storm_streaks"]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery policy: the schedule's settings and what counts as news."""

    heartbeat: float
    news_gap: float
    news_hold: float
    news: Callable[[dict], bool]
    spread: bool  # whether the ranks of a job spread their first batches and news (PushSchedule's ranks=)


DELIVERIES = {
    # Up to issue 18 the sender built a batch every push interval (1 s) and, on the recorder's wake at a
    # streak's first skip, at most 50 ms after the previous one (_WAKE_GAP); nothing else woke it.
    "before": Delivery(1.0, 0.05, 0.0, lambda e: e["kind"] == "skip" and e["streak"] == 1, spread=False),
    "after": Delivery(float(HEARTBEAT_INTERVAL_S), NEWS_GAP, NEWS_HOLD, is_news, spread=True),
}


class Plan:
    """One rank's training: iteration ``i`` ends at ``start + i * period``; skip streaks ``(first, length)``."""

    def __init__(self, start: float, period: float, streaks: list[tuple[int, int]]) -> None:
        self.start, self.period, self.streaks = start, period, streaks
        self.events = self._events()

    def iteration_at(self, t: float) -> int:
        """Iterations finished by wall time ``t``."""
        return max(0, int((t - self.start) / self.period + 1e-9))

    def time_of(self, iteration: int) -> float:
        """Wall time iteration ``iteration`` (1-based) ends, when its skip and events happen."""
        return self.start + iteration * self.period

    def _events(self) -> list[tuple[int, dict]]:
        """Every event of the plan with the iteration it happens in, as the recorder emits them."""
        out: list[tuple[int, dict]] = []
        scale = 65536.0
        for first, length in self.streaks:
            for k in range(1, length + 1):
                it = first + k - 1
                rung = k & (k - 1) == 0
                out.append((it, {"kind": "skip", "iteration": it, "optimizer": "gen", "streak": k,
                                 "params": [OFFENDING_PARAM] if rung else [], "params_total": 1 if rung else None,
                                 "inspected": rung}))
                out.append((it, {"kind": "scale_change", "iteration": it, "cause": "backoff", "before": scale,
                                 "after": scale / 2}))
                scale /= 2
            out.append((first + length, {"kind": "streak_end", "optimizer": "gen", "iteration": first + length,
                                         "start_iteration": first, "length": length}))
        return out

    def state(self, iteration: int) -> tuple[dict, int, float]:
        """Return the ``gen`` optimizer's counters, the backoffs and the scale after ``iteration``."""
        skipped = consecutive = longest = streaks = 0
        reached: dict[str, int] = {}
        for first, length in self.streaks:
            if first > iteration:
                break
            done = min(length, iteration - first + 1)
            skipped += done
            streaks += 1
            longest = max(longest, done)
            consecutive = done if first + length > iteration else 0
            n = 1
            while n <= done and n <= 1024:
                reached[str(n)] = reached.get(str(n), 0) + 1
                n *= 2
        gen = {"steps": iteration - skipped, "skipped": skipped, "consecutive_skipped": consecutive,
               "longest_streak": longest, "streaks": streaks, "streaks_reached": reached,
               "scheduler_steps_after_skip": 0, "poisoned_steps": 0}
        return gen, skipped, 65536.0 * 0.5 ** skipped


def storm_streaks(rng: random.Random, first: int, until: int) -> list[tuple[int, int]]:
    """Streaks from iteration ``first``: one of 20 (it reaches the streak alert's 16), then short ones."""
    streaks, it, length = [], first, 20
    while it + length < until:
        streaks.append((it, length))
        it += length + rng.randint(2, 8)
        length = rng.choice((1, 1, 2, 3, 5, 8))
    return streaks
