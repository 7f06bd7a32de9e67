"""What one simulated rank of ``bench.experiments._fleet_ranks`` trains, and when its agent sends.

A :class:`Plan` is a rank's training timeline (iterations at a fixed period from its own start,
skip streaks at given iterations) and everything that follows from it: the events the agent's
recorder emits and the cumulative counters at any iteration, so a batch can be built for any
moment without stepping a model. A :class:`LockstepPlan` is one rank of a DDP job whose ranks
iterate together and skip together (a whole-job storm ended by a checkpoint restore), so every
rank's news comes in the same second. A :class:`Delivery` is the agent's push schedule, as it was
up to issue 18 (``before``) and as it is (``after``): :data:`DELIVERIES`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from ampwatch.agent._schedule import NEWS_GAP, NEWS_HOLD, NEWS_SPREAD, is_news
from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S
from bench._rank_batch import CLEAN_DELIVERY, OFFENDING_PARAM, optimizer
from bench._storm import StormRank

__all__ = ["DELIVERIES", "Delivery", "JobTimeline", "LockstepPlan", "Plan", "storm_streaks"]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery policy: the schedule's settings and what counts as news."""

    heartbeat: float
    news_gap: float
    news_hold: float
    news: Callable[[dict], bool]
    spread: bool  # whether the ranks of a job spread their first batches and news (PushSchedule's ranks=)
    news_spread: float = NEWS_SPREAD  # the widest spread of a job's news (PushSchedule's news_spread=)


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
        gen = optimizer(steps=iteration - skipped, skipped=skipped, consecutive=consecutive, longest=longest,
                        streaks=streaks, reached=reached)
        return gen, skipped, 65536.0 * 0.5 ** skipped

    def batch_state(self, iteration: int) -> dict:
        """Return a batch's ``state`` after ``iteration``: ``gen`` as :meth:`state` says, ``disc`` always stepping."""
        gen, backoffs, scale = self.state(iteration)
        disc = dict(gen, steps=iteration, skipped=0, consecutive_skipped=0, longest_streak=0, streaks=0,
                    streaks_reached={})
        return {"iteration": iteration, "loss_scale": scale, "backoffs": backoffs, "growths": 0, "manual_sets": 0,
                "optimizers": {"gen": gen, "disc": disc}, "delivery": CLEAN_DELIVERY}


class JobTimeline:
    """A DDP job's iterations as each of its ranks records them, the same on every rank: healthy, then from
    iteration ``storm_from`` every rank skips ``storm_iterations`` iterations on both optimizers (an inf in one
    rank's gradients reaches all through the all-reduce; the scale backs off to 0.0 in a long storm), then the
    checkpoint taken before the storm is restored and training steps again, until ``until``.

    The events and counters are :class:`bench._storm.StormRank`'s, checked against a real agent by
    tests/test_bench_storm.py. Shared by all ranks of the job (they differ only in identity and a few ms of phase).
    """

    def __init__(self, storm_from: int, storm_iterations: int, until: int) -> None:
        model = StormRank("streaks", iterations=1)
        self.storm_from, self.storm_iterations = storm_from, storm_iterations
        self.events: list[tuple[int, dict]] = []  # (iterations finished when it happened, event)
        self._states = [model.state()]
        restore_at = storm_from + storm_iterations if storm_iterations else -1
        for i in range(until):
            events = model.restore() if i == restore_at else []
            events += model.push(storm=storm_from <= i < restore_at)
            self.events += [(i + 1, _plain(e)) for e in events]
            self._states.append(model.state())

    def state(self, iteration: int) -> dict:
        return self._states[min(iteration, len(self._states) - 1)]


def _plain(event: dict) -> dict:
    """``event`` without the id and time the model gave it: each rank numbers its own, and the time is the plan's."""
    return {k: v for k, v in event.items() if k not in ("id", "time")}


class LockstepPlan:
    """One rank of a :class:`JobTimeline` job: iteration ``i`` ends at ``start + i * period`` on every rank (their
    ``start`` differs by the few ms DDP's all-reduce lets them drift)."""

    def __init__(self, start: float, period: float, timeline: JobTimeline) -> None:
        self.start, self.period, self.timeline = start, period, timeline
        self.events = timeline.events

    iteration_at = Plan.iteration_at
    time_of = Plan.time_of

    def batch_state(self, iteration: int) -> dict:
        """Return a batch's ``state`` after ``iteration``."""
        return self.timeline.state(iteration)

    def storm_starts(self) -> tuple[list[tuple[float, int]], float | None]:
        """(time of the storm's first skip, ``gen``'s skips counted with it) and when its 16th skip happened."""
        first = self.timeline.storm_from
        if not self.timeline.storm_iterations:
            return [], None
        skipped = self.timeline.state(first)["optimizers"]["gen"]["skipped"]
        rung16 = self.time_of(first + 16) if self.timeline.storm_iterations >= 16 else None
        return [(round(self.time_of(first + 1), 4), skipped + 1)], None if rung16 is None else round(rung16, 4)


def storm_streaks(rng: random.Random, first: int, until: int) -> list[tuple[int, int]]:
    """Streaks from iteration ``first``: one of 20 (it reaches the streak alert's 16), then short ones."""
    streaks, it, length = [], first, 20
    while it + length < until:
        streaks.append((it, length))
        it += length + rng.randint(2, 8)
        length = rng.choice((1, 1, 2, 3, 5, 8))
    return streaks
