"""Retake docs/images/status-page.png: run the demo, open its run view in headless Chromium while an alert fires.

    .venv/bin/python docs/images/status-page.py docs/images/status-page.png

Uses Debian's chromium through Playwright, with the tests' own launcher (``ampwatch_support.headless_browser``).
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ampwatch_support.headless_browser import open_page

REPO = Path(__file__).resolve().parents[2]
out_path = sys.argv[1]
demo = subprocess.Popen([sys.executable, f"{REPO}/examples/demo.py", "--port", "0", "--data",
                         tempfile.mkdtemp(prefix="ampwatch-shot-"),
                         "--run", "demo-readme"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)
lines = []
try:
    url = None
    for line in demo.stdout:
        lines.append(line)
        print(line, end="")
        m = re.search(r"status page   (http://\S+)/", line)
        if m:
            url = m.group(1)
        if "ALERT FIRING   AmpSustainedLossScaleBackoff" in line:
            break
    time.sleep(1.5)
    with open_page(url + "/#run=demo-readme", width=1200, height=860) as (page, _problems):
        page.wait_for_selector("circle.skip-mark", timeout=15000)
        time.sleep(1.0)
        page.screenshot(path=out_path)
finally:
    os.killpg(demo.pid, signal.SIGINT)
    try:
        demo.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
