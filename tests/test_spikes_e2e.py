"""Spikes before they become skips, end to end: real gloo DDP jobs, the real agent, a real collector.

A planted loss spike (one batch with inputs x100) on one rank of two; one rank's gradients x1,000 at three random
iterations in a 4-rank job; a healthy 4-rank run of 2,000 iterations with ordinary noise and a learning-rate
warm-up. The truth comes from what the ranks planted (``ampwatch_support.spike_job`` writes it); the healthy run's
highest z-score is the figure docs/alerts.md states, computed from the values the job itself read, through the
agent's own spike rule.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import urllib.parse

import httpx
import pytest

from ampwatch.agent._spikes import SpikeSeries
from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.patience import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(url: str, run: str, out: pathlib.Path, *args: str, ranks: int) -> list[dict]:
    job = subprocess.run([sys.executable, "-m", "ampwatch_support.spike_job", "--collector", url, "--run", run,
                          "--out", str(out), "--ranks", str(ranks), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=800)
    assert job.returncode == 0, job.stdout.decode()[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _get(url: str, path: str) -> dict:
    answer = httpx.get(url + path, timeout=30)
    answer.raise_for_status()
    return answer.json()


def _closed(url: str, run: str, ranks: int) -> dict | None:
    try:
        view = _get(url, f"/v1/runs/{urllib.parse.quote(run)}")
    except httpx.HTTPError:
        return None
    return view if len(view["ranks"]) == ranks and all(r["closed"] for r in view["ranks"]) else None


def _events(url: str, run: str, kind: str) -> list[dict]:
    return _get(url, f"/v1/runs/{urllib.parse.quote(run)}/events?kind={kind}&limit=1000")["events"]


def _alerts(url: str, name: str, state: str) -> list[dict]:
    return [a for a in _get(url, "/v1/alerts")[state] if a["name"] == name]


@pytest.fixture
def collector(tmp_path, monkeypatch):
    for var in ("AMPWATCH_URL", "AMPWATCH_DISABLED", "AMPWATCH_SPOOL_DIR", "AMPWATCH_SPIKE_WINDOW",
                "AMPWATCH_SPIKE_SIGMA", "AMPWATCH_GRAD_NORM"):
        monkeypatch.delenv(var, raising=False)
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"spike_window_s": 5, "outlier_window_s": 5}))
    with CollectorProcess(str(tmp_path / "c.db"), args=["--alert-thresholds", str(thresholds)]) as process:
        yield process


def test_one_bad_batch_is_a_loss_spike_on_its_rank_at_its_iteration_and_its_alert_fires_and_resolves(
        collector, tmp_path):
    ranks = _run(collector.url, "loss", tmp_path / "loss", "--scenario", "loss", "--iterations", "200", "--at", "150",
                 ranks=2)
    assert ranks[1]["planted"] == [150] and ranks[0]["planted"] == []
    wait_until(lambda: _closed(collector.url, "loss", 2), what="both ranks closed")
    spikes = _events(collector.url, "loss", "loss_spike")
    assert [(e["rank"], e["iteration"], e["streak"]) for e in spikes] == [(1, 150, 1)]
    (spike,) = spikes
    assert spike["z"] >= DEFAULT_THRESHOLDS.spike_sigma and spike["value"] == pytest.approx(ranks[1]["losses"][150])
    # Its own gradients were out of line too; the other rank saw nothing of its own.
    local = _events(collector.url, "loss", "grad_norm_spike")
    assert {e["rank"] for e in local if e.get("local")} <= {1}
    view = _closed(collector.url, "loss", 2)
    assert [r.get("loss_spikes", 0) for r in sorted(view["ranks"], key=lambda r: r["rank"])] == [0, 1]
    firing = wait_until(lambda: _alerts(collector.url, "AmpLossSpike", "firing") or
                        _alerts(collector.url, "AmpLossSpike", "resolved"), what="AmpLossSpike")
    assert {a["labels"]["rank"] for a in firing} == {"1"}
    resolved = wait_until(lambda: not _alerts(collector.url, "AmpLossSpike", "firing") and
                          _alerts(collector.url, "AmpLossSpike", "resolved"), what="AmpLossSpike resolved")
    assert {a["labels"]["rank"] for a in resolved} == {"1"}


def test_one_ranks_gradients_x1000_are_a_gradient_outlier_naming_that_rank_at_those_iterations(collector, tmp_path):
    ranks = _run(collector.url, "gradient", tmp_path / "gradient", "--scenario", "gradient", "--iterations", "300",
                 "--odd-rank", "2", ranks=4)
    planted = ranks[2]["planted"]
    assert len(planted) == 3 and all(not r["planted"] for i, r in enumerate(ranks) if i != 2)
    wait_until(lambda: _closed(collector.url, "gradient", 4), what="every rank closed")
    spikes = _events(collector.url, "gradient", "grad_norm_spike")
    local = {(e["rank"], e["iteration"]) for e in spikes if e.get("local")}
    assert local == {(2, it) for it in planted}
    # The all-reduced gradients every rank stepped with spiked on every rank: rank 2's own among them.
    stepped = {(e["rank"], e["iteration"]) for e in spikes if not e.get("local")}
    assert {(2, it) for it in planted} <= stepped
    outliers = wait_until(lambda: len(_events(collector.url, "gradient", "gradient_outlier")) >= len(planted) and
                          _events(collector.url, "gradient", "gradient_outlier"), what="three gradient outliers")
    assert sorted((e["rank"], e["iteration"]) for e in outliers) == [(2, it) for it in planted]
    alerts = wait_until(lambda: _alerts(collector.url, "AmpRankGradientOutlier", "firing") or
                        _alerts(collector.url, "AmpRankGradientOutlier", "resolved"), what="AmpRankGradientOutlier")
    assert {a["labels"]["rank"] for a in alerts} == {"2"}


def test_a_healthy_run_of_2000_iterations_on_4_ranks_has_no_spike_and_no_outlier(collector, tmp_path):
    ranks = _run(collector.url, "healthy", tmp_path / "healthy", "--scenario", "healthy", "--iterations", "2000",
                 ranks=4)
    view = wait_until(lambda: _closed(collector.url, "healthy", 4), what="every rank closed")
    for kind in ("loss_spike", "grad_norm_spike", "gradient_outlier"):
        assert _events(collector.url, "healthy", kind) == [], kind
    for rank in view["ranks"]:
        assert rank.get("loss_spikes", 0) == 0
        assert all(o.get("grad_norm_spikes", 0) == 0 for o in rank["optimizers"].values())
    # How far from a false positive it was: the highest z-score of either signal on any rank, through the agent's
    # own rule and window (docs/alerts.md states it).
    highest = 0.0
    for rank in ranks:
        for values in (rank["losses"], rank["grad_norms"]):
            series = SpikeSeries(DEFAULT_THRESHOLDS.spike_window_iterations, DEFAULT_THRESHOLDS.spike_sigma)
            for value in values:
                highest = max(highest, series.z(value) or 0.0)
                series.observe(value)
    print(f"healthy run: highest z-score {highest:.2f} (spike at {DEFAULT_THRESHOLDS.spike_sigma})")
    assert highest < DEFAULT_THRESHOLDS.spike_sigma
