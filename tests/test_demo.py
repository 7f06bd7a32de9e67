"""`make demo ARGS=--once`: a real collector and a real 2-rank DDP job show skips, backoff, recovery and alerts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.py"

pytestmark = [pytest.mark.slow]


def _run_demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # Its own session: on a timeout, the demo, its collector and its rank processes all go.
    process = subprocess.Popen([sys.executable, str(DEMO), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # the demo stops its job and collector on SIGTERM
        out, _ = process.communicate(timeout=30)
        pytest.fail(f"the demo ran past {timeout:.0f} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out)


@pytest.mark.timeout(300)
def test_the_demo_once_shows_skips_backoff_recovery_an_alert_that_fired_then_resolved_and_a_summary(tmp_path):
    result = _run_demo("--once", "--port", "0", "--data", str(tmp_path), "--iterations", "150", timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    # Live progress: iterations and the scale of every rank.
    assert re.search(r"iteration +\d+/150 \| loss scale r0=2\^\d+ r1=2\^\d+", out), out[-4000:]
    # The trouble: skips naming the offending parameters, backoffs; then the recovery: steps again, growth.
    assert re.search(r"skipped: body at iteration 80, non-finite gradients in body\.0\.weight", out), out[-4000:]
    # growth_interval=30: the scale grew twice during the warm-up (2^16 -> 2^18), backs off 8 times, grows again.
    assert "backoff: loss scale 2^18 -> 2^17 at iteration 80" in out
    assert "recovered: body steps again at iteration 88 after 8 skips in a row" in out
    assert "growth: loss scale 2^10 -> 2^11 at iteration 117" in out
    # Alerts, each fired and then resolved, in that order.
    for name in ("AmpConsecutiveSkippedSteps", "AmpSustainedLossScaleBackoff"):
        fired = out.find(f"ALERT FIRING   {name}")
        resolved = out.find(f"ALERT RESOLVED {name}")
        assert -1 < fired < resolved, (name, out[-4000:])
    # The summary, from the collector: skips per optimizer, transitions, offending parameters, alerts.
    summary = out[out.index("Summary of run"):]
    for rank in (0, 1):
        assert (f"rank {rank}: 150 iterations; body skipped 8 of 150 steps (longest streak 8), "
                f"head skipped 8 of 150 steps (longest streak 8); loss scale: 8 backoffs, 4 growths") in summary
    assert "offending parameters" in summary and "body: body.0.weight x" in summary and "head: head.weight x" in summary
    assert "alert AmpSustainedLossScaleBackoff (warning, run=demo-" in summary and "still firing" not in summary
    assert f"status page   http://127.0.0.1:" in summary and "/metrics" in summary
    assert (tmp_path / "demo.db").exists()


def test_the_demo_help_says_what_it_does_and_its_options():
    out = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=60).stdout
    for option in ("--ranks", "--once", "--port", "--data", "--iterations", "--pace", "--run"):
        assert option in out
    assert "Ctrl-C" in out and "DDP" in out


def test_the_demo_refuses_too_few_iterations_saying_why():
    result = subprocess.run([sys.executable, str(DEMO), "--iterations", "50"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "at least 150" in result.stderr
