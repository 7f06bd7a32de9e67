"""A rank's streak alert fires with its batch when the last pass found its run calm: ``alerting.early``'s table.

One test per row of the table (and what follows a row 6 alert). Time is driven by the tests: a job of 1 s
iterations whose ranks send a batch each second, a pass half a second after, never the machine's clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import pytest

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch.server.alerting.early import MARGIN_S
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import FakeRank, healthy_job

T = dataclasses.replace(DEFAULT_THRESHOLDS, skip_streak_window_s=60)
STREAK = "AmpConsecutiveSkippedSteps"


def _streaks(transitions: Iterable) -> list[tuple]:
    """(name, status, rank, severity, when) of the streak alerts and the run's storm among ``transitions``."""
    return [(a.name, a.status, a.labels.get("rank", ""), a.labels["severity"],
             a.starts_at if a.status == "firing" else a.ends_at)
            for a in transitions if a.name in (STREAK, "AmpRunSkipStorm")]


def _run(alerts: BuiltinAlerts, ranks: list[FakeRank], until: float, skips: Callable[[FakeRank, float], bool],
         passes: bool = True, start: float = 1.0) -> list[tuple]:
    """Each second from ``start`` to ``until``: every rank iterates once (skipping where ``skips(rank, now)``) and
    sends; a pass half a second later (``passes``). Return the streak and storm transitions."""
    transitions = []
    now = start
    while now <= until:
        for r in ranks:
            r.iterate(skipped=skips(r, now))
            transitions += r.send(now)
        if passes:
            transitions += alerts.evaluate(now + 0.5)
        now += 1.0
    return _streaks(transitions)


def test_row_6_a_lone_streak_in_a_calm_run_fires_with_the_batch_of_its_16th_skip():
    """Rank 2 of 4 skips from t=10 on: its 16th skip's batch (t=25) fires its warning, its 64th (t=73) its critical,
    each at once; the pass before each found the run calm and the streak 15 s old."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    changes = _run(alerts, ranks, 80.0, lambda r, now: r.rank == 2 and now >= 10)
    assert changes == [(STREAK, "firing", "2", "warning", 25.0), (STREAK, "firing", "2", "critical", 73.0)]


@pytest.mark.parametrize("offset, fired_at", [(0.0, 20.75), (0.25, 22.5)])
def test_row_6_holds_at_the_margin_and_row_5_just_inside_it(offset, fired_at):
    """Rank 1's streak's first batch at B, the pass that finds the run calm at P = 20.5: with B = P - MARGIN_S its
    16th skip's batch (t=20.75) fires it (row 6); with B a quarter second later that batch leaves it to the pass
    (row 5), which finds it at 21.5 and fires it at 22.5."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    ranks[1].iterate(skipped=True)
    changes = _streaks(ranks[1].send(20.5 - MARGIN_S + offset))
    for _ in range(14):
        ranks[1].iterate(skipped=True)
    changes += _streaks(ranks[1].send(20.0))  # 15 skips
    changes += _streaks(alerts.evaluate(20.5))
    ranks[1].iterate(skipped=True)
    changes += _streaks(ranks[1].send(20.75))  # the 16th
    changes += _streaks(alerts.evaluate(21.5) + alerts.evaluate(22.5))
    assert changes == [(STREAK, "firing", "1", "warning", fired_at)]


def test_row_5_a_streak_too_young_for_the_last_pass_waits_for_the_pass():
    """0.1 s iterations: rank 1's streak reaches 16 skips 1.5 s after it began, too soon for a pass to have seen
    the whole job's beginnings; its batch fires nothing, the second pass that finds it does."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    transitions = []
    for tenth in range(100, 130):  # t = 10.0 .. 12.9, a batch a tenth of a second (news as soon as it comes)
        now = tenth / 10
        ranks[1].iterate(skipped=True)
        transitions += ranks[1].send(now)
        if tenth % 10 == 5:
            transitions += alerts.evaluate(now)
    assert _streaks(transitions) == [(STREAK, "firing", "1", "warning", 12.5)]  # found at 11.5, fired at 12.5


def test_row_2_a_run_the_last_pass_has_not_seen_leaves_the_streak_to_the_pass():
    """A run whose ranks came after the last pass (here: no pass until t=30) has no verdict: rank 1's old streak
    reaching 16 fires nothing at its batch, but at the second pass that finds it."""
    alerts = BuiltinAlerts(T)
    ranks = [FakeRank(alerts, rank=r, scale=2.0 ** 20) for r in range(4)]
    for r in ranks:
        for _ in range(200):
            r.iterate()
    assert _run(alerts, ranks, 30.0, lambda r, now: r.rank == 1 and now >= 10, passes=False) == []
    assert _streaks(alerts.evaluate(30.5) + alerts.evaluate(31.5)) == [(STREAK, "firing", "1", "warning", 31.5)]


def test_row_3_a_storms_share_in_a_streak_at_the_last_pass_leaves_the_streak_to_the_pass():
    """Ranks 0 and 1 of 4 are in streaks when the pass looks (half the run: a storm's share of troubled ranks),
    but only rank 1's goes on to 16 (rank 0 steps every fourth iteration): no storm, and rank 1's alert fires at
    the second pass after its 16th skip, not with its batch."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    changes = _run(alerts, ranks, 30.0, lambda r, now: now >= 10 and (r.rank == 1 or (r.rank == 0 and now % 4)))
    assert changes == [(STREAK, "firing", "1", "warning", 26.5)]


@pytest.mark.parametrize("rank_3, fired_at", [("last", 21.5), ("first", 20.0)])
def test_row_3_streaks_begun_since_the_last_pass_count_as_troubled_once_their_news_is_in(rank_3, fired_at):
    """Rank 3 has been in a streak since t=5; at t=20 the other three begin one, the batch of rank 3's 16th skip
    lands in the same second.

    - ``last``: after the others' first news, a storm's share troubled since the pass: its batch fires nothing
      and the pass decides. Rank 3 alone holds the alert until the others reach 16, so the pass fires it at the
      second pass that found it (21.5).
    - ``first``: before any of the others' news, the edge the table leaves to the pass's judgement after the
      fact: its batch fires it (its streak is its own).

    Either way it resolves at the pass that finds the storm, which speaks for every rank."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    transitions = []
    for now in range(1, 40):
        for r in (ranks if rank_3 == "last" else reversed(ranks)):
            r.iterate(skipped=(r.rank == 3 and now >= 5) or now >= 20)
            transitions += r.send(float(now))
        transitions += alerts.evaluate(now + 0.5)
    assert _streaks(transitions) == [(STREAK, "firing", "3", "warning", fired_at),
                                     ("AmpRunSkipStorm", "firing", "", "warning", 35.5),
                                     (STREAK, "resolved", "3", "warning", 35.5)]


def test_row_3_ranks_holding_the_streak_alert_without_a_streak_count_as_troubled():
    """Rank 0's own streak (t=5 to 24) fired its alert with its 16th skip's batch, which holds its window on after
    the streak ended; rank 1 is in a streak from t=22. At the pass before rank 1's 16th skip, 2 of 4 ranks are
    troubled: rank 1's batch fires nothing, and the next pass finds both holding the alert, a storm, which speaks
    for both."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    changes = _run(alerts, ranks, 40.0, lambda r, now: (r.rank == 0 and 5 <= now < 25) or (r.rank == 1 and now >= 22))
    assert changes == [(STREAK, "firing", "0", "warning", 20.0), ("AmpRunSkipStorm", "firing", "", "warning", 37.5),
                       (STREAK, "resolved", "0", "warning", 37.5)]


def test_row_6_a_streak_that_reached_16_and_ended_between_two_batches_fires_with_the_batch_that_shows_it():
    """Rank 2's streak began at t=10; its 16th skip and the step that ended it come between the batches of t=24
    and t=25: the batch at t=25 shows no streak, but the ladder's rung 16 rose."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    transitions = []
    for now in range(1, 30):
        for r in ranks:
            if r.rank == 2 and now == 25:
                r.iterate(skipped=True)  # the 16th
            r.iterate(skipped=r.rank == 2 and 10 <= now < 25)
            transitions += r.send(float(now))
        transitions += alerts.evaluate(now + 0.5)
    assert ranks[2].streak == 0
    assert _streaks(transitions) == [(STREAK, "firing", "2", "warning", 25.0)]


def test_row_4_a_storms_edge_leaves_a_rank_still_skipping_to_the_pass():
    """Every rank skips 20 in a row at t=10 (a storm, which holds while their streaks' window lasts); rank 3 keeps
    skipping after. Once the storm resolved, rank 3's streak is old and few ranks are troubled, but a run-wide
    alert held its alert back within ``storm_edge_for_s``: the pass fires it after that wait, no batch sooner."""
    t = dataclasses.replace(T, skip_streak_critical=1024)  # rank 3 stays a warning
    alerts = BuiltinAlerts(t)
    ranks = healthy_job(alerts, 4)
    changes = _run(alerts, ranks, 30.0 + t.skip_streak_window_s + t.storm_edge_for_s + 10,
                   lambda r, now: 10 <= now < 30 or (r.rank == 3 and now >= 10))
    storm, over, own = changes
    assert storm[:2] == ("AmpRunSkipStorm", "firing") and over[:2] == ("AmpRunSkipStorm", "resolved")
    assert own[:3] == (STREAK, "firing", "3")
    # The pass before the storm resolved held it back last; a batch comes each second, so row 6 would be 1 s later.
    assert own[4] - (over[4] - 1.0) == pytest.approx(t.storm_edge_for_s)


def test_row_1_a_one_rank_run_fires_with_the_batch_whatever_its_streaks_age():
    alerts = BuiltinAlerts(T)
    (rank,) = healthy_job(alerts, 1)
    for _ in range(16):
        rank.iterate(skipped=True)
    assert _streaks(rank.send(10.0)) == [(STREAK, "firing", "0", "warning", 10.0)]


def test_a_row_6_alert_fired_while_a_pass_ran_is_not_resolved_by_that_pass_which_read_the_rank_before():
    """Rank 1 (of 40: the pass reads them in slices of 16) sends its 16th skip's batch while a pass pauses after
    its first slice, which held rank 1 at 15 skips. That pass does not resolve the alert the batch fired."""
    sent: list = []
    armed = [False]

    def pacer() -> Callable[[], None]:
        first = [True]

        def between() -> None:
            if first[0] and armed[0]:
                first[0] = armed[0] = False
                ranks[1].iterate(skipped=True)
                sent.extend(ranks[1].send(25.0))
        return between

    alerts = BuiltinAlerts(T, pacer=pacer)
    ranks: list[FakeRank] = []
    ranks += healthy_job(alerts, 40)
    transitions = []
    for now in range(1, 25):
        ranks[1].iterate(skipped=now >= 10)
        transitions += ranks[1].send(float(now))
        transitions += alerts.evaluate(now + 0.5)
    assert ranks[1].streak == 15
    armed[0] = True
    transitions += alerts.evaluate(25.5)  # rank 1's 16th skip arrives during it
    transitions += alerts.evaluate(26.5)
    assert _streaks(sent) == [(STREAK, "firing", "1", "warning", 25.0)]
    assert _streaks(transitions) == []  # neither that pass nor the next changed it
    assert {a.labels["rank"] for a in alerts.firing() if a.name == STREAK} == {"1"}


def test_a_rank_the_collector_forgot_is_first_seen_anew_so_its_streak_counts_as_young():
    """A rank expired (forgotten) mid-streak and back at t=21: the collector does not know when that streak began,
    and takes it for one begun then. Its 16th skip's batch (t=25) is too soon after (row 5); the first batch after
    a pass that started MARGIN_S after its return (25.5) fires it (row 6)."""
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    _run(alerts, ranks, 20.0, lambda r, now: r.rank == 1 and now >= 10)
    alerts.forget("exp", 1, 20.6)
    changes = _run(alerts, ranks, 30.0, lambda r, now: r.rank == 1, start=21.0)
    assert changes == [(STREAK, "firing", "1", "warning", 26.0)]
