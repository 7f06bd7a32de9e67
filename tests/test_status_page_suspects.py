"""The status page's Suspects section and the began and samples of skip events, in a real headless Chromium, fed
the data and device scenarios of issue 39 as protocol v1 batches."""

from __future__ import annotations

import pytest

from ampwatch_support.batches import samples, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.skipping_jobs import SkippingJobs

pytestmark = [pytest.mark.slow, needs_browser]


@pytest.mark.timeout(60)
def test_the_page_lists_suspect_devices_and_samples_and_says_where_a_skip_began_and_on_which_samples(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        jobs = SkippingJobs(collector.url)
        jobs.data_scenario()
        jobs.device_scenario()
        began = {"loss_finite": True, "stage": "backward", "param": "blocks.3.fc.weight", "module": "blocks.3.fc",
                 "module_type": "Linear"}
        jobs.post("device-b", 1, [skip_event(0, iteration=90, streak=1, origin=True, began=began,
                                             samples=samples(list(range(100, 140))))], world_size=2, host="dev-host")

        with open_page(f"{collector.url}/#run=device-b") as (page, problems):
            page.wait_for_selector("#suspect-devices tr.suspect-device", timeout=15_000)
            page.wait_for_selector("#events tr.event[data-kind=skip]", timeout=15_000)
            device = page.locator("#suspect-devices tr.suspect-device")
            assert device.count() == 1
            cells = [device.locator("td").nth(i).text_content() for i in range(5)]
            assert cells == ["GPU-faulty", "dev-host local rank 1 (0000:3b:00.0)", "5", "device-a, device-b",
                             "device-a/1, device-b/1"], cells
            sample = page.locator("#suspect-samples tr.suspect-sample")
            assert sample.count() == 1
            assert [sample.locator("td").nth(i).text_content() for i in range(4)] == \
                ["bad", "data-host:0, data-host:1, data-host:2", "5", "data"]
            assert page.locator("#no-suspects").is_hidden()

            details = page.locator("#events tr.event[data-kind=skip]").first.locator("td").nth(5).text_content()
            assert "began in backward in blocks.3.fc (Linear), at blocks.3.fc.weight" in details, details
            assert "samples 100, 101, 102, 103, 104, 105, 106, 107 … 40 in all" in details, details
    assert problems == []
