"""One simulated rank in a whole-job skip storm: its counters and events, as an agent reports them.

Each push covers ``iterations`` training iterations of a rank with two optimizers. Before the
storm and after it every iteration steps; during it every iteration of every rank skips on both
optimizers (the everyday DDP case: an inf in one rank's gradients reaches every rank through
the all-reduce) and the float32 loss scale backs off at each one, down to 0.0. Counters are
cumulative (steps, skips, streaks, the streak ladder, backoffs) as the agent keeps them.

Events come in one of two ``patterns`` (tests/test_bench_storm.py checks both against a real
GradScaler watched by the agent):

- ``per-skip``: the agent before issue 14: one ``skip`` per optimizer per skipped iteration and
  one ``scale_change`` per backoff, plus ``streak_end``.
- ``streaks``: the agent now: ``skip`` only at a streak's ladder rungs (positions 1, 2, 4, 8,
  ...), ``scale_change`` backoffs folded likewise (``count``), ``streak_end`` with the length.

    >>> rank = StormRank(pattern="streaks", iterations=4)
    >>> [e["kind"] for e in rank.push(storm=True)]
    ['skip', 'skip', 'scale_change', 'skip', 'skip', 'scale_change', 'skip', 'skip', 'scale_change']
"""

from __future__ import annotations

import time
from typing import Any

from ampwatch.contract.protocol import is_rung as _rung
from bench._rank_batch import CLEAN_DELIVERY, OFFENDING_PARAM, OptimizerRun

__all__ = ["PATTERNS", "StormRank"]

PATTERNS = ("per-skip", "streaks")
OPTIMIZERS = ("gen", "disc")
_SMALLEST = 2.0 ** -149  # the smallest float32 subnormal: half of it rounds to 0.0


class StormRank:
    """Counters and events of one rank, advanced one push (``iterations`` iterations) at a time."""

    def __init__(self, pattern: str = "streaks", iterations: int = 10, scale: float = 65536.0) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        self.pattern, self.iterations = pattern, iterations
        self.iteration = 0
        self.scale = scale
        self.backoffs = 0
        self.optimizers = {name: OptimizerRun() for name in OPTIMIZERS}
        self._ids = 0
        self._run = 0  # consecutive backoffs so far
        self._run_reported = 0  # of which already in a scale_change event
        self._run_before = scale  # the scale before the first backoff not yet in an event
        self._run_last = 0  # iteration of the latest backoff

    def _event(self, out: list, kind: str, **fields: Any) -> None:
        self._ids += 1
        out.append({"id": self._ids, "kind": kind, "time": time.time(), **fields})

    def push(self, storm: bool, intervals: int = 1) -> list[dict[str, Any]]:
        """Advance ``iterations`` per push interval, ``intervals`` of them (all skipped when ``storm``: a rank
        that could not send for a while sends what happened meanwhile); return their events."""
        out: list[dict[str, Any]] = []
        for _ in range(self.iterations * intervals):
            for name, opt in self.optimizers.items():
                if storm:
                    self._skip(out, name, opt)
                else:
                    start, ended = opt.start, opt.step()
                    if ended:
                        self._event(out, "streak_end", iteration=self.iteration, optimizer=name,
                                    start_iteration=start, length=ended)
            if storm and self.scale > 0.0:
                self._backoff(out)
            elif self._run:
                self._fold_backoffs(out)
                self._run = self._run_reported = 0
            self.iteration += 1
        return out

    def _skip(self, out: list, name: str, opt: OptimizerRun) -> None:
        position = opt.skip(self.iteration)
        if self.pattern == "per-skip" or _rung(position):
            named = _rung(position)  # naming is rate-limited to the rungs either way
            self._event(out, "skip", iteration=self.iteration, optimizer=name, streak=position,
                        params=[OFFENDING_PARAM] if named else [], params_total=1 if named else None, inspected=named)

    def _backoff(self, out: list) -> None:
        before, after = self.scale, self.scale * 0.5
        self.scale = after if after >= _SMALLEST else 0.0
        self.backoffs += 1
        self._run += 1
        self._run_last = self.iteration
        if self.pattern == "per-skip":
            self._event(out, "scale_change", iteration=self.iteration, cause="backoff", before=before,
                        after=self.scale)
        elif _rung(self._run):
            self._fold_backoffs(out)

    def restore(self, scale: float = 65536.0) -> list[dict[str, Any]]:
        """A checkpoint restored (``scaler.load_state_dict``) between two iterations: the backoffs not yet
        reported are folded into one event, then the scale that came back is a ``restored`` change."""
        out: list[dict[str, Any]] = []
        self._fold_backoffs(out)
        self._run = self._run_reported = 0
        if scale != self.scale:
            self._event(out, "scale_change", iteration=self.iteration, cause="restored", before=self.scale,
                        after=scale)
        self.scale = self._run_before = scale
        return out

    def _fold_backoffs(self, out: list) -> None:
        count = self._run - self._run_reported
        if self.pattern == "per-skip" or not count:
            return
        fields = {"count": count} if count > 1 else {}
        self._event(out, "scale_change", iteration=self._run_last, cause="backoff", before=self._run_before,
                    after=self.scale, **fields)
        self._run_reported = self._run
        self._run_before = self.scale

    def state(self) -> dict[str, Any]:
        """The batch's ``state`` (cumulative counters) as of the last push."""
        return {"iteration": self.iteration, "loss_scale": self.scale, "backoffs": self.backoffs, "growths": 0,
                "manual_sets": 0, "optimizers": {n: o.counters() for n, o in self.optimizers.items()},
                "delivery": CLEAN_DELIVERY}
