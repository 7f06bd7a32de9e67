"""Retake docs/images/status-page.png: run the demo, open its run view in headless Chromium while an alert fires.

    .venv/bin/python docs/images/status-page.py docs/images/status-page.png

Uses Debian's chromium through Playwright, as tests/test_status_page_browser.py does.
"""
import os, re, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
out_path = sys.argv[1]
demo = subprocess.Popen([sys.executable, f"{REPO}/examples/demo.py", "--port", "0", "--data", tempfile.mkdtemp(prefix="ampwatch-shot-"),
                         "--run", "demo-readme"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)
lines = []
try:
    url = None
    for line in demo.stdout:
        lines.append(line); print(line, end="")
        m = re.search(r"status page   (http://\S+)/", line)
        if m: url = m.group(1)
        if "ALERT FIRING   AmpSustainedLossScaleBackoff" in line:
            break
    time.sleep(1.5)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 860})
        page.goto(url + "/#run=demo-readme")
        page.wait_for_selector("circle.skip-mark", timeout=15000)
        time.sleep(1.0)
        page.screenshot(path=out_path)
        browser.close()
finally:
    os.killpg(demo.pid, signal.SIGINT)
    try:
        demo.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
