"""Every declared alert, run through the built-in evaluator's two paths: neither drops it while it holds.

Each alert of ``ampwatch.contract.alerts`` has a scenario here that trips it on ranks that were quiet
(healthy past the longest window, so the periodic pass reads none of their windows). After the trip the
alert must fire (at the ingest that trips it when its ``for`` is 0 and it belongs to one rank, else at a
pass), and then stay firing while ranks keep sending heartbeats (the event path re-evaluates a rank at
each batch) and the pass runs every second: an evaluator that skips a rank whose declared counters moved,
or a condition that reads an undeclared counter, resolves it early and fails here. A new alert without a
scenario fails the first test.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from ampwatch.contract.alerts import ALERT_NAMES, ALERTS, AlertDefinition
from ampwatch.contract.conditions import Outside, Rose, RoseBy, Share
from ampwatch.contract.counters import COUNTERS, GAUGES
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import KEPT_IN, FakeRank

HEARTBEAT_S = 15.0


def _streak(ranks: list[FakeRank], now: float) -> list:
    r = ranks[0]
    for _ in range(T.skip_streak_warning):
        r.iterate(skipped=True)
    changes = r.send(now)
    r.iterate()  # the streak ends at once: the ladder keeps the alert up for its window
    return changes + r.send(now + 1)


def _storm(ranks: list[FakeRank], now: float) -> list:
    changes = []
    for r in ranks:  # every rank skips together, then the storm passes: the ladder keeps it for its window
        for _ in range(T.skip_streak_warning):
            r.iterate(skipped=True)
        r.scale *= 2 ** T.skip_streak_warning
        r.iterate()
        changes += r.send(now)
    return changes


def _backoff(ranks: list[FakeRank], now: float) -> list:
    changes = []
    for _ in range(T.backoff_min_count):  # every rank backs off, a skip apart, no growth
        for r in ranks:
            r.iterate(skipped=True)
            r.iterate()
            changes += r.send(now)
        now += 1
    return changes


def _collapsed(ranks: list[FakeRank], now: float) -> list:
    changes = []
    for r in ranks:  # one rank alone, or every rank of a job
        r.scale = T.collapsed_loss_scale / 2
        r.iterate()
        changes += r.send(now)
    return changes


def _desync(ranks: list[FakeRank], now: float) -> list:
    r = ranks[0]
    r.scale /= T.desync_scale_ratio * 2
    r.iterate()
    return r.send(now)


def _ratio(ranks: list[FakeRank], now: float) -> list:
    changes = []
    for batch in range(200):  # every other call skipped, over more calls than its healthy past in the window
        for r in ranks:  # one rank alone, or every rank of a job
            for i in range(10):
                r.iterate(skipped=i % 2 == 1)
            r.scale *= 2 ** 5  # its scale stays put: only the ratio is in play
            changes += r.send(now + batch / 10)
    return changes


def _silent(ranks: list[FakeRank], now: float) -> list:
    ranks[0].closed = False
    return []  # it just stops sending (see STOPS)


def _scheduler(ranks: list[FakeRank], now: float) -> list:
    r = ranks[0]
    r.iterate(skipped=True)
    r.scale *= 2
    r.scheduler += 1
    r.iterate()
    return r.send(now)


def _poisoned(ranks: list[FakeRank], now: float) -> list:
    r = ranks[0]
    r.poisoned += 1
    r.iterate()
    return r.send(now)


def _origin(ranks: list[FakeRank], now: float) -> list:
    r = ranks[2]
    r.origins += T.origin_min_count
    r.iterate()
    return r.send(now)


def _conflict(ranks: list[FakeRank], now: float) -> list:
    r = ranks[0]
    r.conflicts += 1
    r.iterate()
    return r.send(now)


def _suspect(ranks: list[FakeRank], now: float) -> list:
    r = ranks[1]
    r.suspect = 1  # the collector judged its device a suspect (docs/suspects.md)
    r.iterate()
    return r.send(now)


def _spikes(counter: str, share_of_ranks: float) -> Callable[[list[FakeRank], float], list]:
    """A loss or gradient-norm spike (``counter``) on ``share_of_ranks`` of the ranks at once: a one-rank job's (a
    per-rank alert that a run-wide one may speak for is decided at the ingest only in a run of one rank), or every
    rank's (a whole-job spike, for the run-wide form)."""
    def trip(ranks: list[FakeRank], now: float) -> list:
        changes = []
        for r in ranks[:max(1, round(len(ranks) * share_of_ranks))]:
            r.move(counter, 1)
            r.iterate()
            changes += r.send(now)
        return changes
    return trip


def _gradient_outlier(ranks: list[FakeRank], now: float) -> list:
    r = ranks[3]  # the collector judged rank 3's own gradient norm to stand out from the other three's
    r.outliers += 1
    r.iterate()
    return r.send(now)


def _form_trip(definition: AlertDefinition) -> Callable[[list[FakeRank], float], list]:
    """The trip of an alert that declares its condition, from its form: rank 0's counter rises by what the form
    asks (a share: its part, until it is that share of all the rank's calls), or its gauge falls below the floor."""
    c = definition.condition

    def trip(ranks: list[FakeRank], now: float) -> list:
        r = ranks[0]
        if isinstance(c, Rose):
            r.move(c.counter, 1)
        elif isinstance(c, RoseBy):
            r.move(c.counter, getattr(T, c.at_least))
        elif isinstance(c, Share):
            rest = getattr(r, KEPT_IN[c.rest])  # all of its rest: at least what rose within the window
            part = max(getattr(T, c.min_count), 1)
            while part / (part + rest) < getattr(T, c.at_least):
                part += max(rest, 1)
            r.move(c.part, part)
        elif isinstance(c, Outside):
            r.set(c.gauge, getattr(T, c.low) / 2)
        r.iterate()
        return r.send(now)
    return trip


# alert -> (how many ranks the run has, the trip, the ranks that stop sending at the trip); an alert that declares
# its condition runs its form's trip too (DERIVED).
SCENARIOS: dict[str, tuple[int, Callable[[list[FakeRank], float], list]]] = {
    "AmpConsecutiveSkippedSteps": (1, _streak),
    "AmpRunSkipStorm": (4, _storm),
    "AmpSustainedLossScaleBackoff": (2, _backoff),
    "AmpLossScaleCollapsed": (1, _collapsed),
    "AmpRunLossScaleCollapsed": (4, _collapsed),
    "AmpLossScaleDesync": (2, _desync),
    "AmpHighSkippedStepRatio": (1, _ratio),
    "AmpRunHighSkippedStepRatio": (3, _ratio),
    "AmpRankSilent": (2, _silent),
    "AmpSchedulerStepsOnSkipped": (1, _scheduler),
    "AmpPoisonedStep": (1, _poisoned),
    "AmpSkipOriginRank": (4, _origin),
    "AmpRankConflict": (1, _conflict),
    "AmpSuspectDevice": (2, _suspect),
    "AmpLossSpike": (1, _spikes("loss_spikes", 1.0)),
    "AmpRunLossSpike": (4, _spikes("loss_spikes", 1.0)),
    "AmpGradNormSpike": (1, _spikes("grad_norm_spikes", 1.0)),
    "AmpRunGradNormSpike": (4, _spikes("grad_norm_spikes", 1.0)),
    "AmpRankGradientOutlier": (4, _gradient_outlier),
}
DERIVED = {f"{d.name}, its form's trip": (d.name, (1, _form_trip(d))) for d in ALERTS.values() if d.condition}
STOPS = {"AmpRankSilent": {0}}
CASES = {**{name: (name, scenario) for name, scenario in SCENARIOS.items()}, **DERIVED}


def test_every_declared_alert_has_a_scenario():
    declared = {name for name, _ in DERIVED.values()}
    assert set(SCENARIOS) | declared == set(ALERT_NAMES), \
        "give each alert of ampwatch.contract.alerts that declares no condition a scenario here"
    assert set(SCENARIOS) <= set(ALERT_NAMES), "a scenario here for an alert the contract lacks"


def test_a_fake_rank_keeps_every_counter_and_gauge_a_condition_form_may_read():
    assert set(KEPT_IN) == {n for n, c in COUNTERS.items() if not c.ladder} | set(GAUGES)


def _quiet_ranks(alerts: BuiltinAlerts, n: int) -> tuple[list[FakeRank], float]:
    """``n`` ranks healthy for longer than the longest window, on one heartbeat, each with one optimizer."""
    ranks = [FakeRank(alerts, rank=i) for i in range(n)]
    now = 0.0
    for _ in range(int(alerts._layout.horizon_s / HEARTBEAT_S) + 4):
        now += HEARTBEAT_S
        for r in ranks:
            for _ in range(10):
                r.iterate()
            r.send(now)
    assert alerts.evaluate(now + 1) == [] and all(h.quiet(now + 1) for h in alerts._ranks.values())
    return ranks, now + 1


def _hold_s(name: str) -> float:
    """How long after the trip the alert must still fire: past its ``for`` and a minute into its window."""
    definition = ALERTS[name]
    window = getattr(T, definition.window) if definition.window else 600
    return definition.for_seconds(T) + min(window / 2, 120) + (T.silent_after_s if name == "AmpRankSilent" else 0)


@pytest.mark.parametrize("case", CASES)
def test_each_alert_fires_and_neither_the_event_path_nor_the_periodic_pass_drops_it_while_it_holds(case):
    name, (n, trip) = CASES[case]
    alerts = BuiltinAlerts(T, resolution_s=5.0)
    ranks, now = _quiet_ranks(alerts, n)
    at_ingest = [a for a in trip(ranks, now) if a.name == name]
    definition = ALERTS[name]
    if definition.for_field is None and definition.scope not in ("run", "host"):
        assert [a.status for a in at_ingest] == ["firing"], f"{name} did not fire at the ingest that tripped it"
    stops = STOPS.get(name, set())
    changes, started, beat = list(at_ingest), now, now
    while now < started + _hold_s(name):
        now += 1.0
        if now - beat >= HEARTBEAT_S:  # every rank still running sends its unchanged counters
            beat = now
            for r in ranks:
                if r.rank not in stops:
                    changes += [a for a in r.send(now) if a.name == name]
        changes += [a for a in alerts.evaluate(now) if a.name == name]
    assert "firing" in [a.status for a in changes], f"{name} never fired"
    assert [a for a in changes if a.status == "resolved"] == [], f"{name} was dropped while it held"
    assert name in {a.name for a in alerts.firing()}
    for alert in changes:  # labelled and described as its definition says, naming its run
        assert alert.labels["severity"] in {s.level for s in definition.severities}
        assert set(alert.annotations) == {"summary", "description", "runbook_url"}
        assert alert.labels["run"] in alert.annotations["description"], alert.annotations["description"]


def test_a_definition_that_names_an_unknown_counter_or_a_window_without_counters_is_refused():
    import dataclasses

    streak = ALERTS["AmpConsecutiveSkippedSteps"]
    with pytest.raises(ValueError, match="'skips' is not a counter of ampwatch.contract.counters.COUNTERS"):
        dataclasses.replace(streak, rises=("skips",))
    with pytest.raises(ValueError, match="a window needs counters"):
        dataclasses.replace(streak, rises=())
    with pytest.raises(ValueError, match="not all context"):
        dataclasses.replace(streak, context=("streaks_reached",))


def test_the_start_up_check_names_each_condition_missing_extra_in_both_registries_or_in_the_other_one():
    from ampwatch.server.alerting import rank_conditions, run_conditions
    from ampwatch.server.alerting.conditions import check_conditions

    rank, run = dict(rank_conditions.RANK_CONDITIONS), dict(run_conditions.RUN_CONDITIONS)
    written = {*rank_conditions.HAND_WRITTEN, *run_conditions.HAND_WRITTEN}
    check_conditions(rank, run, written)  # as the collector loads them: nothing to say
    silent, desync = rank["AmpRankSilent"], run["AmpLossScaleDesync"]
    cases = [
        (({**rank, "AmpNoSuchAlert": silent}, run, written), "missing: [], extra (no such alert): ['AmpNoSuchAlert']"),
        (({k: v for k, v in rank.items() if k != "AmpPoisonedStep"}, run, written),
         "missing: ['AmpPoisonedStep'], extra (no such alert): []"),
        (({**rank, "AmpLossScaleDesync": desync}, run, written), "in both: ['AmpLossScaleDesync']"),
        (({**rank, "AmpLossScaleDesync": desync}, {k: v for k, v in run.items() if k != "AmpLossScaleDesync"},
          written), "in both: [], in the other's registry: ['AmpLossScaleDesync']"),
        # A condition written by hand for an alert that declares its own, or for no alert at all.
        ((rank, run, written | {"AmpPoisonedStep"}),
         "missing: [], extra: [AmpPoisonedStep (its condition is declared)]"),
        ((rank, run, written | {"AmpNoSuchAlert"}), "missing: [], extra: [AmpNoSuchAlert (no such alert)]"),
    ]
    for args, says in cases:
        with pytest.raises(RuntimeError, match=re.escape(says)):
            check_conditions(*args)
