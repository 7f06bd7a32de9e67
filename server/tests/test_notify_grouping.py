"""Alert notifications grouped as Alertmanager groups them (by alert and run): one message for a whole-job storm,
later changes waiting for the group's interval, reminders every repeat interval; against real HTTP receivers."""

from __future__ import annotations

import time

import pytest

from ampwatch.server.alerting.alert import Alert
from ampwatch.server.alerting.notifications import Notifier, NotifyConfig, Target


def rank_alert(name: str, rank: int, run: str = "exp-42", at: float = 1_764_400_000.0) -> Alert:
    return Alert(name=name, labels={"run": run, "rank": str(rank), "severity": "warning"},
                 annotations={"summary": f"{name} on rank {rank}", "description": "d"}, starts_at=at, value=1.0)


STORM = ("AmpConsecutiveSkippedSteps", "AmpHighSkippedStepRatio", "AmpSchedulerStepsOnSkipped")


def test_a_whole_job_storm_is_one_notification_per_alert_and_run_listing_its_ranks_firing_then_resolved(receiver):
    webhook = Target(kind="webhook", url=receiver.url + "/hook")
    slack = Target(kind="slack", url=receiver.url + "/slack")
    config = NotifyConfig(group_wait_s=0.5, group_interval_s=1.0, timeout_s=10.0)
    # 3,072, as ranks cross at once: one evaluation's transitions, submitted together, so each group's first
    # notification lists all 1,024 ranks however slowly this machine queues them.
    alerts = [rank_alert(name, rank) for rank in range(1024) for name in STORM]
    with Notifier((webhook, slack), config) as notifier:
        notifier.submit(alerts)
        receiver.wait_for(lambda reqs: len(reqs) == 6)
        notifier.submit([a.resolved(a.starts_at + 60) for a in alerts])
        got = receiver.wait_for(lambda reqs: len(reqs) == 12)
    # Closed (the with block): close() sends every notification still due, so a wrongly repeated one would be in.
    assert len(receiver.requests) == 12
    hooks = [r["body"] for r in got if r["path"] == "/hook"]
    for status, bodies in (("firing", hooks[:3]), ("resolved", hooks[3:])):
        assert sorted(b["groupLabels"]["alertname"] for b in bodies) == sorted(STORM)
        for body in bodies:
            assert body["status"] == status and body["groupLabels"]["run"] == "exp-42"
            assert [a["labels"]["rank"] for a in body["alerts"]] == [str(r) for r in range(1024)]
            assert {a["status"] for a in body["alerts"]} == {status}
    texts = sorted(r["body"]["text"].splitlines()[0] for r in got if r["path"] == "/slack")
    assert texts[:3] == [f"[FIRING:1024] {name} in run exp-42: ranks 0-1023" for name in sorted(STORM)]
    assert texts[3:] == [f"[RESOLVED:1024] {name} in run exp-42: ranks 0-1023" for name in sorted(STORM)]


def test_a_groups_later_changes_wait_for_its_interval_and_go_out_together(receiver):
    target = Target(kind="webhook", url=receiver.url)
    config = NotifyConfig(group_wait_s=0.1, group_interval_s=1.0, timeout_s=10.0)
    with Notifier((target,), config) as notifier:
        submitted = time.monotonic()
        notifier.submit([rank_alert("AmpPoisonedStep", 0)])
        receiver.wait_for(lambda reqs: len(reqs) == 1)
        # Four more ranks and rank 0's end, right after the first notification; and another run (its own group).
        # Submitted together, so however slowly this machine submits they fall in one interval (that changes
        # submitted one by one within an interval join one notification is AlertGroups' logic, tested on its
        # clock in the test below).
        notifier.submit([rank_alert("AmpPoisonedStep", rank) for rank in range(1, 5)]
                        + [rank_alert("AmpPoisonedStep", 0).resolved(1_764_400_030.0),
                           rank_alert("AmpPoisonedStep", 7, run="other-run")])
        got = receiver.wait_for(lambda reqs: len(reqs) == 3)
    # Closed (the with block): close() sends every notification still due, so a split one would be in.
    assert len(receiver.requests) == 3
    first = got[0]
    later, other = sorted(got[1:], key=lambda r: r["body"]["groupLabels"]["run"])  # exp-42, other-run
    assert [a["labels"]["rank"] for a in first["body"]["alerts"]] == ["0"]
    assert [a["labels"]["rank"] for a in other["body"]["alerts"]] == ["7"] and other["body"]["status"] == "firing"
    # One notification for the group's four new ranks and rank 0's end, not before its interval.
    assert [(a["labels"]["rank"], a["status"]) for a in later["body"]["alerts"]] == \
        [("0", "resolved")] + [(str(r), "firing") for r in range(1, 5)]
    # The first went out after the group's wait, the second an interval after the first was sent: a lower bound.
    assert later["time"] - submitted >= config.group_wait_s + config.group_interval_s


def test_a_groups_changes_one_by_one_within_its_interval_go_out_together_an_interval_after_the_last_notification():
    from ampwatch.server.alerting.grouping import AlertGroups

    groups = AlertGroups(wait_s=5, interval_s=60)
    groups.add(rank_alert("AmpPoisonedStep", 0), now=0.0)
    assert len(groups.take_due(5.0)) == 1
    for rank, at in ((1, 6.0), (2, 30.0), (3, 64.9)):
        groups.add(rank_alert("AmpPoisonedStep", rank), now=at)
        assert groups.next_due() == 65.0 and groups.take_due(at) == []
    groups.add(rank_alert("AmpPoisonedStep", 0).resolved(1.0), now=64.9)
    (later,) = groups.take_due(65.0)
    assert [(a.labels["rank"], a.status) for a in later] == [("0", "resolved"), ("1", "firing"), ("2", "firing"),
                                                             ("3", "firing")]


def test_a_group_still_firing_with_nothing_new_is_sent_again_every_repeat_interval_and_changes_do_not_wait_for_it():
    from ampwatch.server.alerting.grouping import AlertGroups

    groups = AlertGroups(wait_s=5, interval_s=60, repeat_s=3600)
    ranks = lambda notifications: [[(a.labels["rank"], a.ends_at is None) for a in n] for n in notifications]  # noqa: E731
    groups.add(rank_alert("AmpPoisonedStep", 0), now=0.0)
    assert ranks(groups.take_due(5.0)) == [[("0", True)]]
    # Nothing new: no notification until the repeat interval, then the same group again, and again.
    assert groups.next_due() == 3605.0 and groups.take_due(3604.9) == []
    assert ranks(groups.take_due(3605.0)) == [[("0", True)]]
    assert ranks(groups.take_due(7205.0)) == [[("0", True)]]
    # A change goes out at the group interval, not at the repeat; the repeat then counts from it.
    groups.add(rank_alert("AmpPoisonedStep", 1), now=7210.0)
    assert groups.next_due() == 7265.0
    assert ranks(groups.take_due(7265.0)) == [[("0", True), ("1", True)]]
    assert groups.next_due() == 7265.0 + 3600
    # Once every alert of the group resolved and that was sent, nothing repeats.
    groups.add(rank_alert("AmpPoisonedStep", 0).resolved(1.0), now=7300.0)
    groups.add(rank_alert("AmpPoisonedStep", 1).resolved(1.0), now=7300.0)
    assert ranks(groups.take_due(7325.0)) == [[("0", False), ("1", False)]]
    assert groups.next_due() is None and len(groups) == 0
    # Closing sends what is new, never a reminder that is not due.
    groups.add(rank_alert("AmpPoisonedStep", 2), now=8000.0)
    groups.take_due(8005.0)
    assert groups.take_due(8006.0, everything=True) == []
    with pytest.raises(ValueError, match="repeat interval"):
        AlertGroups(wait_s=5, interval_s=60, repeat_s=0)


def test_the_notifier_reminds_a_webhook_of_a_group_that_keeps_firing(receiver):
    target = Target(kind="webhook", url=receiver.url)
    config = NotifyConfig(group_wait_s=0, group_interval_s=0, repeat_interval_s=0.2, timeout_s=10.0)
    with Notifier((target,), config) as notifier:
        notifier.submit([rank_alert("AmpPoisonedStep", 0), rank_alert("AmpPoisonedStep", 1)])
        got = receiver.wait_for(lambda reqs: len(reqs) >= 3)  # the first notification and two reminders
        notifier.submit([rank_alert("AmpPoisonedStep", r).resolved(1_764_400_030.0) for r in (0, 1)])
        receiver.wait_for(lambda reqs: any(r["body"]["status"] == "resolved" for r in reqs))
    for request in got[:3]:
        body = request["body"]
        assert body["status"] == "firing" and body["groupLabels"] == {"alertname": "AmpPoisonedStep",
                                                                      "run": "exp-42"}
        assert [a["labels"]["rank"] for a in body["alerts"]] == ["0", "1"]
    assert NotifyConfig().repeat_interval_s == 4 * 3600  # Alertmanager's default


def test_an_alert_that_resolves_before_its_group_is_announced_is_never_sent_resolved():
    from ampwatch.server.alerting.grouping import AlertGroups

    groups = AlertGroups(wait_s=5, interval_s=60)
    flap, stays = rank_alert("AmpLossScaleCollapsed", 0), rank_alert("AmpLossScaleCollapsed", 1)
    groups.add(flap, now=0.0)
    groups.add(flap.resolved(1.0), now=1.0)  # fired and resolved within the group's wait
    assert groups.next_due() is None and len(groups) == 0  # nothing left to say
    groups.add(flap, now=2.0)
    groups.add(stays, now=2.0)
    groups.add(flap.resolved(3.0), now=3.0)
    assert [[a.labels["rank"] for a in n] for n in groups.take_due(7.0)] == [["1"]]
    # Announced firing: its end is sent; a newcomer that flaps between two notifications is not.
    groups.add(rank_alert("AmpLossScaleCollapsed", 2), now=10.0)
    groups.add(rank_alert("AmpLossScaleCollapsed", 2).resolved(11.0), now=11.0)
    assert groups.next_due() == 7.0 + groups.repeat_s  # only the reminder: nothing new to send
    groups.add(stays.resolved(20.0), now=20.0)
    assert [[(a.labels["rank"], a.status) for a in n] for n in groups.take_due(67.0)] == [[("1", "resolved")]]
    assert len(groups) == 0


def test_a_webhook_never_hears_resolved_for_an_alert_it_was_never_told_was_firing(receiver):
    target = Target(kind="webhook", url=receiver.url)
    # A group wait no test outlives: the flap is decided by order alone; close() then sends what is due.
    config = NotifyConfig(group_wait_s=3600, group_interval_s=3600, timeout_s=10.0)
    flaps = [rank_alert("AmpLossScaleCollapsed", rank) for rank in range(190)]
    stays = rank_alert("AmpLossScaleCollapsed", 190)
    notifier = Notifier((target,), config)
    notifier.submit(flaps + [stays])
    notifier.submit([a.resolved(a.starts_at + 1.6) for a in flaps])
    notifier.close(timeout_s=30)
    (got,) = receiver.requests
    assert got["body"]["status"] == "firing"
    assert [(a["labels"]["rank"], a["status"]) for a in got["body"]["alerts"]] == [("190", "firing")]
    assert notifier.counts()[(target.name, "sent")] == 1
