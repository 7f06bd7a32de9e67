"""A poisoned optimizer on the status page, in a real headless Chromium, fed scripted protocol v1 batches."""

from __future__ import annotations

import time

import httpx
import pytest

from ampwatch_support.batches import make_batch, optimizer, skip_event
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page

RUN = "poisoned-run"
# Markup in a parameter name: it must show as text, never become an element.
HOSTILE = "<img src=x onerror=alert(1)>"

pytestmark = [pytest.mark.slow, needs_browser]


def _stream() -> list[dict]:
    """The issue 8 scenario: head overflows and skips, clipping spreads its NaN and body steps with it."""
    key = {"process_key": "k" * 32}  # rank 0's agent sends a process key; rank 1's is older and sends none
    clean = make_batch(run=RUN, world_size=2, seq=1, iteration=5, **key,
                       optimizers={"body": optimizer(steps=5), "head": optimizer(steps=5)})
    poisoned = {"id": 2, "kind": "poisoned_step", "time": time.time(), "iteration": 6, "optimizer": "body",
                "reason": "nonfinite_grad", "params_total": 2,
                "params": [{"name": HOSTILE, "inf": 0, "nan": 64}, {"name": "body.bias", "inf": 0, "nan": 8}]}
    after = make_batch(run=RUN, world_size=2, seq=2, iteration=6, **key,
                       optimizers={"body": optimizer(steps=6, poisoned_steps=1),
                                   "head": optimizer(steps=5, skipped=1, consecutive=1, longest=1)},
                       events=[skip_event(1, optimizer="head", iteration=6, params=("head.bias",)), poisoned])
    # A second rank trains without a GradScaler (bf16): no scale, so nothing about it may look collapsed or apart.
    unscaled = make_batch(run=RUN, rank=1, incarnation=f"{2:032x}", world_size=2, seq=1, iteration=6,
                          loss_scale=None, optimizers={"net": optimizer(steps=6)},
                          scaler={"enabled": False, "kind": "none", "init_scale": None, "growth_factor": None,
                                  "backoff_factor": None, "growth_interval": None})
    return [clean, after, unscaled]


@pytest.mark.timeout(60)
def test_the_status_page_shows_a_poisoned_optimizer_its_event_parameters_and_alert_without_console_errors(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        for batch in _stream():
            answer = httpx.post(collector.url + "/v1/ingest", json=batch, timeout=10)
            assert answer.status_code == 200, answer.text

        with open_page(f"{collector.url}/#run={RUN}") as (page, problems):
            page.wait_for_selector("#events tr.event[data-kind=poisoned_step]", timeout=15_000)
            page.wait_for_selector("#firing tr.alert[data-alert=AmpPoisonedStep]", timeout=15_000)

            # The rank's cell counts the poisoned step on body, highlighted, and says nothing for head.
            body = page.locator("#ranks tr.rank div.optimizer[data-optimizer=body]")
            assert body.locator("span.poisoned").text_content() == "poisoned 1"
            assert body.locator("span.poisoned").evaluate("e => getComputedStyle(e).backgroundColor") \
                == "rgb(198, 40, 40)"  # --crit: the stylesheet applied under the page's CSP
            head = page.locator("#ranks tr.rank div.optimizer[data-optimizer=head]")
            assert "head: 1 / 5" in head.text_content() and head.locator("span.poisoned").count() == 0

            # The event names the optimizer, the reason and the parameters, markup included as text.
            event = page.locator("#events tr.event[data-kind=poisoned_step]")
            assert event.count() == 1
            cells = [event.locator("td").nth(i).text_content() for i in range(6)]
            assert cells[1:5] == ["0", "6", "poisoned_step", "body"], cells
            assert cells[5] == (f"stepped with non-finite gradients (nonfinite_grad) · "
                                f"{HOSTILE} (inf 0, nan 64), body.bias (inf 0, nan 8)"), cells
            assert page.locator("img").count() == 0

            # The rank without a GradScaler says so, shows no scale, and is not counted as in trouble.
            unscaled = page.locator("#ranks tr.rank[data-rank='1'] td")
            assert unscaled.nth(2).text_content() == "none (bf16/fp32: every step checked)"
            assert unscaled.nth(3).text_content() == "-" and "disabled" not in unscaled.nth(2).get_attribute("class")

            # The rank whose agent sends no process key is marked: anyone with the ingest token can speak for it.
            assert unscaled.nth(1).locator("span.keyless").text_content() == "no key"
            assert page.locator("#ranks tr.rank[data-rank='0'] span.keyless").count() == 0

            alert = page.locator("#firing tr.alert[data-alert=AmpPoisonedStep]")
            assert alert.count() == 1
            assert [alert.locator("td").nth(i).text_content() for i in (1, 2, 3, 4)] == \
                ["critical", RUN, "0", "body"]
    assert problems == []
