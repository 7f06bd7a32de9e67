"""Ranks counted as the agent counts them, fed straight to the collector's built-in alert evaluator.

Not a mock: a ``FakeRank`` builds the same ``RankSnapshot`` the collector's state hands the evaluator
after each applied batch, so the evaluator's tests drive the real ``BuiltinAlerts``.
"""

from __future__ import annotations

from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals, ladder
from ampwatch.server.alerting.evaluator import BuiltinAlerts

__all__ = ["FakeRank", "KEPT_IN", "firing_names", "healthy_job", "names"]

KEPT_IN = {"iteration": "iteration", "backoffs": "backoffs", "growths": "growths", "origin_iterations": "origins",
           "conflicts": "conflicts", "steps": "steps", "skipped": "skipped", "scheduler_steps_after_skip": "scheduler",
           "poisoned_steps": "poisoned", "consecutive_skipped": "streak", "loss_scale": "scale",
           "on_suspect_device": "suspect", "loss_spikes": "loss_spikes", "grad_norm_spikes": "grad_norm_spikes",
           "gradient_outliers": "outliers"}
"""Each counter and gauge of ``ampwatch.contract.counters`` (but the streak ladder) -> the FakeRank attribute
that holds it (for :meth:`FakeRank.move` and :meth:`FakeRank.set`)."""


class FakeRank:
    """Counters of one rank driven like the agent would count them (not a mock: the evaluator's input)."""

    def __init__(self, alerts: BuiltinAlerts, run: str = "exp", rank: int = 0, scale: float = 65536.0) -> None:
        self.alerts, self.run, self.rank = alerts, run, rank
        self.iteration = self.backoffs = self.growths = 0
        self.scale = scale
        self.steps = self.skipped = self.streak = 0
        self.streaks = 0  # skip streaks begun
        self.reached: dict[int, int] = {}
        self.scheduler = self.poisoned = 0
        self.origins = 0  # skipped iterations this rank started (DDP's all-reduce hook)
        self.conflicts = 0  # processes the collector kept out of the rank
        self.suspect = 0  # 1 while the collector suspects the device the rank runs on
        self.loss_spikes = self.grad_norm_spikes = 0  # iterations whose loss, or gradient norm ("gen"), spiked
        self.outliers = 0  # the collector's gradient_outlier judgments of this rank
        self.closed = False

    def iterate(self, skipped: bool = False) -> None:
        """One training iteration of the single optimizer "gen" (a skip backs off the scale)."""
        self.iteration += 1
        if skipped:
            self.skipped += 1
            self.streak += 1
            self.streaks += self.streak == 1
            if self.streak in STREAK_LADDER:
                self.reached[self.streak] = self.reached.get(self.streak, 0) + 1
            self.backoffs += 1
            self.scale /= 2
        else:
            self.steps += 1
            self.streak = 0

    def move(self, name: str, by: int) -> None:
        """Raise the counter ``name`` of the contract by ``by``, and nothing else (what a condition form reads)."""
        setattr(self, KEPT_IN[name], getattr(self, KEPT_IN[name]) + by)

    def set(self, name: str, value: float) -> None:
        """Set the gauge ``name`` of the contract, and nothing else."""
        setattr(self, KEPT_IN[name], value)

    def snapshot(self, now: float) -> RankSnapshot:
        opt = OptimizerTotals(steps=self.steps, skipped=self.skipped, streaks=self.streaks,
                              streaks_reached=ladder(self.reached),
                              scheduler_steps_after_skip=self.scheduler, poisoned_steps=self.poisoned,
                              grad_norm_spikes=self.grad_norm_spikes)
        return RankSnapshot(run=self.run, rank=self.rank, last_seen=now, iteration=self.iteration,
                            loss_scale=self.scale, totals=RankTotals(backoffs=self.backoffs, growths=self.growths,
                                                                     origin_iterations=self.origins,
                                                                     loss_spikes=self.loss_spikes),
                            closed=self.closed, optimizers={"gen": opt}, consecutive_skipped={"gen": self.streak},
                            host=f"node-{self.rank // 8}", local_rank=self.rank % 8, conflicts=self.conflicts,
                            gradient_outliers=self.outliers,
                            device=f"node-{self.rank // 8}:{self.rank % 8}", on_suspect_device=self.suspect)

    def send(self, now: float) -> list:
        """Deliver a batch to the evaluator; return the transitions of this rank's alerts."""
        return self.alerts.observe(self.snapshot(now), now)


def healthy_job(alerts: BuiltinAlerts, size: int, run: str = "exp") -> list[FakeRank]:
    """Return ``size`` ranks of ``run`` at scale 2^20, each healthy past calibration and evaluated once."""
    ranks = [FakeRank(alerts, run=run, rank=r, scale=2.0 ** 20) for r in range(size)]
    for r in ranks:
        for _ in range(200):
            r.iterate()
        r.send(0.0)
    alerts.evaluate(0.5)
    return ranks


def names(alerts, *about: str) -> list[tuple[str, str, str]]:
    """Each alert as (name, status, severity), sorted: what a test compares.

    ``about``: only the alerts named, those a test is about; the others its ranks trip on the way (a streak's
    skips back the scale off too) are left out, so that an alert added to the contract breaks no test of another.
    """
    return sorted((a.name, a.status, a.labels.get("severity", "")) for a in alerts if not about or a.name in about)


def firing_names(alerts: BuiltinAlerts) -> set[str]:
    """The names of the alerts firing now."""
    return {a.name for a in alerts.firing()}
