"""The run page at 1,024 ranks finds the ranks in trouble first, in a real headless Chromium."""

from __future__ import annotations

import pathlib
import time

import httpx
import pytest
from batches import make_batch, optimizer, skip_event
from collector_process import CollectorProcess

from headless_browser import needs_browser, open_page

RUN = "job-1024"
RANKS = 1024
ARTIFACTS = pathlib.Path(__file__).resolve().parents[1] / "artifacts"

pytestmark = [pytest.mark.slow, needs_browser]


def _batch(rank: int, seq: int = 1) -> dict:
    """A healthy rank, but: 40 collapsed, 512 poisoned, 777 skipping now, 600-609 in a streak past the warning (16),
    900 stepped its scheduler after a skip (in its second batch: a rank first seen this late has a past nobody
    watched)."""
    counters = {"steps": 300}
    if rank == 512:
        counters["poisoned_steps"] = 1
    if rank == 777:
        counters.update(skipped=5, consecutive=5, longest=5, streaks=1)
    if 600 <= rank < 610:
        counters.update(skipped=20, consecutive=20, longest=20, streaks=1)
    if rank == 900 and seq == 2:
        counters.update(skipped=1, scheduler_steps_after_skip=1)
    # Every rank skipped iteration 300 (a storm the events table collapses); rank 512's poisoned step must show.
    events = [skip_event(1, optimizer="body", iteration=300)] if seq == 1 else []
    if rank == 512:
        events.append({"id": 2, "kind": "poisoned_step", "time": time.time(), "iteration": 299, "optimizer": "body",
                       "reason": "nonfinite_grad", "params_total": 1, "params": [{"name": "w", "inf": 0, "nan": 1}]})
    return make_batch(run=RUN, rank=rank, world_size=RANKS, incarnation=f"{rank + 1:032x}", iteration=300,
                      seq=seq, events=events,
                      host=f"node-{rank // 8}", loss_scale=0.25 if rank == 40 else 65536.0,
                      optimizers={"body": optimizer(**counters), "head": optimizer(steps=300)})


@pytest.mark.timeout(180)
def test_the_run_page_lists_the_ranks_in_trouble_first_at_1024_ranks_and_searches_them(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        with httpx.Client(base_url=collector.url, timeout=30) as client:
            for rank in range(RANKS):
                answer = client.post("/v1/ingest", json=_batch(rank))
                assert answer.status_code == 200, answer.text
            assert client.post("/v1/ingest", json=_batch(900, seq=2)).status_code == 200

        with open_page(f"{collector.url}/#run={RUN}") as (page, problems):
            page.wait_for_selector("#trouble tr.trouble", timeout=30_000)
            rows = page.locator("#trouble tr.trouble")
            order = [rows.nth(i).get_attribute("data-rank") for i in range(rows.count())]
            assert order == ["512", "40", *map(str, range(600, 610)), "777", "900"]
            assert page.locator("#trouble-count").text_content() == "14 of 1024"
            assert "poisoned" in rows.nth(0).text_content() and "scale collapsed" in rows.nth(1).text_content()
            assert "skipping now" in rows.nth(11).text_content()
            assert "AmpSchedulerStepsOnSkipped" in rows.nth(13).text_content()
            # The ten streak alerts of one run are one row that expands; the single scheduler alert has its own.
            page.wait_for_selector("#firing tr.alert-group", timeout=15_000)
            group = page.locator("#firing tr.alert-group")
            assert group.count() == 1 and "10 ranks: 600-609" in group.text_content()
            members = page.locator("#firing tr.alert.member")
            assert members.count() == 10 and not any(members.nth(i).is_visible() for i in range(10))
            assert page.locator('#firing tr.alert:not(.member)').count() == 1
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "status-page-trouble.png"))
            group.click()
            page.wait_for_selector("#firing tr.alert.member >> nth=9", state="visible", timeout=15_000)
            assert "median 2^16 (65536)" in page.locator("#trouble-summary").text_content()
            # The storm's 1,024 skips are one row; the older poisoned step is still listed.
            page.wait_for_selector("#events tr.event.storm[data-kind=skip]", timeout=15_000)
            storm = page.locator("#events tr.event.storm[data-kind=skip]")
            assert storm.count() == 1 and "1024 ranks" in storm.text_content()
            assert "1024 events, ranks 0-1023" in storm.text_content()
            assert page.locator("#events tr.event[data-kind=poisoned_step]").count() == 1
            # A big run's full rank table (about 1 MB) is fetched only once opened; the chart draws the ranks in
            # trouble meanwhile.
            assert page.locator("#ranks tr.rank").count() == 0
            assert 0 < page.locator("path.scale-line").count() <= 14
            page.click("#all-ranks > summary")
            page.wait_for_selector('#ranks tr.rank[data-rank="1023"]', timeout=30_000)
            assert page.locator("#ranks tr.rank").count() == RANKS
            page.fill("#trouble-search", "node-100")  # ranks 800-807: healthy ones are listed when searched for
            page.wait_for_selector('#trouble tr.trouble[data-rank="800"]', timeout=15_000)
            shown = [rows.nth(i).get_attribute("data-rank") for i in range(rows.count())]
            assert shown == [str(r) for r in range(800, 808)]
    assert problems == []
