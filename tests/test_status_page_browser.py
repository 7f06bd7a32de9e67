"""The status page in a real headless Chromium, against a live collector fed by a real 2-rank DDP job that finished."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import urllib.parse

import httpx
import pytest

from ampwatch.contract.alerts import ALERTS, SPEAKERS
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page

JOB = pathlib.Path(__file__).with_name("e2e_ddp_job.py")
# The per-rank alerts a run-wide alert speaks for that this job's storm makes on both ranks at once (streak,
# collapse, skip ratio). Rank 0's loss alone is inf (the inf is in its input): a loss spike of its own, a rank that
# stands out, which may fire as rank 0's AmpLossSpike (never rank 1's).
JOB_WIDE = set(SPEAKERS) - {"AmpLossSpike"}
ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"
# Markup in the run id: the page must show it as text, never build elements from it.
RUN = "<img src=x onerror=alert(1)>&1"

pytestmark = [pytest.mark.slow, needs_browser]


@pytest.mark.timeout(240)
def test_the_status_page_shows_the_finished_run_its_ranks_skips_and_the_streak_alert_without_console_errors(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        # 20 consecutive overflowing iterations: a streak past the warning threshold (16) on both ranks.
        job = subprocess.run([sys.executable, str(JOB), "--collector", collector.url, "--run", RUN,
                              "--iterations", "60", "--overflow-at", "20-39", "--sleep", "0"],
                             capture_output=True, timeout=180)
        assert job.returncode == 0, job.stdout.decode()[-3000:] + job.stderr.decode()[-3000:]

        with open_page(collector.url + "/") as (page, problems):
            page.wait_for_selector("tr.run a.run-link", timeout=15_000)
            links = page.locator("tr.run a.run-link")
            assert links.count() == 1 and links.first.text_content() == RUN
            assert page.locator("img").count() == 0  # the markup stayed text: no element was built from it
            links.first.click()
            page.wait_for_selector("circle.skip-mark", timeout=15_000)

            assert page.locator("#run-name").text_content() == RUN
            ranks = page.locator("#ranks tr.rank")
            assert ranks.count() == 2
            for i in range(2):
                row = ranks.nth(i).text_content()
                # 20 backoffs from 2^16, no growth: the scale ends at 2^-4.
                assert "2^-4" in row and "GradScaler" in row and "closed" in row, row
                assert "body: 20 / 40" in row and "head: 20 / 40" in row, row
            # Both ranks skipped together: one alert for the run, which speaks for their 4 streak alerts.
            page.wait_for_selector("#firing tr.alert[data-alert=AmpRunSkipStorm]", timeout=15_000)
            alerts = page.locator("#firing tr.alert[data-alert=AmpRunSkipStorm]")
            assert alerts.count() == 1 and alerts.first.locator("td").nth(1).text_content() == "warning"
            assert page.locator("#firing tr.alert[data-alert=AmpConsecutiveSkippedSteps]").count() == 0
            # Skip marks: one per rank, optimizer and skip the agent sent (the streak of 20's 1st, 2nd, 4th, 8th
            # and 16th), and one stroke per rank and optimizer over the whole streak once it ended.
            assert page.locator("circle.skip-mark").count() == 2 * 2 * 5
            page.wait_for_selector("line.skip-streak", timeout=15_000)
            assert page.locator("line.skip-streak").count() == 2 * 2
            assert page.locator("path.scale-line").count() == 2
            skips = page.locator("#events tr.event[data-kind=skip]")
            # Offending parameters are named (the first skips were inspected; a storm rate-limits later ones).
            named = [skips.nth(i).text_content() for i in range(skips.count())]
            assert any("0.weight (inf 0, nan" in text for text in named), named[:5]
            assert any("2.weight (inf 0, nan" in text for text in named), named[:5]
            # The inf was in rank 0's input (ddp=model): rank 0 started all 20 skipped iterations, rank 1 none.
            assert [page.locator("#ranks tr.rank td.origin").nth(i).text_content() for i in range(2)] == ["20", "0"]
            started = [skips.nth(i).locator("td").nth(1).text_content() for i in range(skips.count())
                       if "started on this rank" in named[i]]
            assert started and set(started) == {"0"}, named[:5]
            # The run finished: the page says what it went through, not that every rank looks fine.
            banner = page.locator("#run-banner.finished").text_content()
            summary, _, fired = banner.partition("; alerts that fired: ")
            assert summary == ("Finished run: 2 ranks closed after 60 iterations; 80 of 240 steps skipped (33.3%), "
                               "4 streaks, the longest 20 (rank 0); no poisoned step; final loss scale 2^-4 (0.0625) "
                               "on every rank (all collapsed)"), banner
            banner_alerts = dict(re.findall(r"(Amp\w+) \(([^)]*)\)", fired))  # name -> "warning", "warning, 2 ranks"
            assert banner_alerts["AmpRunSkipStorm"] == "warning" and not set(banner_alerts) & JOB_WIDE, banner
            rows = httpx.get(f"{collector.url}/v1/runs/{urllib.parse.quote(RUN, safe='')}/summary",
                             timeout=30).json()["rows"]
            rank_alerts = {str(row["rank"]): row["alerts"] for row in rows}
            # The storm is the run's alert, in the banner: no rank's row has an alert a run-wide alert speaks for
            # (the contract's SPEAKERS), nor another the contract lacks. Rank 0 started every skipped iteration: its
            # own AmpSkipOriginRank fires when a pass saw its news before it closed (then listed in the banner after
            # the storm), which a job this fast leaves to chance; rank 1 started none.
            listed = {name for names in rank_alerts.values() for name in names}
            assert listed <= set(ALERTS) and not listed & JOB_WIDE, rank_alerts
            assert "AmpSkipOriginRank" not in rank_alerts["1"], rank_alerts
            assert "AmpLossSpike" not in rank_alerts["1"], rank_alerts  # its loss stayed finite
            assert ("AmpSkipOriginRank" in banner_alerts) == ("AmpSkipOriginRank" in rank_alerts["0"]), \
                (rank_alerts, banner)
            assert page.locator("#trouble-title").text_content() == "Ranks that had trouble"
            assert page.locator("#trouble-count").text_content() == "2 of 2"
            assert page.locator("#trouble-summary").text_content().startswith(
                "over the whole run: scale ended collapsed: 2")
            for rank in ("0", "1"):
                assert page.locator(f'#trouble tr.trouble[data-rank="{rank}"] .reason').all_text_contents() == [
                    "scale ended collapsed", "long streak", "high skip ratio",
                ] + ["alert fired"] * bool(rank_alerts[rank])
            ARTIFACTS.mkdir(exist_ok=True)
            # docs/images/status-page-finished.png: from the banner down (the run's name here is hostile markup).
            top = page.locator("#trouble-box").bounding_box()["y"]
            page.screenshot(path=str(ARTIFACTS / "status-page-finished.png"),
                            clip={"x": 0, "y": top, "width": page.viewport_size["width"], "height": 760})
            page.screenshot(path=str(ARTIFACTS / "status-page.png"))
            page.screenshot(path=str(ARTIFACTS / "status-page-full.png"), full_page=True)
    assert problems == []
