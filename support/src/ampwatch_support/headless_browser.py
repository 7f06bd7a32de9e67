"""Open a page in a real headless Chromium and collect what its console complains about."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from ampwatch_support.patience import SETTLE_S

__all__ = ["CHROMIUM", "needs_browser", "open_page", "wait_until"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No GPU, no sandbox (containers), and nothing fetched from outside: the page must work offline.
_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "pip install playwright (requirements-dev.txt)"
    if CHROMIUM is None:
        return "Chromium is not installed (Debian package chromium)"
    return None


needs_browser = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
"""Skip a test, before it starts any process, where Playwright or Chromium is missing."""


@contextlib.contextmanager
def open_page(url: str, *, width: int = 1280, height: int = 900) -> Iterator[tuple[Any, list[str]]]:
    """Open ``url``; yield the Playwright page and a live list of console errors, warnings and page errors."""
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(url)
            yield page, problems
        finally:
            browser.close()


def wait_until(page: Any, script: str, timeout_s: float = SETTLE_S) -> bool:
    """Poll the JavaScript expression ``script`` in ``page`` until it is truthy; False after ``timeout_s``.

    The status page's Content-Security-Policy forbids eval, which Playwright's ``wait_for_function``
    uses for a string; ``page.evaluate`` goes through the DevTools protocol and is allowed.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate(script):
            return True
        page.wait_for_timeout(50)
    return False
