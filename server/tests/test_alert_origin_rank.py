"""The built-in AmpSkipOriginRank: a rank whose own gradients keep starting the run's skips fires, with its host and
local rank; skips started on many ranks blame the job, not a GPU."""

from __future__ import annotations

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank, names

ORIGIN = "AmpSkipOriginRank"


def _origin_run(alerts: BuiltinAlerts, size: int) -> list[FakeRank]:
    ranks = [FakeRank(alerts, rank=r) for r in range(size)]
    for r in ranks:
        r.iterate()
        r.send(0.0)
    return ranks


def test_a_rank_that_keeps_starting_skips_fires_with_its_host_and_local_rank_and_resolves_after_the_window():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 16)
    for k in range(T.origin_min_count):  # every rank skips (the all-reduce), rank 9's own gradients started it
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank == 9
            r.send(10.0 + k)
        transitions = alerts.evaluate(10.0 + k)
        assert names(transitions, ORIGIN) == ([(ORIGIN, "firing", "warning")] if k == T.origin_min_count - 1
                                              else [])
    fired = [a for a in alerts.firing() if a.name == ORIGIN]
    assert [dict(a.labels) for a in fired] == [{"run": "exp", "rank": "9", "host": "node-1", "local_rank": "1",
                                                "severity": "warning"}]
    assert fired[0].value == T.origin_min_count
    assert "host node-1, local rank 1" in fired[0].annotations["description"]
    for r in ranks:  # a rank's own batch does not resolve a run-wide judgement
        assert names(r.send(20.0), ORIGIN) == []
    later = 10.0 + T.origin_window_s + 60
    for r in ranks:
        r.iterate()
        r.send(later)
    assert names(alerts.evaluate(later), ORIGIN) == [(ORIGIN, "resolved", "warning")]


def test_skips_started_on_many_ranks_blame_the_job_not_a_gpu():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 4)
    for k in range(T.origin_min_count):
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank in (0, 1)  # two of four ranks: over origin_rank_share (a quarter)
            r.send(10.0 + k)
    assert names(alerts.evaluate(20.0), ORIGIN) == [] and names(alerts.firing(), ORIGIN) == []


def test_a_rank_that_started_fewer_skips_than_the_minimum_does_not_fire():
    alerts = BuiltinAlerts(T)
    ranks = _origin_run(alerts, 2)
    for k in range(T.origin_min_count - 1):
        for r in ranks:
            r.iterate(skipped=True)
            r.origins += r.rank == 1
            r.send(10.0 + k)
    assert names(alerts.evaluate(20.0), ORIGIN) == [] and names(alerts.firing(), ORIGIN) == []
