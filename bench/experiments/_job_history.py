"""A simulated 1,024-rank job as the collector exposes it at ``/metrics``, at any moment of its history.

Every rank runs 2 iterations per second in lockstep with two optimizers (``gen``, ``disc``) under a
GradScaler (scale 2**20 at the start, growth every 2,000 clean iterations, backoff 0.5); gradients
overflow at a scale of 2**24 and above, so every rank backs off once in about 2,000 iterations (rank 5
holds the inf/NaN first). Trouble is staged as issue 14 staged it: a whole-job storm (see ``Job``'s
``storm``; by default, as issue 14 had it, 18 skips in a
row 2 minutes before ``end`` (ranks 0-511 hold the inf/NaN first), ranks 40-43 collapsing, rank 777
skipping 1 step in 8, a poisoned step on rank 512, the LR scheduler of rank 900 stepping after skips,
and rank 1000 silent for the last 4 minutes. Ranks with the same trouble share one
simulation (a handful of GradScaler-like state machines, stepped once per iteration), so the whole
job costs a few hundred milliseconds to simulate.

The same series and values serve both the history (:meth:`Job.history`, which the bench writes into
Prometheus) and the live ``/metrics`` Prometheus scrapes after it (:meth:`Job.exposition`), so the two
join into one series per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ampwatch.contract import metrics as m
from ampwatch.contract.protocol import STREAK_LADDER
from bench._rank_batch import OptimizerRun

__all__ = ["Job"]

RATE = 2.0  # iterations per second
OPTIMIZERS = ("gen", "disc")
GROWTH_INTERVAL = 2000
OVERFLOW_SCALE = 2.0 ** 24  # gradients overflow at this scale and above, on every rank
STORM = 18  # skips in a row of the whole-job storm (reaches the warning rung, 16)
# ``storm="during"`` / ``"after"``: when the history comes this close to the clock (the live scrapes), the storm
# starts; ``during`` it lasts an hour (past the bench), ``after`` a minute, then the scale is restored (a checkpoint).
STORM_LEAD_S = {"during": 60, "after": 180}
STORM_LENGTH = {"during": int(3600 * RATE), "after": int(60 * RATE)}
_COUNTERS = ("steps", "skipped", "scheduler_steps_after_skip", "poisoned_steps")


class _Scaler:
    """One kind of rank: its GradScaler and optimizers, stepped an iteration at a time."""

    def __init__(self, kind: str, storm_at: int, trouble_from: int, storm_length: int = STORM,
                 restore: bool = False) -> None:
        self.kind, self.storm_at, self.trouble_from, self.storm_length = kind, storm_at, trouble_from, storm_length
        self.restore = restore  # the scale is restored (a checkpoint) when the storm ends
        self.iteration, self.scale, self.tracker = 0, 2.0 ** 20, 0
        self.backoffs = self.growths = self.overflows = 0
        self.optimizers = {name: OptimizerRun() for name in OPTIMIZERS}

    def _skips(self, it: int) -> tuple[bool, bool]:
        everyone = self.scale >= OVERFLOW_SCALE or self.storm_at <= it < self.storm_at + self.storm_length
        troubled = it >= self.trouble_from
        if self.kind == "collapse" and troubled:
            return True, True
        if self.kind == "ratio" and troubled and it % 8 == 3:
            return True, everyone
        return everyone, everyone

    def advance_to(self, iteration: int) -> None:
        while self.iteration < iteration:
            it = self.iteration = self.iteration + 1
            self.overflows += self.scale >= OVERFLOW_SCALE
            skip_gen, skip_disc = self._skips(it)
            for name, skipped in zip(OPTIMIZERS, (skip_gen, skip_disc), strict=True):
                if skipped:
                    self.optimizers[name].skip(it)
                else:
                    self.optimizers[name].step()
            troubled = it >= self.trouble_from
            if self.restore and it == self.storm_at + self.storm_length:
                self.scale, self.tracker = 2.0 ** 20, 0
            if self.kind == "scheduler" and troubled and skip_gen:
                self.optimizers["gen"].scheduler_steps_after_skip += 1
            if self.kind == "poison" and it == self.trouble_from:
                self.optimizers["gen"].poisoned_steps += 1
            if skip_gen or skip_disc:
                self.scale, self.tracker, self.backoffs = self.scale * 0.5, 0, self.backoffs + 1
            else:
                self.tracker += 1
                if self.tracker == GROWTH_INTERVAL:
                    self.scale, self.tracker, self.growths = self.scale * 2.0, 0, self.growths + 1


def _kind(rank: int) -> str:
    if 40 <= rank <= 43:
        return "collapse"
    return {777: "ratio", 512: "poison", 900: "scheduler", 1000: "silent"}.get(rank, "healthy")


class Job:
    """The job's series at any time after ``end - history_s``; the trouble is staged relative to ``end``."""

    def __init__(self, ranks: int, end: float, run: str = "job-1024", history_s: int = 2 * 3600,
                 storm: str = "short") -> None:
        """``storm``: ``short``, 18 skips in a row 2 minutes before ``end``. Placed by the clock instead, so that
        the bench sees it however long writing the history took: ``during``, every rank skipping from a minute
        before the history catches up with the clock, for an hour (its scale collapses); ``after``, for a minute
        from three minutes before (its scale collapses, then is restored from a checkpoint)."""
        self.ranks, self.end, self.run = ranks, end, run
        self.started = end - history_s  # iteration 0
        if storm not in ("short", "after", "during"):
            raise ValueError(f"storm={storm!r}: give 'short', 'after' or 'during'")
        self._lead_s = STORM_LEAD_S.get(storm)
        self._storm: int | None = self.iteration_at(end - 2 * 60) if storm == "short" else None
        self._storm_length = STORM_LENGTH.get(storm, STORM)
        self._restore = storm == "after"
        never = 10 ** 12  # the silent rank's trouble is its last_seen, frozen from silent_from on
        self._starts = {"collapse": self.iteration_at(end - 20 * 60), "ratio": self.iteration_at(end - 31 * 60),
                        "poison": self.iteration_at(end - 5 * 60), "scheduler": self.iteration_at(end - 12 * 60),
                        "silent": never, "healthy": never}
        self.silent_from = end - 4 * 60
        self._live = self._scalers()
        self._kinds = [_kind(r) for r in range(ranks)]

    def _scalers(self) -> dict[str, _Scaler]:
        never = 10 ** 12  # a storm placed by the clock: not yet
        return {kind: _Scaler(kind, never if self._storm is None else self._storm, start, self._storm_length,
                              self._restore) for kind, start in self._starts.items()}

    def iteration_at(self, t: float) -> int:
        return int((t - self.started) * RATE)

    def _states(self, t: float, scalers: dict[str, _Scaler]) -> dict[str, _Scaler]:
        for kind, scaler in scalers.items():
            frozen = kind == "silent" and t > self.silent_from
            scaler.advance_to(self.iteration_at(self.silent_from if frozen else t))
        return scalers

    def _series(self, t: float, states: dict[str, _Scaler]) -> Iterator[tuple[str, Any]]:
        """Yield ``(series, value)`` for every series at time ``t``, the series as the text format writes it."""
        run = self.run
        for rank in range(self.ranks):
            s = states[self._kinds[rank]]
            seen = min(t, self.silent_from) if s.kind == "silent" else t
            base = f'run="{run}",rank="{rank}"'
            for name, o in s.optimizers.items():
                labels = f'{base},optimizer="{name}"'
                for field, metric in zip(_COUNTERS, (m.OPTIMIZER_STEPS, m.OPTIMIZER_SKIPPED_STEPS,
                                                     m.OPTIMIZER_SCHEDULER_STEPS_AFTER_SKIP,
                                                     m.OPTIMIZER_POISONED_STEPS), strict=True):
                    yield f"{metric.name}{{{labels}}}", getattr(o, field)
                yield f"{m.OPTIMIZER_CONSECUTIVE_SKIPPED.name}{{{labels}}}", o.consecutive
                yield f"{m.OPTIMIZER_LONGEST_SKIP_STREAK.name}{{{labels}}}", o.longest
                for length, count in zip(STREAK_LADDER, o.reached, strict=True):
                    if count:  # a rung is exposed once a streak reached it, as the collector does
                        yield f'{m.OPTIMIZER_SKIP_STREAKS.name}{{{labels},min_length="{length}"}}', count
                if o.skipped:
                    yield f'{m.NONFINITE_GRADIENT_INFO.name}{{{labels},parameter="blocks.{rank % 24}.mlp.weight"}}', 1
            origins = (s.overflows if rank == 5 else 0) + (rank < 512 and s.iteration >= s.storm_at)
            for metric, value in ((m.LOSS_SCALE, s.scale), (m.LOSS_SCALE_BACKOFFS, s.backoffs),
                                  (m.LOSS_SCALE_GROWTHS, s.growths), (m.LOSS_SCALE_MANUAL_SETS, 0),
                                  (m.AGENT_DROPPED_EVENTS, 0), (m.AGENT_SEND_FAILURES, 0),
                                  (m.AGENT_REJECTED_BATCHES, 0), (m.AGENT_ERRORS, 0),
                                  (m.RANK_ORIGIN_ITERATIONS, int(origins)), (m.ITERATION, s.iteration),
                                  (m.RANK_LAST_SEEN, round(seen, 3)), (m.RANK_CLOSED, 0)):
                yield f"{metric.name}{{{base}}}", value
            yield (f'{m.RANK_INFO.name}{{{base},host="node-{rank // 8:03d}",local_rank="{rank % 8}",'
                   f'world_size="{self.ranks}",scaler_enabled="true",scaler_kind="GradScaler",'
                   f'agent_version="0.1.0"}}', 1)

    def exposition(self, t: float) -> str:
        """Return ``/metrics`` (text format) at time ``t`` (at or after ``end``, increasing between calls)."""
        states = self._states(t, self._live)
        return "".join(f"{series} {value!r}\n" for series, value in self._series(t, states))

    def history(self, start: float, step_s: float, until: Callable[[], float]) -> Iterator[tuple[float, list]]:
        """Yield ``(t, [(series, value), ...])`` from ``start`` every ``step_s``, oldest first, while ``t <= until()``.

        With ``until=time.time`` the history catches up with the clock however long writing it takes.
        """
        scalers = self._scalers()
        t = start
        while t <= until():
            if self._storm is None and until() - t <= self._lead_s:  # type: ignore[operator]
                self._storm = self.iteration_at(t)
                for s in (*scalers.values(), *self._live.values()):
                    s.storm_at = self._storm
            yield t, list(self._series(t, self._states(t, scalers)))
            t += step_s
