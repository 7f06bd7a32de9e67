"""Loss and gradient-norm spikes and a gradient outlier on the status page, in a real headless Chromium: their rows
in the run's events and their marks on the loss-scale chart, beside the skips, from a real collector fed batches."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from ampwatch_support.batches import make_batch, optimizer, samples, skip_event, spike_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page
from ampwatch_support.patience import SETTLE_S, wait_until

RUN, RANKS, BATCHES = "spiky", 8, 10  # each rank reports iterations 10, 20, ..., 100, one batch each
HOSTILE = "<img src=x onerror=alert(1)>"  # a sample id with markup: it must show as text

pytestmark = [pytest.mark.slow, needs_browser]

# Whether the chart's texts (the captions, the ranks' labels, the marks' key) lie clear of everything drawn in
# the plot: the band, the median, the ranks' lines, the skip and spike marks.
_TEXTS_CLEAR = """(() => {
  const boxes = selector => [...document.querySelectorAll(selector)].map(node => node.getBoundingClientRect());
  const texts = boxes('#chart text.legend, #chart text.spread-key, #chart text.spike-key');
  const drawn = boxes('#chart path.spread-band, #chart path.spread-median, #chart path.scale-line, ' +
                      '#chart circle.skip-mark, #chart .spike-mark');
  const meet = (a, b) => a.left <= b.right && b.left <= a.right && a.top <= b.bottom && b.top <= a.bottom;
  return drawn.length > 0 && texts.every(text => drawn.every(box => !meet(text, box)));
})()"""


def _events(rank: int, seq: int, iteration: int) -> list[dict]:
    """What each rank's agent reports in its batch ``seq``: the planted spikes, a skip, nothing else."""
    if seq == 4 and rank == 2:  # rank 2's loss spiked on a bad batch (its samples named)
        return [spike_event(1, iteration=iteration - 3, value=9.5, mean=1.25, std=0.5,
                            samples=samples([HOSTILE, 102, 103]))]
    if seq == 3 and rank == 1:  # rank 1's loss went NaN: always a spike; then its step skipped
        return [spike_event(1, iteration=iteration - 1, value="NaN", mean=1.2, std=0.3),
                skip_event(2, iteration=iteration - 1)]
    if seq == 6:  # with DDP the all-reduced gradient norm spikes on every rank at once
        return [spike_event(3, "grad_norm_spike", iteration=iteration - 5, value=90.0, mean=2.0, std=0.5)]
    if seq == 8 and rank == 3:  # rank 3's own gradient norm, before the all-reduce, far above the others'
        return [spike_event(4, "grad_norm_spike", iteration=iteration - 5, value=50.0, mean=1.03, std=0.05,
                            local=True)]
    return []


def _batch(rank: int, seq: int) -> dict:
    iteration = 10 * seq
    events = _events(rank, seq, iteration)
    spikes = {kind: sum(1 for s in range(1, seq + 1) for e in _events(rank, s, 10 * s) if e["kind"] == kind
                        and not e.get("local")) for kind in ("loss_spike", "grad_norm_spike")}
    skipped = int(rank == 1 and seq >= 3)
    batch = make_batch(run=RUN, rank=rank, world_size=RANKS, local_rank=rank, host="node-a", seq=seq,
                       incarnation=f"{rank + 1:032x}", sent_at=time.time(), iteration=iteration, events=events,
                       optimizers={"gen": optimizer(steps=iteration - skipped, skipped=skipped, streaks=skipped,
                                                    longest=skipped, grad_norm_spikes=spikes["grad_norm_spike"],
                                                    local_grad_norm={"mean": 1.0 + rank / 100, "std": 0.05})})
    batch["state"]["loss_spikes"] = spikes["loss_spike"]
    return batch


def _row(page, kind: str, rank: str) -> list[str]:
    rows = page.locator(f"#events tr.event[data-kind={kind}]")
    for i in range(rows.count()):
        cells = [rows.nth(i).locator("td").nth(c).text_content() for c in range(6)]
        if cells[1] == rank:
            return cells
    raise AssertionError(f"no {kind} row of rank {rank}")


@pytest.mark.timeout(90)
def test_spikes_and_a_gradient_outlier_show_as_readable_event_rows_and_marks_on_the_scale_chart(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        for seq in range(1, BATCHES + 1):
            for rank in range(RANKS):
                answer = httpx.post(collector.url + "/v1/ingest", json=_batch(rank, seq), timeout=10)
                assert answer.status_code == 200, answer.text
        # The collector judges rank 3's own norm once every other rank has reported past its iteration.
        judged = f"{collector.url}/v1/runs/{RUN}/events?kind=gradient_outlier"
        wait_until(lambda: httpx.get(judged, timeout=10).json()["events"], SETTLE_S,
                   "the collector to judge rank 3's own gradient norm an outlier")

        with open_page(f"{collector.url}/#run={RUN}") as (page, problems):
            page.wait_for_selector("#events tr.event[data-kind=gradient_outlier]", timeout=15_000)
            page.wait_for_selector("#chart .spike-mark[data-kind=gradient_outlier]", timeout=15_000)

            # Each spike's row: its value against its window, how far above (z), and its samples, markup as text.
            assert _row(page, "loss_spike", "2")[2:] == [
                "37", "loss_spike", "", f"value 9.5 · z 16.5 · window mean 1.25, std 0.5 · samples {HOSTILE}, 102, 103"]
            assert _row(page, "loss_spike", "1")[2:] == ["29", "loss_spike", "",
                                                         "value NaN · non-finite · window mean 1.2, std 0.3"]
            local = _row(page, "grad_norm_spike", "3")
            assert local[2:] == ["75", "grad_norm_spike", "gen", "value 50 · z 979.4 · window mean 1.03, std 0.05 · "
                                                                  "own gradients, before DDP's all-reduce"]
            # The whole job's gradient-norm spike is one row for its eight ranks.
            storm = page.locator("#events tr.event.storm[data-kind=grad_norm_spike]")
            assert storm.count() == 1
            assert storm.locator("td").nth(1).text_content() == "8 ranks"
            assert storm.locator("td").nth(5).text_content() == \
                "8 events, ranks 0-7; latest: value 90 · z 176 · window mean 2, std 0.5"
            # The collector's verdict on rank 3: its own norm against the other ranks' levels.
            outlier = _row(page, "gradient_outlier", "3")
            assert outlier[2:5] == ["75", "gradient_outlier", "gen"], outlier
            assert re.fullmatch(r"own gradient norm 50, the other ranks' 1\.0\d* \(spread [\d.e-]+, z [\d.e+]+, "
                                r"7 ranks compared\): this rank's gradients stood out before DDP's all-reduce",
                                outlier[5]), outlier[5]
            assert page.locator("img").count() == 0

            # The chart marks each spike at its iteration, beside rank 1's skip dot: one loss-spike mark for
            # rank 2, one for rank 1's NaN, the job's gradient-norm spike on every rank, rank 3's own and its
            # outlier.
            marks = page.locator("#chart .spike-mark")
            found = sorted((marks.nth(i).get_attribute("data-kind"), int(marks.nth(i).get_attribute("data-iteration")),
                            marks.nth(i).get_attribute("data-ranks")) for i in range(marks.count()))
            by_kind: dict[tuple[str, int], set[str]] = {}
            for kind, iteration, ranks in found:
                by_kind.setdefault((kind, iteration), set()).update(ranks.split(","))
            assert by_kind == {("loss_spike", 37): {"2"}, ("loss_spike", 29): {"1"},
                               ("grad_norm_spike", 55): {str(r) for r in range(RANKS)},
                               ("grad_norm_spike", 75): {"3"}, ("gradient_outlier", 75): {"3"}}, found
            # Rank 1's skip dot comes from the run's /scale, built at most once per 3 s: a build just before its skip
            # landed draws the chart without it until the page's next refresh.
            page.wait_for_selector("#chart circle.skip-mark", timeout=15_000)
            assert page.locator("#chart circle.skip-mark").count() >= 1
            title = page.locator("#chart .spike-mark[data-kind=loss_spike][data-ranks='2'] title").text_content()
            assert title == "rank 2: loss spike at iteration 37 (value 9.5, z 16.5)", title
            assert page.locator("#chart text.spike-key").text_content() == \
                "▲ loss spike · ◆ gradient-norm spike · ○ gradient outlier"
            assert page.evaluate(_TEXTS_CLEAR)

            # The alerts they fired: rank 2's own loss spike, the job's gradient-norm spike, rank 3 as the outlier.
            for alert in ("AmpLossSpike", "AmpRunGradNormSpike", "AmpRankGradientOutlier"):
                page.wait_for_selector(f"#firing tr.alert[data-alert={alert}]", timeout=15_000)
            assert page.locator("#firing tr.alert[data-alert=AmpGradNormSpike]").count() == 0
            outlier_alert = page.locator("#firing tr.alert[data-alert=AmpRankGradientOutlier] td")
            assert [outlier_alert.nth(i).text_content() for i in (2, 3)] == [RUN, "3"]
    assert problems == []
