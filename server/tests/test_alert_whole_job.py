"""Whole-job events in the built-in evaluator: one run-wide alert each, from their first batches to their last.

A DDP job's ranks skip, back off and collapse together. The run-wide alerts (``speaks_for`` in
``ampwatch.contract.alerts``) then speak for the ranks' own alerts; a rank that stands out keeps its own.
Time is driven by the tests (passes every second, heartbeats every 15 s), never by the machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server.alerting.evaluator import BuiltinAlerts
from ampwatch_support.alert_ranks import healthy_job

HEARTBEAT_S = 15



def _changes(transitions: list, *names: str) -> list[tuple]:
    return [(a.name, a.status, a.labels.get("rank", ""), a.labels["severity"]) for a in transitions
            if not names or a.name in names]


def test_a_scale_that_stays_collapsed_after_the_storm_is_one_run_alert_and_never_one_per_rank():
    alerts = BuiltinAlerts(T)
    ranks = healthy_job(alerts, 4)
    transitions = []
    for r in ranks:  # 30 skips in a row on every rank: the scale falls from 2**20 to 2**-10
        for _ in range(30):
            r.iterate(skipped=True)
        transitions += r.send(10.0)
    now = 10.0
    # The gradients are finite again, but nothing restores the scale: it stays below 1 long after the storm's
    # window, as it does while growth_interval clean iterations pass at each doubling.
    while now < 10.0 + T.skip_streak_window_s + 300:
        now += 1.0
        if now % HEARTBEAT_S == 0:
            for r in ranks:
                for _ in range(2 * HEARTBEAT_S):
                    r.iterate()
                transitions += r.send(now)
        transitions += alerts.evaluate(now)
    assert ranks[0].scale == 2.0 ** -10
    assert _changes(transitions, "AmpRunSkipStorm", "AmpConsecutiveSkippedSteps", "AmpLossScaleCollapsed",
                    "AmpRunLossScaleCollapsed") == [
        ("AmpRunSkipStorm", "firing", "", "warning"), ("AmpRunLossScaleCollapsed", "firing", "", "critical"),
        ("AmpRunSkipStorm", "resolved", "", "warning")]
    assert {a.name for a in alerts.firing()} == {"AmpRunLossScaleCollapsed"}


def test_a_storm_of_many_minutes_is_one_run_skip_ratio_alert_and_a_rank_that_stands_out_keeps_its_own():
    alerts = BuiltinAlerts(T)
    job, other = healthy_job(alerts, 6), healthy_job(alerts, 4, run="other")
    transitions, now = [], 0.0
    # Every rank of the job skips one step in four for twelve minutes (never a streak); in the other run only
    # rank 1 does.
    while now < T.skip_ratio_for_s + 120:
        now += 1.0
        if now % 5 == 0:
            for r in job + other:
                for i in range(10):
                    r.iterate(skipped=i % 4 == 0 and (r.run == "exp" or r.rank == 1))
                r.scale = 2.0 ** 20  # only the ratio is in play
                transitions += r.send(now)
        transitions += alerts.evaluate(now)
    assert _changes(transitions, "AmpRunHighSkippedStepRatio", "AmpHighSkippedStepRatio") == [
        ("AmpRunHighSkippedStepRatio", "firing", "", "warning"),
        ("AmpHighSkippedStepRatio", "firing", "1", "warning")]
    fired = {a.name: a for a in alerts.firing()}
    assert fired["AmpRunHighSkippedStepRatio"].labels["run"] == "exp"
    assert fired["AmpHighSkippedStepRatio"].labels["run"] == "other"
    assert "100% of the ranks of run exp have an optimizer that skipped a share of at least 0.1" in \
        fired["AmpRunHighSkippedStepRatio"].annotations["description"]


def test_a_storms_edges_never_show_rank_alerts_and_a_rank_still_skipping_after_it_fires_once_it_is_over():
    t = dataclasses.replace(T, skip_streak_window_s=60)  # the storm lingers a minute, not ten
    alerts = BuiltinAlerts(t)
    ranks = healthy_job(alerts, 8)
    transitions = []
    # Its start: rank 0's batch comes a pass before the others' (alone in a streak at that pass).
    for r in ranks[:1]:
        for _ in range(20):
            r.iterate(skipped=True)
        transitions += r.send(10.0)
    transitions += alerts.evaluate(10.5)
    # The others' batches come three seconds apart: their streak windows end three seconds apart too, and once
    # ranks 0-4's have, ranks 5-7 are too few for a storm.
    for at, group in ((11.0, ranks[1:5]), (14.0, ranks[5:])):
        for r in group:
            for _ in range(20):
                r.iterate(skipped=True)
            transitions += r.send(at)
        transitions += alerts.evaluate(at + 0.5)
    for r in ranks[:7]:  # the job recovers, but rank 7 keeps skipping (its streak goes on past the window)
        r.iterate()
    now = 15.0
    while now < 14.0 + t.skip_streak_window_s + t.storm_edge_for_s + 20:
        now += 1.0
        if now % 5 == 0:
            for r in ranks:
                r.iterate(skipped=r.rank == 7)
                transitions += r.send(now)
        transitions += alerts.evaluate(now)
    changes = _changes(transitions, "AmpRunSkipStorm", "AmpConsecutiveSkippedSteps")
    assert changes == [("AmpRunSkipStorm", "firing", "", "warning"), ("AmpRunSkipStorm", "resolved", "", "warning"),
                       ("AmpConsecutiveSkippedSteps", "firing", "7", "warning")]
    storm_over = next(a.ends_at for a in transitions if a.name == "AmpRunSkipStorm" and a.status == "resolved")
    rank_7 = next(a.starts_at for a in transitions if a.name == "AmpConsecutiveSkippedSteps")
    # storm_edge_for_s after the last pass that held it back (the pass before the storm resolved), a second look on.
    assert t.storm_edge_for_s - 1 <= rank_7 - storm_over <= t.storm_edge_for_s + 2


def _stands_out(rank, at: float) -> list:
    """``rank`` alone skips 20 iterations in a row; return the transitions of its batch at ``at``."""
    for _ in range(20):
        rank.iterate(skipped=True)
    return rank.send(at)


def test_in_a_run_of_several_ranks_the_pass_alone_fires_and_resolves_a_ranks_own_streak_alert():
    """A rank's batch in a run of several ranks leaves the alerts a run-wide one may speak for to the pass (which
    reads the whole run): it neither fires nor resolves them, and does not even read them (but for a streak
    alert whose streak began well before the last pass, ``alerting.early``: here all 20 skips come in one batch).
    One rank that stands out with a streak fires at the second pass that finds it and resolves at the first pass
    after its streak's window, not at the batch that showed it over."""
    t = dataclasses.replace(T, skip_streak_window_s=60)
    alerts = BuiltinAlerts(t)
    ranks = healthy_job(alerts, 4)
    at_batches, at_passes = _stands_out(ranks[1], 10.0), []
    now = 10.0
    while now < 10.0 + t.skip_streak_window_s + 10:
        now += 1.0
        if now % 5 == 0:
            for r in ranks:
                r.iterate()
                at_batches += r.send(now)
        at_passes += alerts.evaluate(now + 0.5)
    assert _changes(at_batches, "AmpConsecutiveSkippedSteps") == []
    assert _changes(at_passes, "AmpConsecutiveSkippedSteps") == [
        ("AmpConsecutiveSkippedSteps", "firing", "1", "warning"), ("AmpConsecutiveSkippedSteps", "resolved", "1",
                                                                    "warning")]
    fired, resolved = at_passes[0].starts_at, at_passes[1].ends_at
    assert fired == 12.5  # the pass at 11.5 found it, the one at 12.5 fired it
    assert resolved - (10.0 + t.skip_streak_window_s) in (0.5, 1.5)  # the pass after its window, not a batch


def _sending_during_every_pass(t, size: int, sender: int) -> tuple[BuiltinAlerts, list, list, list[int]]:
    """A job of ``size`` ranks whose rank ``sender`` sends a batch during every pass (after its first slice of
    ranks, where the pass pauses); return the evaluator, the ranks, the transitions those batches made, and how
    many it sent (a list of one count). Each batch is sent at ``alerts.now``, which the test sets."""
    transitions: list = []
    ranks: list = []
    sent_during = [0]

    def sends() -> Callable[[], None]:  # what the pass calls between two slices, where it pauses
        first = [True]

        def between() -> None:
            if first[0] and ranks:  # (not while healthy_job() sets the job up)
                first[0] = False
                sent_during[0] += 1
                ranks[sender].iterate()
                transitions.extend(ranks[sender].send(alerts.now))
        return between

    alerts = BuiltinAlerts(t, pacer=sends)
    ranks += healthy_job(alerts, size)
    return alerts, ranks, transitions, sent_during


def test_a_rank_whose_batches_land_during_every_pass_still_gets_its_own_alert_fired_and_resolved_by_the_pass():
    """A pass keeps what a batch observed meanwhile decided, as that batch saw newer data; but a batch of a run of
    several ranks decides nothing about the alerts a run-wide one may speak for, so for those the pass's
    judgement stands. Rank 1 (of 130: the pass reads them in slices) sends a batch after the first slice of
    every pass; its streak alert still fires at the second pass and resolves once the window is over."""
    t = dataclasses.replace(T, skip_streak_window_s=60)
    alerts, ranks, transitions, sent_during = _sending_during_every_pass(t, 130, sender=1)
    transitions += _stands_out(ranks[1], 10.0)
    now, passes = 10.0, 0
    while now < 10.0 + t.skip_streak_window_s + 10:
        now += 1.0
        alerts.now = now + 0.5
        transitions += alerts.evaluate(now + 0.5)
        passes += 1
    assert sent_during[0] == passes  # rank 1's batch came during every pass
    changes = [(a.status, a.starts_at if a.status == "firing" else a.ends_at) for a in transitions
               if a.name == "AmpConsecutiveSkippedSteps"]
    assert [status for status, _ in changes] == ["firing", "resolved"]
    assert changes[0][1] == 12.5 and changes[1][1] - (10.0 + t.skip_streak_window_s) in (0.5, 1.5)


def test_a_pending_alert_whose_rank_sends_during_every_pass_ends_when_the_pass_no_longer_finds_it():
    """The pass alone judges the alerts a run-wide one may speak for, also on a rank observed while it ran: one
    that goes pending and stops holding is no longer pending, so a second short collapse waits its whole ``for``
    again. Rank 1 (of 130: the pass reads them in slices) sends during every pass; its scale collapses twice
    for 10 s, 40 s apart, each shorter than ``collapsed_for_s``: no alert."""
    alerts, ranks, transitions, sent_during = _sending_during_every_pass(T, 130, sender=1)
    collapsed = ((10.0, 20.0), (10.0 + T.collapsed_for_s + 10, 20.0 + T.collapsed_for_s + 10))
    now = 0.0
    while now < 100.0:
        now += 1.0
        ranks[1].scale = 0.5 if any(start <= now < end for start, end in collapsed) else 2.0 ** 20
        alerts.now = now + 0.5
        transitions += alerts.evaluate(now + 0.5)
    assert sent_during[0] == 100  # rank 1's batch came during every pass
    assert _changes(transitions) == []
    # Held long enough, the same collapse fires: the alert is judged, and pending, at all.
    ranks[1].scale = 0.5
    while now < 100.0 + T.collapsed_for_s + 5:
        now += 1.0
        alerts.now = now + 0.5
        transitions += alerts.evaluate(now + 0.5)
    assert _changes(transitions) == [("AmpLossScaleCollapsed", "firing", "1", "critical")]


def test_a_pending_alert_a_storm_held_back_on_a_rank_sending_during_every_pass_waits_its_whole_for_after_it():
    """Rank 1's scale collapses alone (its alert goes pending), then the whole job's does (the run-wide alert speaks
    for it: the pass no longer finds rank 1's own), then the job recovers but rank 1 does not. Rank 1 sends during
    every pass. Its own alert fires once the storm's edge is over and it held for its whole ``collapsed_for_s``
    again, not at once on the strength of its pending from before the storm."""
    alerts, ranks, transitions, sent_during = _sending_during_every_pass(T, 130, sender=1)
    ranks[1].scale = 0.5
    now = 0.0
    while now < 200.0:
        now += 1.0
        if now % 5 == 0:
            for r in ranks:
                if r.rank != 1:  # the job's scale collapses at 20 s, and is restored at 60 s
                    r.scale = 0.5 if 20.0 <= now < 60.0 else 2.0 ** 20
                    r.iterate()
                    transitions += r.send(now)
        alerts.now = now + 0.5
        transitions += alerts.evaluate(now + 0.5)
    assert sent_during[0] == 200  # rank 1's batch came during every pass
    assert _changes(transitions) == [("AmpRunLossScaleCollapsed", "firing", "", "critical"),
                                     ("AmpRunLossScaleCollapsed", "resolved", "", "critical"),
                                     ("AmpLossScaleCollapsed", "firing", "1", "critical")]
    _, storm_over, rank_1 = transitions
    held_last = storm_over.ends_at - 1.0  # the pass before the storm resolved (passes are a second apart)
    assert T.storm_edge_for_s + T.collapsed_for_s <= rank_1.starts_at - held_last <= \
        T.storm_edge_for_s + T.collapsed_for_s + 2  # its edge, a second look, then its whole for


# Closed ranks count in a storm's share (ranks of the run holding the per-rank alert / ranks of the run), as their
# alerts do within a window; every case here is also a promtool case (run_skip_storm.test.yaml).
# (case, ranks, who skips 20 in a row at 10 s, who closes when, who keeps skipping) -> storm or per-rank alerts
STORM_SHARE_CASES = {
    # Every rank closes mid-storm: the storm stays until the streaks' window is over, and no rank fires its own.
    "a job that ends in a storm": (4, range(4), {r: 12.0 for r in range(4)}, ()),
    # Three of four finish mid-streak, the fourth keeps skipping: every rank of the run is still in a streak.
    "ranks closing mid-streak": (4, range(4), {0: 12.0, 1: 12.0, 2: 12.0}, (3,)),
    # Two of five in a streak, the three others healthy and finished: 40% of the run is no storm.
    "healthy ranks that finished": (5, range(2), {2: 5.0, 3: 5.0, 4: 5.0}, ()),
}


@pytest.mark.parametrize("case", STORM_SHARE_CASES)
def test_a_storms_share_counts_the_ranks_that_closed_as_their_alerts_do(case):
    size, skipping, closing, still_skipping = STORM_SHARE_CASES[case]
    t = dataclasses.replace(T, skip_streak_window_s=60)
    alerts = BuiltinAlerts(t)
    ranks = healthy_job(alerts, size)
    transitions, now = [], 0.0
    while now < 10.0 + t.skip_streak_window_s + t.storm_edge_for_s + 20:
        now += 1.0
        for r in ranks:
            if r.closed:
                continue
            if now == 10.0 and r.rank in skipping:
                for _ in range(20):
                    r.iterate(skipped=True)
            elif now % 5 == 0 or now == closing.get(r.rank):
                for _ in range(1 if r.rank in still_skipping else 5):  # one slow iteration, skipped
                    r.iterate(skipped=r.rank in still_skipping)
            else:
                continue
            r.closed = now == closing.get(r.rank)
            transitions += r.send(now)
        transitions += alerts.evaluate(now + 0.5)
    assert all(r.closed == (r.rank in closing) for r in ranks)
    changes = _changes(transitions, "AmpRunSkipStorm", "AmpConsecutiveSkippedSteps")
    if case == "healthy ranks that finished":
        assert changes == [("AmpConsecutiveSkippedSteps", "firing", "0", "warning"),
                           ("AmpConsecutiveSkippedSteps", "firing", "1", "warning"),
                           ("AmpConsecutiveSkippedSteps", "resolved", "0", "warning"),
                           ("AmpConsecutiveSkippedSteps", "resolved", "1", "warning")]
        return
    # The storm lasts the closed ranks' window (their streaks hold that long), then resolves; a rank still skipping
    # then stands out, and fires its own once the storm's edge is over. No other rank ever fires its own.
    assert changes == [("AmpRunSkipStorm", "firing", "", "warning"), ("AmpRunSkipStorm", "resolved", "", "warning"),
                       *[("AmpConsecutiveSkippedSteps", "firing", str(r), "warning") for r in still_skipping]]
    storm = [a for a in transitions if a.name == "AmpRunSkipStorm"]
    assert storm[1].value == 1.0  # its last share: every rank of the run, the closed ones too
    assert storm[0].starts_at == 10.5 and storm[1].ends_at - 10.0 in (t.skip_streak_window_s + 0.5,
                                                                       t.skip_streak_window_s + 1.5)

