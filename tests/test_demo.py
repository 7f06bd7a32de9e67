"""`make demo ARGS=--once`: a real collector and a real 2-rank DDP job show skips, backoff, recovery and alerts."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampwatch.contract.protocol import STREAK_LADDER
from ampwatch.contract.thresholds import DEMO_THRESHOLDS
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals, ladder
from ampwatch.server.alerting.evaluator import BuiltinAlerts

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.py"


@pytest.fixture(scope="module")
def demo():
    """examples/demo.py as a module (what it imports besides the standard library is installed)."""
    spec = importlib.util.spec_from_file_location("ampwatch_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


@pytest.mark.slow
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
    for name in ("AmpRunSkipStorm", "AmpSustainedLossScaleBackoff"):  # both ranks skip together: one alert
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
    # Where to look was said while the collector ran; after --once stopped it, no dead links, but how to look again.
    assert "status page   http://127.0.0.1:" in out[:out.index("Summary of run")]
    assert "status page   http://" not in summary, summary
    assert "The collector has stopped (--once)" in summary and f"ampwatch-server --db {tmp_path / 'demo.db'}" in summary
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


def test_the_demo_refuses_a_pace_its_alert_windows_are_not_sized_for():
    result = subprocess.run([sys.executable, str(DEMO), "--pace", "0.02"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "give 0.1 to 1 s" in result.stderr


class _DemoJob:
    """The demo job's counters by iteration, as its GradScaler moves them (growth_interval clean steps grow)."""

    def __init__(self, growth_interval: int, trouble: range, iterations: int) -> None:
        self.backoffs, self.growths, self.skips = [0], [0], [0]  # cumulative, after iteration i - 1
        clean = 0
        for i in range(iterations):
            skipped = i in trouble
            clean = 0 if skipped else clean + 1
            grew = clean == growth_interval
            clean = 0 if grew else clean
            self.backoffs.append(self.backoffs[-1] + skipped)
            self.growths.append(self.growths[-1] + grew)
            self.skips.append(self.skips[-1] + skipped)
        self.trouble = trouble

    def snapshot(self, rank: int, done: int, now: float, closed: bool) -> RankSnapshot:
        """What a batch sent after ``done`` iterations carries."""
        skipped = self.skips[done]
        streak = done - self.trouble.start if self.trouble.start < done <= self.trouble.stop else 0
        reached = {length: 1 for length in STREAK_LADDER if length <= skipped}  # one streak: the trouble
        return RankSnapshot(run="demo", rank=rank, last_seen=now, iteration=done, closed=closed,
                            totals=RankTotals(backoffs=self.backoffs[done], growths=self.growths[done]),
                            optimizers={"body": OptimizerTotals(steps=done - skipped, skipped=skipped,
                                                                streaks_reached=ladder(reached))},
                            consecutive_skipped={"body": streak})


def _alerts_of_the_demo(demo, seconds_per_iteration: float, push_interval: float) -> tuple[set, set]:
    """The demo's job played on a simulated clock at this pace: the alerts that fired and those that resolved."""
    iterations = 150
    job = _DemoJob(demo.GROWTH_INTERVAL, demo.TROUBLE, iterations)
    alerts = BuiltinAlerts(DEMO_THRESHOLDS)
    end = iterations * seconds_per_iteration + DEMO_THRESHOLDS.skip_streak_window_s + 10
    moments = sorted([(k * push_interval + rank * 0.01, rank) for rank in (0, 1)
                      for k in range(int(end / push_interval) + 1)] +
                     [(k + 0.37, None) for k in range(int(end) + 1)])  # None: a tick
    fired: set[str] = set()
    resolved: set[str] = set()
    for now, rank in moments:
        if rank is None:
            changes = alerts.evaluate(now)
        else:
            done = min(int(now / seconds_per_iteration), iterations)
            changes = alerts.observe(job.snapshot(rank, done, now, closed=done == iterations), now)
        for change in changes:
            (fired if change.status == "firing" else resolved).add(change.name)
    return fired, resolved


@pytest.mark.parametrize("push_interval", [0.5, 2.0])
@pytest.mark.parametrize("seconds_per_iteration", [0.1, 0.15, 0.3, 1.0, 2.0])
def test_the_demo_profile_fires_and_resolves_the_demos_alerts_whatever_the_pace(demo, seconds_per_iteration,
                                                                                push_interval):
    # The demo's job, fast or slowed down by a loaded machine, with batches as often as the agent sends them (or
    # late) and the collector's 1 s evaluation tick: the same iterations must fire the same alerts as at the
    # demo's own pace (0.15 s an iteration, a batch every 0.5 s), and each must resolve. Compared with that pace,
    # not a list, so that an alert added to the contract that the demo's trouble trips breaks no pace.
    fired, resolved = _alerts_of_the_demo(demo, seconds_per_iteration, push_interval)
    at_its_own_pace, _ = _alerts_of_the_demo(demo, 0.15, 0.5)
    assert fired == resolved == at_its_own_pace
    assert {"AmpRunSkipStorm", "AmpSustainedLossScaleBackoff"} <= fired  # its two ranks skip together


def test_the_port_check_ignores_an_earlier_runs_connections_in_time_wait_but_not_a_listener(demo):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    with pytest.raises(SystemExit, match=f"port {port} on 127.0.0.1 is in use"):
        demo.check_port(port)  # something listens: the collector could not
    accepted.close()  # the server's side closes first, so its end of the connection lingers in TIME_WAIT
    client.close()
    listener.close()
    deadline = time.monotonic() + 10
    while True:  # the trap: a plain bind, without SO_REUSEADDR, trips on the lingering connection
        with socket.socket() as plain:
            try:
                plain.bind(("127.0.0.1", port))
            except OSError:
                break
        assert time.monotonic() < deadline, "the closed connection never lingered in TIME_WAIT"
        time.sleep(0.05)
    assert demo.check_port(port) == port
