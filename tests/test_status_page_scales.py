"""Broken loss scales (0, NaN) and a restored scale on the status page, in a real headless Chromium."""

from __future__ import annotations

import time

import httpx
import pytest

from ampwatch_support.batches import make_batch, optimizer
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page, wait_until

RUN = "broken-scales"
ONE_RANK = "one-rank"

# Whether every text of the chart (the caption, the ranks' labels) lies clear of everything drawn in the plot:
# the band, the median, the ranks' lines, their skip marks (bounding boxes, so a label cannot touch a line).
_LABELS_CLEAR = """(() => {
  const boxes = selector => [...document.querySelectorAll(selector)].map(node => node.getBoundingClientRect());
  const labels = boxes('#chart text.legend, #chart text.spread-key');
  const drawn = boxes('#chart path.spread-band, #chart path.spread-median, #chart path.scale-line, ' +
                      '#chart circle.skip-mark, #chart line.skip-streak');
  const meet = (a, b) => a.left <= b.right && b.left <= a.right && a.top <= b.bottom && b.top <= a.bottom;
  return labels.length > 0 && drawn.length > 0 && labels.every(label => drawn.every(box => !meet(label, box)));
})()"""

pytestmark = [pytest.mark.slow, needs_browser]


def _scale_change(id: int, iteration: int, cause: str, before: object, after: object) -> dict:
    return {"id": id, "kind": "scale_change", "time": time.time(), "iteration": iteration, "cause": cause,
            "before": before, "after": after}


def _stream() -> list[dict]:
    """Rank 0 resumes from a checkpoint (restored), then its scale becomes NaN; rank 1 underflows to 0."""
    rank0 = make_batch(run=RUN, rank=0, world_size=3, seq=1, iteration=30, loss_scale="NaN",
                       optimizers={"gen": optimizer(steps=30)},
                       events=[_scale_change(1, 10, "restored", 65536.0, 1024.0),
                               _scale_change(2, 20, "manual", 1024.0, "NaN")])
    rank1 = make_batch(run=RUN, rank=1, world_size=3, seq=1, incarnation="1" * 32, iteration=200, loss_scale=0.0,
                       backoffs=170, optimizers={"gen": optimizer(steps=30, skipped=170, consecutive=170,
                                                                   longest=170, streaks=1)},
                       events=[_scale_change(1, 199, "backoff", 2.0 ** -149, 0.0)])
    rank2 = make_batch(run=RUN, rank=2, world_size=3, seq=1, incarnation="2" * 32, iteration=200,
                       loss_scale=65536.0, optimizers={"gen": optimizer(steps=200)})
    return [rank0, rank1, rank2]


def _one_rank() -> dict:
    """A run of one rank, backing off once (a line of its own beside the band)."""
    return make_batch(run=ONE_RANK, rank=0, world_size=1, seq=1, iteration=50, loss_scale=32768.0,
                      optimizers={"gen": optimizer(steps=49, skipped=1, streaks=1, longest=1)},
                      events=[_scale_change(1, 40, "backoff", 65536.0, 32768.0)])


@pytest.mark.timeout(60)
def test_zero_nan_and_restored_scales_show_as_text_and_the_chart_draws_only_what_a_log_axis_can_labels_aside(
        tmp_path):
    # The demo thresholds: a collapsed scale fires after 2 s instead of 30.
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--alert-thresholds", "demo"]) as collector:
        for batch in [*_stream(), _one_rank()]:
            answer = httpx.post(collector.url + "/v1/ingest", json=batch, timeout=10)
            assert answer.status_code == 200, answer.text

        with open_page(f"{collector.url}/#run={RUN}") as (page, problems):
            page.wait_for_selector("#events tr.event[data-kind=scale_change]", timeout=15_000)
            page.wait_for_selector("svg text.legend", timeout=15_000)
            scales = page.locator("#ranks tr.rank td.loss-scale")
            assert [scales.nth(i).text_content() for i in range(3)] == ["NaN", "0", "2^16 (65536)"]
            changes = page.locator("#events tr.event[data-kind=scale_change]")
            texts = {changes.nth(i).locator("td").nth(5).text_content() for i in range(changes.count())}
            assert texts == {"restored: 2^16 (65536) → 2^10 (1024)", "manual: 2^10 (1024) → NaN",
                             "backoff: 2^-149 (1.401298464324817e-45) → 0"}, texts
            # Rank 0 drew its stretch before NaN, rank 2 all of it; rank 1 only its subnormal start (1 point: no
            # segment of its own but no NaN coordinates either). Legends say which scales are off the axis.
            legends = page.locator("svg text.legend")
            assert [legends.nth(i).text_content() for i in range(3)] == [
                "rank 0 (scale NaN, off the axis)", "rank 1 (scale 0, off the axis)", "rank 2"]
            for path in page.locator("path.scale-line").all():
                assert "NaN" not in path.get_attribute("d") and "Infinity" not in path.get_attribute("d")
            # The caption counts the ranks in words, above the plot; no label lies on a line or the band.
            caption = page.locator("#chart text.spread-key").text_content()
            assert caption == "shaded: lowest to highest of 3 ranks · dashed: median", caption
            assert page.evaluate(_LABELS_CLEAR)
            # Two ranks of three hold an unusable scale: one alert for the run speaks for theirs.
            page.wait_for_selector("#firing tr.alert[data-alert=AmpRunLossScaleCollapsed]", timeout=30_000)
            assert page.locator("#firing tr.alert[data-alert=AmpLossScaleCollapsed]").count() == 0

            page.goto(f"{collector.url}/#run={ONE_RANK}")
            assert wait_until(page, "(document.querySelector('#chart text.spread-key') || {}).textContent === "
                                    "'shaded: lowest to highest of 1 rank · dashed: median'")
            assert page.locator("#chart path.scale-line").count() == 1
            assert page.evaluate(_LABELS_CLEAR)
    assert problems == []
