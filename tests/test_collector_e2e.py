"""End to end: a real collector, a real 2-rank gloo DDP job with the real agent, overflow in a known window.

The ground truth is computed here from the job's parameters: rank 0's input holds an inf on the
overflow iterations, DDP's all-reduce spreads it, so on each of those iterations both ranks skip both
optimizers and back the scale off once; growth is off (growth_interval 100,000).
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import START_S, wait_until

JOB = pathlib.Path(__file__).with_name("e2e_ddp_job.py")
ITERATIONS = 80
OVERFLOW = list(range(30, 38))  # one streak of 8 skips


def _truth() -> dict:
    skipped = len(OVERFLOW)
    return {"steps": ITERATIONS - skipped, "skipped": skipped, "backoffs": skipped, "growths": 0,
            "scale": 65536.0 * 0.5 ** skipped, "longest": skipped,
            "reached": {str(2 ** i): int(2 ** i <= skipped) for i in range(11)},
            # The inf enters the first layer, so every parameter's gradient is non-finite and the first
            # one of each optimizer (in named_parameters order) is the one named.
            "first_param": {"body": "0.weight", "head": "2.weight"}}


def _run_job(url: str, run: str, sleep: float, timeout: float = 120) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOB), "--collector", url, "--run", run, "--iterations",
                             str(ITERATIONS), "--overflow-at", f"{OVERFLOW[0]}-{OVERFLOW[-1]}", "--sleep", str(sleep)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _check_against_truth(url: str, run: str) -> None:
    truth = _truth()
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for rank in ("0", "1"):
        r = {"run": run, "rank": rank}
        assert value(text, "ampwatch_rank_closed", **r) == 1
        # The inf was in rank 0's input: rank 0 is where every skipped iteration started (issue 17).
        assert value(text, "ampwatch_rank_origin_iterations_total", **r) == (len(OVERFLOW) if rank == "0" else 0)
        assert value(text, "ampwatch_iteration", **r) == ITERATIONS
        assert value(text, "ampwatch_loss_scale_backoffs_total", **r) == truth["backoffs"]
        assert value(text, "ampwatch_loss_scale_growths_total", **r) == truth["growths"]
        assert value(text, "ampwatch_loss_scale", **r) == truth["scale"]
        for opt in ("body", "head"):
            o = dict(r, optimizer=opt)
            assert value(text, "ampwatch_optimizer_steps_total", **o) == truth["steps"], (rank, opt)
            assert value(text, "ampwatch_optimizer_skipped_steps_total", **o) == truth["skipped"], (rank, opt)
            assert value(text, "ampwatch_optimizer_consecutive_skipped_steps", **o) == 0
            assert value(text, "ampwatch_optimizer_longest_skip_streak", **o) == truth["longest"]
            for length, count in truth["reached"].items():
                # A rung is exposed once a streak reached it.
                assert value(text, "ampwatch_optimizer_skip_streaks_total", min_length=length, **o) == (count or None)
            assert value(text, "ampwatch_nonfinite_gradient_info", parameter=truth["first_param"][opt], **o) == 1
    with urllib.request.urlopen(f"{url}/v1/runs/{run}/events?kind=skip&limit=1000", timeout=10) as answer:
        skips = json.load(answer)["events"]
    # The streak of 8 is sent as its rungs, its 1st, 2nd, 4th and 8th skip, per rank and optimizer (the origin
    # stays the same through it): nothing lost, nothing twice; its end carries its length.
    rungs = [OVERFLOW[n - 1] for n in (1, 2, 4, 8)]
    assert sorted((e["rank"], e["optimizer"], e["iteration"], e["streak"]) for e in skips) == \
        sorted((rank, opt, it, it - OVERFLOW[0] + 1) for rank in (0, 1) for opt in ("body", "head") for it in rungs)
    with urllib.request.urlopen(f"{url}/v1/runs/{run}/events?kind=streak_end&limit=1000", timeout=10) as answer:
        ends = json.load(answer)["events"]
    assert sorted((e["rank"], e["optimizer"], e["start_iteration"], e["length"]) for e in ends) == \
        sorted((rank, opt, OVERFLOW[0], len(OVERFLOW)) for rank in (0, 1) for opt in ("body", "head"))
    assert all(e["origin"] is (e["rank"] == 0) for e in skips)
    assert all(e["origin_params"] for e in skips if e["rank"] == 0)
    with urllib.request.urlopen(f"{url}/v1/runs/{run}", timeout=10) as answer:
        summary = json.load(answer)
    assert [(o["rank"], o["local_rank"], o["origin_iterations"]) for o in summary["origin_ranks"]] == \
        [(0, 0, len(OVERFLOW))]
    assert [r["origin_iterations"] for r in summary["ranks"]] == [len(OVERFLOW), 0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_two_rank_ddp_job_with_injected_overflow_yields_exactly_the_ground_truth(tmp_path):
    with CollectorProcess(str(tmp_path / "ampwatch.db")) as collector:
        job = _run_job(collector.url, "e2e", sleep=0.0)
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out.decode()[-3000:]
        _check_against_truth(collector.url, "e2e")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_collector_mid_job_then_restart_ends_at_exactly_the_ground_truth(tmp_path):
    collector = CollectorProcess(str(tmp_path / "ampwatch.db")).start()
    job = None
    try:
        job = _run_job(collector.url, "e2e-kill", sleep=0.05)  # ~4 s of training
        def under_way() -> float | None:  # kill once the job is visibly under way
            with urllib.request.urlopen(collector.url + "/metrics", timeout=5) as answer:
                return value(answer.read().decode(), "ampwatch_iteration", run="e2e-kill", rank="0")

        wait_until(under_way, START_S, "the job to report", every=0.2)
        collector.kill(signal.SIGKILL)
        time.sleep(1.0)  # the agents retry against a dead collector meanwhile
        collector.start()
        out, _ = job.communicate(timeout=180)
        assert job.returncode == 0, out.decode()[-3000:]
        _check_against_truth(collector.url, "e2e-kill")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(10)
        collector.kill()
