"""The run page at 1,024 ranks finds the trouble in one screen, in a real headless Chromium (issue 14's job)."""

from __future__ import annotations

import contextlib
import pathlib
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page, wait_until
from ampwatch_support.patience import START_S
from ampwatch_support.patience import wait_until as wait_until_true
from ampwatch_support.staged_job import COLLAPSED, KILLED, POISONED, SCHEDULER, SKIPPY, StagedJob

RUN = "job-1024"
RANKS = 1024
ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"
SILENT_AFTER_S = 10

pytestmark = [pytest.mark.slow, needs_browser]


def _wait_for_silent(url: str, deadline_s: float = 90) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/v1/runs/{RUN}/summary", timeout=30).json()["counts"]["silent"] == 1:
            return
        time.sleep(0.5)
    raise AssertionError(f"rank {KILLED} never turned silent")


@contextlib.contextmanager
def _live(job: StagedJob) -> Iterator[None]:
    """Keep the job's ranks sending a batch every 2 s (rank 1000 stays killed) until the block ends."""
    stop = threading.Event()
    sender = threading.Thread(target=job.run_live, args=(stop,), daemon=True)
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join(120)


def _rows(page) -> list[str]:
    rows = page.locator("#trouble tr.trouble")
    return [rows.nth(i).get_attribute("data-rank") for i in range(rows.count())]


@pytest.mark.timeout(420)
def test_the_run_page_shows_every_rank_in_trouble_in_its_first_screen_at_1024_ranks_through_a_storm(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--silent-after", str(SILENT_AFTER_S)]) as collector:
        job = StagedJob(collector.url, run=RUN, ranks=RANKS)
        job.run_ticks(12)  # 240 iterations: every staged trouble has happened; rank 1000 stopped after tick 8
        with _live(job), open_page(f"{collector.url}/#run={RUN}") as (page, problems):
            _wait_for_silent(collector.url)
            page.wait_for_selector("#trouble tr.trouble", timeout=60_000)
            # Most urgent first: poisoned, silent, collapsed (and skipping), the high recent skip ratio, the
            # scheduler stepped after a skip (its alert, and the scale it backed off once); nothing else of the
            # 1,024 ranks.
            expected = [str(POISONED), str(KILLED), *map(str, COLLAPSED), str(SKIPPY), str(SCHEDULER)]
            assert wait_until(page, f"document.querySelectorAll('#trouble tr.trouble').length === {len(expected)}")
            assert _rows(page) == expected
            assert page.locator("#trouble-count").text_content() == f"{len(expected)} of {RANKS}"
            why = {rank: page.locator(f'#trouble tr.trouble[data-rank="{rank}"] .reason').all_text_contents()
                   for rank in expected}
            assert why[str(POISONED)][0] == "poisoned" and why[str(KILLED)][0] == "silent"
            assert why["40"][:2] == ["scale collapsed", "skipping now"]
            assert "high recent skip ratio" in why[str(SKIPPY)]
            assert why[str(SCHEDULER)] == ["alert firing", "scale out of line"]  # an alert before a scale out of line
            assert page.locator("#run-banner").is_hidden()  # a few ranks in trouble: no whole-job banner
            assert "AmpSchedulerStepsOnSkipped" in page.locator(f'#trouble tr.trouble[data-rank="{SCHEDULER}"]') \
                .text_content()
            # One screen: every one of those rows is inside the first viewport, with nothing scrolled.
            height = page.viewport_size["height"]
            for rank in expected:
                box = page.locator(f'#trouble tr.trouble[data-rank="{rank}"]').bounding_box()
                assert box is not None and box["y"] + box["height"] <= height, (rank, box)
            assert page.evaluate("window.scrollY") == 0

            # The chart: the band from the lowest to the highest rank, the median, and the outliers' own lines
            # (the collapsed ranks, which the page also asked for as ranks in trouble); the x-axis starts at the
            # window, not at iteration 0.
            page.wait_for_selector("#chart path.spread-band", timeout=30_000)
            assert page.locator("#chart path.spread-median").count() == 1
            drawn = set(page.locator("#chart path.scale-line").evaluate_all("ps => ps.map(p => p.dataset.rank)"))
            assert set(map(str, COLLAPSED)) <= drawn and len(drawn) <= 16
            held = httpx.get(f"{collector.url}/v1/runs/{RUN}/scale", timeout=30).json()  # under 1,000 held
            assert 0 < held["start"] <= 20
            assert page.locator("#chart text.axis-start").text_content() == f"iteration {held['start']}"
            page.click('#scale-window button[data-window="200"]')
            assert wait_until(page, "document.querySelector('#chart text.axis-start').textContent !== "
                                    f"'iteration {held['start']}'")
            end = int(page.locator("#chart text.axis-end").text_content().split()[-1])
            assert page.locator("#chart text.axis-start").text_content() == f"iteration {end - 200}"
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "status-page-trouble.png"))

            # The whole job skips: the ranks staged before still lead, the storm's events are one row per
            # kind and iteration, and the poisoned step stays listed.
            job.storm()  # the live sender's next batches
            # Every rank that was not skipping already (40-43 were, 777 may be; 1000 is gone) starts a streak at
            # the storm's first iteration: one row, once the whole tick has landed. Held there while the page
            # refreshes: the next ticks' scale changes push those skips out of the newest events the page reads.
            wait_until_true(lambda: job.storm_ticks >= 1, START_S, "the storm's first tick to land")
            with job.between_ticks(START_S):
                assert wait_until(page, "(() => { const row = document.querySelector('#events tr.event.storm"
                                        f"[data-kind=skip]'); return row && parseInt(row.cells[1].textContent) >= "
                                        f"{RANKS - 6}; }})()", 60), page.locator("#events tbody").inner_text()[:2000]
                storm = page.locator("#events tr.event.storm[data-kind=skip]").first.text_content()
            assert int(re.search(r"(\d+) ranks", storm).group(1)) <= RANKS - 5 and "ranks 0-39, 44-" in storm
            assert page.locator("#events tr.event[data-kind=poisoned_step]").count() == 1, \
                page.locator("#events tbody").inner_text()[:2000]
            assert wait_until(page, f"document.querySelector('#trouble-count').textContent === '{RANKS} of {RANKS}'",
                              60)
            # The poisoned rank, then the silent ones: the killed rank, and any live rank whose batches a loaded
            # machine held back past --silent-after.
            assert _rows(page)[0] == str(POISONED)
            assert page.locator("#trouble tr.trouble").nth(1).locator(".reason").first.text_content() == "silent"
            built = httpx.get(f"{collector.url}/v1/runs/{RUN}/summary", params={"search": str(KILLED)},
                              timeout=30).json()["rows"]
            assert built[0]["rank"] == KILLED and built[0]["reasons"][0] == "silent"
            # One banner for the whole job: how many ranks skip, since when, and the scale band with the collapse.
            assert wait_until(page, "document.querySelector('#run-banner.storm') !== null", 30)
            whole = httpx.get(f"{collector.url}/v1/runs/{RUN}/summary", timeout=30).json()["whole_job"]
            banner = page.locator("#run-banner").text_content()
            assert whole["since_iteration"] % job.per_tick == 0 and whole["since_ranks"] >= RANKS - 6, whole
            assert f"in a skip streak, {whole['since_ranks']:,} of them since iteration {whole['since_iteration']}" \
                in banner, banner
            assert re.search(r"Whole job skipping: 1,02[0-3] of 1,024 live ranks", banner), banner
            assert re.search(r"loss scale min 2\^-\d+ .*, median 2\^-\d+ .*, max 2\^16 \(65536\) \(1,02\d collapsed\)",
                             banner), banner
            # A big run's full rank table (about 1 MB) is fetched only once opened.
            assert page.locator("#ranks tr.rank").count() == 0
            page.click("#all-ranks > summary")
            page.wait_for_selector(f'#ranks tr.rank[data-rank="{RANKS - 1}"]', timeout=60_000)
            assert page.locator("#ranks tr.rank").count() == RANKS
            page.fill("#trouble-search", "node-100")  # ranks 800-807
            page.wait_for_selector('#trouble tr.trouble[data-rank="800"]', timeout=30_000)
            assert wait_until(page, "document.querySelectorAll('#trouble tr.trouble').length === 8", 30)
            assert _rows(page) == [str(r) for r in range(800, 808)]
    assert problems == []
