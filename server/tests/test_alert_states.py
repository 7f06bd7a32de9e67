"""Alert states: pending, firing, resolved; each change announced once, per rank, and nothing kept once resolved."""

from __future__ import annotations

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank, firing_names, names


def test_an_unchanged_firing_alert_is_announced_once():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=0.25)
    r.iterate()
    r.send(0.0)
    changes = []
    for second in range(1, 300):
        changes += r.send(float(second)) + alerts.evaluate(float(second))
    assert names(changes) == [("AmpLossScaleCollapsed", "firing", "critical")]


def test_forgetting_an_expired_rank_resolves_its_alerts():
    alerts = BuiltinAlerts(T)
    r = FakeRank(alerts, scale=0.25)
    r.iterate()
    r.send(0.0)
    r.send(float(T.collapsed_for_s))
    assert firing_names(alerts) == {"AmpLossScaleCollapsed"}
    assert names(alerts.forget("exp", 0, now=100.0)) == [("AmpLossScaleCollapsed", "resolved", "critical")]
    assert alerts.evaluate(101.0) == []


def test_evaluating_one_rank_changes_only_its_alerts_and_nothing_stays_indexed_once_all_resolved():
    from ampwatch.server.alerting.rank_conditions import ActiveAlert
    from ampwatch.server.alerting.states import AlertStates

    def active(rank: int, name: str = "AmpConsecutiveSkippedSteps", for_s: float = 0.0) -> ActiveAlert:
        return ActiveAlert(name=name, labels={"run": "r", "rank": str(rank), "optimizer": "gen", "severity": "warning"},
                           value=16.0, for_s=for_s, annotations={})

    states = AlertStates()
    fired = [c for r in range(100) for c in states.advance([active(r)], 0.0, ("r", str(r)))]
    assert [a.labels["rank"] for a in fired] == [str(r) for r in range(100)]
    assert states.advance([active(3), active(3, "AmpHighSkippedStepRatio", for_s=60.0)], 0.5, ("r", "3")) == []
    # Rank 7 evaluated and clean: its alert resolves, no other rank's does.
    (gone,) = states.advance([], 1.0, ("r", "7"))
    assert (gone.labels["rank"], gone.ends_at) == ("7", 1.0) and len(states.firing()) == 99
    # Rank 3 evaluated with neither condition: its firing alert resolves and its pending one is dropped.
    assert [a.labels["rank"] for a in states.advance([], 2.0, ("r", "3"))] == ["3"]
    assert len(states.advance([], 3.0)) == 98  # everything evaluated, nothing holds
    assert states.firing() == [] and states._by_group == {} and states._pending == {}
