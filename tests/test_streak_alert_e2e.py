"""A real collector fires a lone rank's streak alert with the batch of its 16th skip, in a run of several ranks.

Row 6 of ``ampwatch.server.alerting.early``: the last pass found the run calm, and began well after the streak
did. Batches go over real HTTP to a collector process with its real periodic pass (every second); the alert is
read back from ``GET /v1/alerts`` as soon as the 16th skip's batch is answered (the collector evaluates a rank's
alerts before it answers). A probe run tells when passes have run since a moment: the pass alone fires its young
streak, at the second pass that finds it.
"""

from __future__ import annotations

import time

import httpx

from ampwatch.server.alerting.early import MARGIN_S
from ampwatch_support.batches import SimulatedRank, post_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import wait_until

STREAK = "AmpConsecutiveSkippedSteps"


def _streak_alerts(url: str, run: str) -> list[dict]:
    return [a for a in httpx.get(url + "/v1/alerts", timeout=30).json()["firing"]
            if a["name"] == STREAK and a["labels"]["run"] == run]


def _send(url: str, rank: SimulatedRank, iterations: int, skipping: bool) -> None:
    rank.iterations_per_batch = iterations
    post_batch(url, rank.batch(skipping, spike=False, closed=False))


def test_a_lone_streak_alert_fires_with_its_16th_skips_batch_once_a_pass_found_the_run_calm(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        url = collector.url
        job = [SimulatedRank("job", r, 4, 200) for r in range(4)]
        probe = [SimulatedRank("probe", r, 2, 200) for r in range(2)]
        for rank in job + probe:
            _send(url, rank, 200, skipping=False)  # healthy, past calibration
        _send(url, job[2], 1, skipping=True)  # rank 2's streak begins
        began = time.time()
        time.sleep(MARGIN_S + 0.5)
        # Probe rank 1 skips 20 in one batch (a streak too young for its batch): its alert fires at the second pass
        # after it, so a pass that started after `began` + MARGIN_S has finished, and found the job calm.
        _send(url, probe[1], 20, skipping=True)
        wait_until(lambda: _streak_alerts(url, "probe"), timeout=120, what="the probe's streak alert (two passes)")
        _send(url, job[2], 14, skipping=True)  # 15 skips
        assert _streak_alerts(url, "job") == []
        _send(url, job[2], 1, skipping=True)  # the 16th
        answered = time.time()
        (alert,) = _streak_alerts(url, "job")  # read right after the answer: no pass in between was needed
        assert alert["labels"]["rank"] == "2" and alert["labels"]["severity"] == "warning"
        assert began + MARGIN_S < alert["starts_at"] <= answered
