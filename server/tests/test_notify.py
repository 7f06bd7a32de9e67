"""Alert notification delivery against real HTTP receivers on loopback: shapes, de-duplication, retries, bounds."""

from __future__ import annotations

import json
import time
from itertools import pairwise

import pytest

from ampwatch.server.alerting.alert import Alert
from ampwatch.server.alerting.notifications import Notifier, NotifyConfig, Target, parse_targets
from ampwatch.server.alerting.payloads import ZERO_TIME, rank_ranges, rfc3339
from ampwatch_support.patience import SETTLE_S, wait_until
from ampwatch_support.webhook_receiver import WebhookReceiver, free_port

# No grouping delay: a notification goes out as soon as the worker sees it (alerts queued meanwhile share it).
FAST = NotifyConfig(backoff_initial_s=0.05, backoff_max_s=0.2, timeout_s=2.0, give_up_after_s=20.0, group_wait_s=0,
                    group_interval_s=0)


def streak_alert(run: str = "exp-42", optimizer: str = "gen", at: float = 1_764_400_000.0) -> Alert:
    return Alert(name="AmpConsecutiveSkippedSteps",
                 labels={"run": run, "rank": "0", "optimizer": optimizer, "severity": "warning"},
                 annotations={"summary": f"Optimizer {optimizer} skipped 16 steps in a row", "description": "d",
                              "runbook_url": "https://example.invalid/docs/alerts.md#ampconsecutiveskippedsteps"},
                 starts_at=at, value=16.0)


def notifier_for(*targets: Target, config: NotifyConfig = FAST) -> Notifier:
    return Notifier(targets, config)


def wait_count(notifier: Notifier, target: Target, outcome: str, n: int) -> dict:
    """Wait until ``outcome`` reached ``n`` for ``target`` (the receiver records a POST before it answers)."""
    wait_until(lambda: notifier.counts()[(target.name, outcome)] >= n, every=0.01,
               what=lambda: f"{outcome} to reach {n}: {notifier.counts()}")
    return notifier.counts()


def test_a_webhook_target_gets_firing_then_resolved_in_alertmanagers_webhook_shape(receiver):
    alert = streak_alert()
    notifier = notifier_for(Target(kind="webhook", url=receiver.url + "/hook"),
                            config=FAST.__class__(**{**_fields(FAST), "external_url": "http://127.0.0.1:9457"}))
    try:
        notifier.submit([alert])
        receiver.wait_for(lambda reqs: len(reqs) == 1)
        notifier.submit([alert.resolved(alert.starts_at + 30)])
        got = receiver.wait_for(lambda reqs: len(reqs) == 2)
    finally:
        notifier.close()
    firing, resolved = (r["body"] for r in got)
    assert got[0]["path"] == "/hook" and got[0]["content_type"] == "application/json"
    assert firing["version"] == "4" and firing["status"] == "firing" and firing["receiver"] == "ampwatch"
    assert firing["groupLabels"] == {"alertname": "AmpConsecutiveSkippedSteps", "run": "exp-42"}
    assert firing["groupKey"] == '{}:{alertname="AmpConsecutiveSkippedSteps",run="exp-42"}'
    assert firing["commonLabels"] == {"alertname": "AmpConsecutiveSkippedSteps", "run": "exp-42", "rank": "0",
                                      "optimizer": "gen", "severity": "warning"}
    assert firing["commonAnnotations"] == dict(alert.annotations)
    assert firing["externalURL"] == "http://127.0.0.1:9457"
    (item,) = firing["alerts"]
    assert item["status"] == "firing" and item["endsAt"] == ZERO_TIME
    assert item["startsAt"] == rfc3339(alert.starts_at) == "2025-11-29T07:06:40.000Z"
    assert item["fingerprint"] == alert.fingerprint and item["labels"]["alertname"] == alert.name
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["endsAt"] == rfc3339(alert.starts_at + 30)


def _fields(config: NotifyConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_the_same_alert_state_is_sent_once_however_often_it_is_submitted(receiver):
    alert = streak_alert()
    target = Target(kind="webhook", url=receiver.url)
    with notifier_for(target) as notifier:
        for _ in range(5):
            notifier.submit([alert])
        receiver.wait_for(lambda reqs: len(reqs) == 1)
        notifier.submit([alert.resolved(alert.starts_at + 1)] * 3)
        receiver.wait_for(lambda reqs: len(reqs) == 2)
        # A new firing of the same alert (a new start) is a new state and is sent again.
        notifier.submit([streak_alert(at=alert.starts_at + 100)])
        receiver.wait_for(lambda reqs: len(reqs) == 3)
    # Closed (the with block): close() sends whatever is still due, so a repeated notification would be in.
    assert [r["body"]["status"] for r in receiver.requests] == ["firing", "resolved", "firing"]
    assert notifier.counts()[(target.name, "sent")] == 3


def test_a_failing_target_is_retried_with_growing_backoff_until_it_accepts(receiver):
    receiver.fail_next = 4
    target = Target(kind="webhook", url=receiver.url)
    with notifier_for(target) as notifier:
        notifier.submit([streak_alert()])
        receiver.wait_for(lambda reqs: len(reqs) == 1)
        counts = wait_count(notifier, target, "sent", 1)
    assert counts[(target.name, "failed")] == 4 and counts[(target.name, "sent")] == 1
    assert counts[(target.name, "dropped")] == 0
    gaps = [b - a for a, b in pairwise(receiver.attempts)]
    # Delay n is in [0.5, 1] x min(0.05 x 2^n, 0.2): each gap is at least its delay's least (a lower bound: a
    # loaded machine only stretches gaps), so a backoff that did not grow fails from the third gap on (0.1 s).
    assert len(gaps) == 4
    for n, gap in enumerate(gaps):
        assert gap >= 0.5 * min(0.05 * 2 ** n, 0.2) * 0.99, f"retry {n + 1} came {gap:.3f} s after the last: {gaps}"


def test_a_target_that_is_down_gets_the_notification_once_it_comes_up():
    port = free_port()
    target = Target(kind="slack", url=f"http://127.0.0.1:{port}/services/T000/B000/secret")
    with notifier_for(target) as notifier:
        notifier.submit([streak_alert()])
        wait_count(notifier, target, "failed", 2)  # connection refused for a while: several failed attempts
        with WebhookReceiver(port=port) as receiver:
            got = receiver.wait_for(lambda reqs: len(reqs) == 1)
    assert got[0]["path"] == "/services/T000/B000/secret"
    assert "AmpConsecutiveSkippedSteps" in got[0]["body"]["text"]
    assert target.name == f"slack:127.0.0.1:{port}"  # the secret path never becomes a label


def test_submit_returns_while_the_target_hangs(receiver):
    receiver.hold.clear()  # every request hangs until released
    target = Target(kind="webhook", url=receiver.url)
    notifier = notifier_for(target)
    try:
        notifier.submit([streak_alert(optimizer="o0")])
        assert receiver.arrived.wait(SETTLE_S)
        for i in range(1, 20):
            notifier.submit([streak_alert(optimizer=f"o{i}")])
        # Still hanging, yet every submit returned: ingest never waits for a target.
        assert not receiver.hold.is_set() and receiver.requests == []
    finally:
        receiver.hold.set()
        notifier.close()
    # The 19 that came while it hung share one notification with the one still firing (one group).
    first, rest = (r["body"]["alerts"] for r in receiver.requests)
    assert [a["labels"]["optimizer"] for a in first] == ["o0"]
    assert {a["labels"]["optimizer"] for a in rest} == {f"o{i}" for i in range(20)}


def test_the_queue_is_bounded_and_the_overflow_is_counted_as_dropped(receiver):
    receiver.hold.clear()
    target = Target(kind="alertmanager", url=receiver.url)  # webhook and Slack hold alerts in groups instead
    notifier = notifier_for(target, config=NotifyConfig(queue_size=5, backoff_initial_s=0.05, timeout_s=10.0))
    try:
        notifier.submit([streak_alert(optimizer="first")])
        assert receiver.arrived.wait(SETTLE_S)  # the first one is in flight, out of the queue
        notifier.submit([streak_alert(optimizer=f"o{i}") for i in range(49)])
        assert notifier.counts()[(target.name, "dropped")] == 44
        receiver.hold.set()
        got = receiver.wait_for(lambda reqs: len(reqs) == 2)
        wait_count(notifier, target, "sent", 6)
    finally:
        receiver.hold.set()
        notifier.close()
    # The oldest were dropped: the newest five follow the one that was in flight, in one post (with the first one
    # again: it still fires).
    first, rest = ({a["labels"]["optimizer"] for a in r["body"]} for r in got)
    assert first == {"first"} and rest == {"first"} | {f"o{i}" for i in range(44, 49)}
    assert notifier.counts()[(target.name, "sent")] == 6


def test_a_notification_is_given_up_after_its_time_and_counted_as_dropped(receiver):
    receiver.status = 503
    target = Target(kind="webhook", url=receiver.url)
    config = NotifyConfig(backoff_initial_s=0.02, backoff_max_s=0.05, give_up_after_s=0.5, group_wait_s=0,
                          group_interval_s=0)  # not the default 5 s group wait: the test is about giving up
    with notifier_for(target, config=config) as notifier:
        notifier.submit([streak_alert()])
        counts = wait_count(notifier, target, "dropped", 1)
    assert counts[(target.name, "dropped")] == 1 and counts[(target.name, "sent")] == 0
    assert counts[(target.name, "failed")] >= 3


def test_a_target_that_refuses_the_payload_is_not_retried(receiver):
    receiver.status = 400
    target = Target(kind="webhook", url=receiver.url)
    with notifier_for(target) as notifier:
        notifier.submit([streak_alert()])
        # Retried as if the target were down, it would be attempted again and again until give_up_after_s.
        wait_count(notifier, target, "dropped", 1)
    assert len(receiver.attempts) == 1 and notifier.counts()[(target.name, "dropped")] == 1


def test_an_alertmanager_target_reposts_firing_alerts_and_sends_the_end_when_resolved(receiver):
    target = Target(kind="alertmanager", url=receiver.url + "/")
    config = NotifyConfig(resend_interval_s=0.2, backoff_initial_s=0.05)
    alert = streak_alert(at=time.time())
    with notifier_for(target, config=config) as notifier:
        notifier.submit([alert])
        receiver.wait_for(lambda reqs: len(reqs) >= 4)  # the first post, then one every 0.2 s
        notifier.submit([alert.resolved(alert.starts_at + 2)])
        receiver.wait_for(lambda reqs: any(r["body"][0]["endsAt"] == rfc3339(alert.starts_at + 2) for r in reqs))
        after_resolve = len(receiver.requests)
        time.sleep(0.6)
        assert len(receiver.requests) == after_resolve  # nothing left firing: no more reposts
    first = receiver.requests[0]
    assert first["path"] == "/api/v2/alerts"
    (posted,) = first["body"]
    assert posted["labels"] == {"alertname": alert.name, **alert.labels}
    assert posted["annotations"] == dict(alert.annotations)
    assert posted["startsAt"] == rfc3339(alert.starts_at)
    # Firing: valid for 4 resend intervals ahead (as Prometheus does), so it never lapses between two posts.
    assert posted["endsAt"] >= rfc3339(alert.starts_at + 3 * config.resend_interval_s)


def test_slack_messages_escape_user_strings_so_a_run_id_cannot_ping_or_link(receiver):
    target = Target(kind="slack", url=receiver.url)
    alert = streak_alert(run="<!channel> & <http://evil|x>")
    alert = Alert(name=alert.name, labels=alert.labels, starts_at=alert.starts_at,
                  annotations={"summary": "run <!channel> & <http://evil|x>", "description": "d"})
    with notifier_for(target) as notifier:
        notifier.submit([alert])
        (got,) = receiver.wait_for(lambda reqs: len(reqs) == 1)
    body = got["body"]
    assert body["text"].startswith("[FIRING] AmpConsecutiveSkippedSteps (warning)")
    section = body["blocks"][0]["text"]["text"]
    assert "&lt;!channel&gt; &amp; &lt;http://evil|x&gt;" in section and "<!channel>" not in section


def test_every_target_gets_every_notification(receiver):
    with WebhookReceiver() as other:
        targets = [Target(kind="webhook", url=receiver.url), Target(kind="slack", url=other.url)]
        with notifier_for(*targets) as notifier:
            notifier.submit([streak_alert()])
            for t in targets:
                counts = wait_count(notifier, t, "sent", 1)
    assert {k: v for k, v in counts.items() if k[1] == "sent"} == {(t.name, "sent"): 1 for t in targets}


def test_close_gives_up_on_a_dead_target_within_its_timeout():
    target = Target(kind="webhook", url=f"http://127.0.0.1:{free_port()}")
    # Retries an hour apart: a close() that let the worker wait out its backoff would leave it alive when close()
    # returns (after the close timeout plus one HTTP timeout, here a generous one: connection refused is at once).
    config = NotifyConfig(backoff_initial_s=3600.0, backoff_max_s=3600.0, timeout_s=SETTLE_S, group_wait_s=0)
    notifier = notifier_for(target, config=config)
    notifier.submit([streak_alert()])
    wait_count(notifier, target, "failed", 1)  # the worker now waits out its first backoff
    notifier.close(timeout_s=0.5)
    assert not any(worker.is_alive() for worker in notifier._workers), "close() waited for the retry schedule"
    assert notifier.counts()[(target.name, "dropped")] == 1


def test_targets_parse_from_kind_url_entries_and_bad_entries_say_what_to_write():
    targets = parse_targets(["webhook:http://a:8080/hook, alertmanager:http://am:9093", "http://plain/x"])
    assert [(t.kind, t.url) for t in targets] == [("webhook", "http://a:8080/hook"),
                                                  ("alertmanager", "http://am:9093"), ("webhook", "http://plain/x")]
    assert targets[1].post_url == "http://am:9093/api/v2/alerts"
    assert Target(kind="webhook", url="http://user:pw@h:1/p").name == "webhook:h:1"
    assert parse_targets("") == () and parse_targets(None) == ()
    with pytest.raises(ValueError, match="unknown; use one of webhook, alertmanager, slack"):
        parse_targets("pagerduty:http://x")
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        parse_targets("slack:ftp://x")
    with pytest.raises(ValueError, match="must look like kind:url"):
        parse_targets("alertmanager")


def test_counts_list_every_target_and_outcome_even_before_anything_was_sent():
    target = Target(kind="webhook", url="http://127.0.0.1:9")
    with notifier_for(target) as notifier:
        assert notifier.counts() == {(target.name, o): 0 for o in ("sent", "failed", "dropped")}
    assert json.dumps(sorted(notifier.counts()))  # plain, serialisable keys for the metrics renderer


def test_a_notification_lists_numbered_ranks_as_ranges_and_other_rank_labels_after_them():
    assert rank_ranges(["3", "1", "2", "7", "node-b", "node-a", "2"]) == "1-3, 7, node-a, node-b"
    assert rank_ranges(["node-a"]) == "node-a" and rank_ranges([]) == ""
