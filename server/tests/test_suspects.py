"""GET /v1/suspects on a real collector process: every row of docs/suspects.md's table, the three scenarios of
issue 39 at the batch level, and the evidence kept across a restart and pruned by age and count."""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from ampwatch_support.batches import make_batch, optimizer, post_batch, samples, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import wait_until
from ampwatch_support.skipping_jobs import SkippingJobs, unique
from ampwatch_support.webhook_receiver import WebhookReceiver


def suspects(url: str, run: str | None = None) -> dict:
    query = "?" + urllib.parse.urlencode({"run": run}) if run else ""
    with urllib.request.urlopen(url + "/v1/suspects" + query, timeout=10) as answer:
        return json.load(answer)


def judged(job: SkippingJobs, run: str | None = None) -> dict:
    """The suspects once the collector judged every row posted so far (its answer may be 2 s old)."""
    wait_until(lambda: suspects(job.url)["evidence_rows"] == job.rows, what=f"{job.rows} evidence rows judged")
    return suspects(job.url, run)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Iterator[SkippingJobs]:
    db = str(tmp_path_factory.mktemp("suspects") / "ampwatch.db")
    with CollectorProcess(db) as collector:
        job = SkippingJobs(collector.url)
        job.data_scenario()
        job.device_scenario()
        _calibration_and_whole_job_scenario(job)
        _table_cases(job)
        yield job


def _calibration_and_whole_job_scenario(job: SkippingJobs) -> None:
    # A fresh scale at 2^16 backing off on every rank: calibration, rank 2 flagged the origin each time and
    # "warm" is in its batch every time, on rank 2 and rank 3 (rule 1: evidence of nothing).
    for iteration in range(3):
        job.skip_everywhere("calibration", iteration, 4, "cal-host", origins={2}, calibration=True,
                            ids={2: ["warm", f"cal-{iteration}"], 3: ["warm", f"cal3-{iteration}"]})
    # Then three overflows on every rank at once, each rank's own samples: a whole-job overflow (rule 4).
    for iteration in (40, 80, 120):
        job.skip_everywhere("calibration", iteration, 4, "cal-host", origins={0, 1, 2, 3},
                            ids={r: unique(f"whole-{iteration}-r{r}") for r in range(4)})


def _table_cases(job: SkippingJobs) -> None:
    # Rule 3: no ddp=, only rank 3 of 4 reported skips (its own scaler overflowed): the origin set is rank 3.
    for iteration in (5, 6, 7):
        job.post("noflag-one", 3, [skip_event(0, iteration=iteration, samples=samples(unique(f"nf-{iteration}")))],
                 world_size=4, host="noflag-host")
    # Rule 5: two overflows where every rank's own gradients overflowed, the same two ids on ranks 0 and 1 in both.
    for iteration in (5, 6):
        job.skip_everywhere("whole-flagged", iteration, 2, "wf-host", origins={0, 1},
                            ids={0: ["wf-a", f"wf-{iteration}"], 1: ["wf-b", f"wf1-{iteration}"] if iteration == 5
                                 else ["wf-a", f"wf1-{iteration}"]})
    # Rule 3 + 4: no ddp=, every rank reported: no single origin.
    for iteration in (5, 6, 7):
        job.skip_everywhere("noflag-all", iteration, 4, "noflag-all-host", origins=None,
                            ids={r: unique(f"nfa-{iteration}-r{r}") for r in range(4)})
    # Rule 4: two origin ranks each time, above --suspect-max-origins 1.
    for iteration in (5, 6, 7):
        job.skip_everywhere("two-origins", iteration, 4, "two-host", origins={1, 2},
                            ids={r: unique(f"two-{iteration}-r{r}") for r in range(4)})
    # Rule 5: a one-rank job: its rank is the whole run.
    for iteration in (5, 6, 7):
        job.skip_everywhere("alone", iteration, 1, "alone-host", origins={0}, ids={0: unique(f"alone-{iteration}")})
    # Rule 6, second clause: every rank fed the same two ids in one iteration, no ddp=: one event, no suspect.
    job.skip_everywhere("same-batch", 9, 2, "same-host", origins=None, ids=dict.fromkeys((0, 1), ["dup-1", "dup-2"]))
    # Rule 12: a bad sample on three devices, a batch-mate of it on a second device once more; and a faulty
    # device (rank 1, four different batches) that once trained on an id another rank's one event also had.
    for iteration, (rank, ids) in enumerate([(0, ["bm-bad", "bm-mate"]), (1, ["bm-bad", "bm-1"]),
                                             (2, ["bm-bad", "bm-2"]), (3, ["bm-mate", "bm-3"])]):
        job.skip_everywhere("batch-mates", iteration, 4, "bm-host", origins={rank}, ids={rank: ids})
    for iteration, (rank, ids) in enumerate([(1, ["fm-shared", "fm-a"]), (1, ["fm-b"]), (1, ["fm-c"]), (1, ["fm-d"]),
                                             (2, ["fm-shared", "fm-e"])]):
        job.skip_everywhere("faulty-mates", iteration, 4, "fm-host", origins={rank}, ids={rank: ids})
    # Rule 7: sole origin three times, without samples.
    for iteration in (5, 6, 7):
        job.skip_everywhere("no-samples", iteration, 2, "nosamples-host", origins={1})
    # Rule 9: K - 1 events with different samples.
    for iteration in (5, 6):
        job.skip_everywhere("too-few", iteration, 2, "few-host", origins={1}, ids={1: unique(f"few-{iteration}")})
    # Rule 10: routine overflows spread over a job: each of 4 ranks the sole origin of 3 events; and in another
    # run, one rank 9 times beside three ranks 3 times each (9 >= 3 x 3: it stands out).
    for spread, counts in (("spread", [3, 3, 3, 3]), ("stands-out", [9, 3, 3, 3])):
        iteration = 0
        for rank, count in enumerate(counts):
            for _ in range(count):
                iteration += 1
                job.skip_everywhere(spread, iteration, 4, f"{spread}-host", origins={rank},
                                    ids={rank: unique(f"{spread}-{iteration}")})
    # Rule 11: the same batch, three times, on one device.
    for iteration in (5, 6, 7):
        job.skip_everywhere("same-digest", iteration, 2, "digest-host", origins={1}, ids={1: ["again-1", "again-2"]})
    # Not the first of a streak: kept out of the evidence (a streak's 2nd, 4th skip go on from its first).
    job.post("streak", 1, [skip_event(0, iteration=i, streak=s, origin=True, samples=samples(unique(f"st-{i}")))
                           for i, s in ((1, 1), (2, 2), (4, 4))], world_size=2, host="streak-host")


def names(body: dict) -> tuple[list[str], list[Any]]:
    return [d["device"] for d in body["devices"]], [s["id"] for s in body["samples"]]


def test_a_sample_that_overflows_on_several_devices_is_a_suspect_and_no_device_is(job):
    body = judged(job, "data")
    assert names(body) == ([], ["bad"])
    bad = body["samples"][0]
    assert bad["devices"] == ["data-host:0", "data-host:1", "data-host:2"]
    assert bad["runs"] == ["data"] and bad["events"] == 5
    assert [i["iteration"] for i in bad["iterations"]] == [7, 107, 207, 307, 407]
    assert {r["rank"] for r in bad["ranks"]} == {0, 1, 2}


def test_a_device_that_was_the_sole_origin_on_different_samples_over_two_runs_is_a_suspect_and_no_sample_is(job):
    body = judged(job, "device-b")
    assert names(body) == (["GPU-faulty"], [])
    device = body["devices"][0]
    assert (device["host"], device["local_rank"], device["pci_bus_id"], device["index"]) == \
        ("dev-host", 1, "0000:3b:00.0", 1)
    assert device["runs"] == ["device-a", "device-b"] and device["events"] == 4 and len(device["digests"]) == 4
    assert device["ranks"] == [{"run": "device-a", "rank": 1}, {"run": "device-b", "rank": 1}]
    assert len(device["evidence"]) == 4 and all(e["samples"]["count"] == 4 for e in device["evidence"])


def test_calibration_and_whole_job_overflows_make_no_suspect_at_all(job):
    assert names(judged(job, "calibration")) == ([], [])


@pytest.mark.parametrize("run, expected", [
    ("noflag-one", (["noflag-host:3"], [])),     # rule 3: without flags, the ranks that reported
    ("noflag-all", ([], [])),                    # rules 3 + 4: every rank reported
    ("two-origins", ([], [])),                   # rule 4: more origins than --suspect-max-origins
    ("alone", ([], [])),                         # rule 5: the whole run
    ("whole-flagged", ([], [])),                 # rule 5: every rank's own overflow, no sample's
    ("same-batch", ([], [])),                    # rule 6: two devices, one event
    ("no-samples", ([], [])),                    # rule 7: no ids, no evidence
    ("too-few", ([], [])),                       # rule 9: K - 1
    ("spread", ([], [])),                        # rule 10: spread over the job
    ("stands-out", (["stands-out-host:0"], [])),  # rule 10: 9 against a median of 3
    ("same-digest", ([], [])),                   # rule 11: one digest K times
    ("batch-mates", ([], ["bm-bad"])),            # rule 12: the bad sample takes its events, its batch-mate none
    ("faulty-mates", (["fm-host:1"], [])),        # rule 12: the faulty device's own events explain the shared id
])
def test_each_rule_of_the_table_decides_its_case(job, run, expected):
    assert names(judged(job, run)) == expected


def test_a_device_without_samples_shows_its_origin_events_but_is_no_suspect(job):
    counts = {d["device"]: d["origin_events"] for d in judged(job)["origin_events"]}
    assert counts["nosamples-host:1"] == 3 and "nosamples-host:0" not in counts


def test_only_the_first_event_of_a_streak_is_kept_as_evidence(job):
    # job.rows counts streak-1 events only; judged() waits until the collector holds exactly that many.
    assert judged(job)["evidence_rows"] == job.rows


def test_the_settings_are_in_the_answer(job):
    assert judged(job)["settings"] == {"events": 3, "max_origins": 1, "stand_out_ratio": 3.0}


def test_the_events_api_returns_began_samples_samples_before_and_calibration(job):
    began = {"loss_finite": True, "stage": "backward", "param": "fc.weight", "module": "fc", "module_type": "Linear"}
    before = [{"iteration": 3, "samples": samples([5, 6])}]
    job.post("fields", 0, [skip_event(0, iteration=4, began=began, samples=samples([7, "x"]), samples_before=before,
                                      calibration=True)], world_size=1, host="fields-host")
    with urllib.request.urlopen(job.url + "/v1/runs/fields/events?kind=skip", timeout=10) as answer:
        event = json.load(answer)["events"][0]
    assert event["began"] == dict(began, probe=None)  # a field the agent left out reads back as null
    assert event["samples"] == samples([7, "x"])
    assert event["samples_before"] == before and event["calibration"] is True
    with urllib.request.urlopen(job.url + "/v1/runs/fields/events/latest", timeout=10) as answer:
        rows = json.load(answer)["rows"]
    shown = [(r["event"]["began"], r["event"]["samples"]) for r in rows]
    assert shown == [(dict(began, probe=None), samples([7, "x"]))]


def test_the_evidence_survives_a_restart_and_goes_by_age_and_by_count(tmp_path):
    db = str(tmp_path / "ampwatch.db")
    collector = CollectorProcess(db).start()
    try:
        job = SkippingJobs(collector.url)
        old = time.time() - 2 * 86400
        for iteration in (1, 2):  # two days old
            job.skip_everywhere("old", iteration, 2, "old-host", origins={1}, ids={1: unique(f"old-{iteration}")},
                                time=old)
        for iteration in (1, 2):  # an hour old
            job.skip_everywhere("older", iteration, 2, "older-host", origins={1},
                                ids={1: unique(f"older-{iteration}")}, time=time.time() - 3600)
        for iteration in (1, 2, 3, 4):
            job.skip_everywhere("kept", iteration, 2, "kept-host", origins={1}, ids={1: unique(f"kept-{iteration}")})
        body = judged(job)
        assert names(body) == (["kept-host:1"], [])
        assert {d["device"] for d in body["origin_events"]} == {"kept-host:1", "older-host:1", "old-host:1"}
        # Restarted (it prunes at start) keeping a day: the two-day-old rows go, the rest stay.
        for args, rows, devices in ((["--suspect-retention-days", "1"], 12, {"kept-host:1", "older-host:1"}),
                                    (["--suspect-max-rows", "8"], 8, {"kept-host:1"})):  # then the 8 newest
            collector.kill(signal.SIGKILL)
            collector = CollectorProcess(db, port=collector.port, args=args).start()
            job.rows = rows
            body = judged(job)
            assert names(body) == (["kept-host:1"], [])
            assert {d["device"] for d in body["origin_events"]} == devices
    finally:
        collector.kill(signal.SIGTERM)


def test_the_streak_alert_notification_says_where_the_skip_began_and_on_which_samples(tmp_path):
    with WebhookReceiver() as receiver:
        hooks = f"webhook:{receiver.url}/hook,slack:{receiver.url}/slack"
        with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--webhook", hooks, "--notify-group-wait", "0"]) \
                as collector:
            began = {"loss_finite": True, "stage": "backward", "param": "blocks.3.fc.weight", "module": "blocks.3.fc",
                     "module_type": "Linear"}
            before = [{"iteration": 38, "samples": samples([7, 8, 9, 10, 11])},
                      {"iteration": 39, "samples": samples(["a"])}]
            skip = skip_event(1, iteration=40, began=began, samples=samples(list(range(100, 140))),
                              samples_before=before)
            post_batch(collector.url, make_batch(run="notified", iteration=55, events=[skip], optimizers={
                "gen": optimizer(steps=40, skipped=16, consecutive=16, longest=16, streaks=1)}))
            sent = receiver.wait_for(lambda got: {r["path"] for r in got} >= {"/hook", "/slack"})
    hook = next(r["body"] for r in sent if r["path"] == "/hook")
    streak = next(a for a in hook["alerts"] if a["labels"]["alertname"] == "AmpConsecutiveSkippedSteps")
    assert streak["annotations"]["began"] == "backward in blocks.3.fc (Linear), at blocks.3.fc.weight"
    digest = samples(list(range(100, 140)))["digest"]
    assert streak["annotations"]["samples"] == f"100, 101, 102, 103, 104, 105, 106, 107 … 40 in all (digest {digest})"
    assert streak["annotations"]["samples_before"] == "iteration 38: 7, 8, 9, 10 … 5 in all; iteration 39: a"
    slack = json.dumps(next(r["body"] for r in sent if r["path"] == "/slack"))
    assert "began: backward in blocks.3.fc (Linear), at blocks.3.fc.weight" in slack


def test_a_rank_on_a_suspect_device_alerts_with_its_device_and_metrics_show_each_device(job):
    judged(job)

    def fired() -> list[dict]:
        job.post("device-b", 1, [], world_size=2, host="dev-host")  # a heartbeat carries the verdict in
        with urllib.request.urlopen(job.url + "/v1/alerts?alertname=AmpSuspectDevice", timeout=10) as answer:
            return json.load(answer)["firing"]
    alerts = wait_until(fired, what="AmpSuspectDevice firing")
    assert [(a["labels"]["run"], a["labels"]["rank"], a["labels"]["device"]) for a in alerts] == \
        [("device-b", "1", "GPU-faulty")]
    assert "runs on device GPU-faulty (suspect: 1)" in alerts[0]["annotations"]["description"]
    with urllib.request.urlopen(job.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert 'ampwatch_rank_on_suspect_device{run="device-b",rank="1",device="GPU-faulty"} 1' in text
    assert 'ampwatch_rank_on_suspect_device{run="device-b",rank="0",device="GPU-faulty-clean"} 0' in text
    assert 'ampwatch_device_suspect{device="GPU-faulty",host="dev-host",local_rank="1"} 1' in text
    assert 'ampwatch_device_origin_events{device="GPU-faulty",host="dev-host",local_rank="1"} 4' in text
    assert 'ampwatch_device_suspect{device="nosamples-host:1",host="nosamples-host",local_rank="1"} 0' in text
