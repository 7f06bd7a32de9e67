"""The status page with --read-token, and its paged run list, in a real headless Chromium (issue 15).

On a 401 the page asks for the read token once, keeps it in sessionStorage (this tab only), sends it
as a bearer header and never puts it in a URL.
"""

from __future__ import annotations

import httpx
import pytest

from ampwatch_support.batches import make_batch
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.headless_browser import needs_browser, open_page

pytestmark = [pytest.mark.slow, needs_browser, pytest.mark.timeout(180)]

READ_TOKEN = "read-Secret-page-93ac"


def test_with_a_read_token_the_page_asks_once_keeps_it_for_the_tab_and_never_puts_it_in_a_url(tmp_path):
    (tmp_path / "read").write_text(READ_TOKEN + "\n")
    with CollectorProcess(str(tmp_path / "ampwatch.db"), args=["--read-token-file", str(tmp_path / "read")]) \
            as collector:
        with httpx.Client(base_url=collector.url, timeout=30) as client:
            for i in range(60):  # more than a page of the run list (50)
                assert client.post("/v1/ingest", json=make_batch(run=f"run-{i:02d}")).status_code == 200
        from playwright.sync_api import expect  # polls in Playwright's own world: the page's CSP forbids eval

        with open_page(collector.url + "/") as (page, problems):
            requests: list[tuple[str, str]] = []
            page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization", ""))))
            page.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
            assert page.locator("#error").is_hidden() and page.locator("#runs tr.run").count() == 0
            page.fill("#token", "not-the-token")
            page.click("#token-form button")
            page.wait_for_selector("#token-wrong:not([hidden])", timeout=30_000)
            page.fill("#token", READ_TOKEN)
            page.click("#token-form button")
            expect(page.locator("#runs tr.run")).to_have_count(50, timeout=30_000)
            assert page.locator("#token-form").is_hidden() and page.locator("#error").is_hidden()
            page.click("#more-runs")
            expect(page.locator("#runs tr.run")).to_have_count(60, timeout=30_000)
            assert page.locator("#more-runs").is_hidden()
            assert page.evaluate("sessionStorage.getItem('ampwatch-read-token')") == READ_TOKEN
            assert page.evaluate("localStorage.length") == 0 and "token" not in page.evaluate("document.cookie")
            # Asked once: a reload of the tab goes straight to the runs.
            page.reload()
            expect(page.locator("#runs tr.run")).to_have_count(50, timeout=30_000)
            assert page.locator("#token-form").is_hidden()
            api = [(url, auth) for url, auth in requests if "/v1/" in url]
            assert api and all(auth == f"Bearer {READ_TOKEN}" for url, auth in api[-3:])
            assert not any(READ_TOKEN in url or "not-the-token" in url for url, _ in requests)
            assert READ_TOKEN not in page.url
            # 401s and the wrong token's 403 are the page asking, not a problem.
            assert not [p for p in problems if "401" not in p and "403" not in p], problems
        # Another tab (a new browser session) knows nothing of it.
        with open_page(collector.url + "/") as (page, _):
            page.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
            assert page.evaluate("sessionStorage.length") == 0
