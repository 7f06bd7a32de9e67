"""End to end: a job killed mid-run and resumed from its checkpoint in a new process, at a real collector.

The first process checkpoints every 4 iterations and SIGKILLs itself after iteration 11 (no close, no
exit flush); the second builds new objects, watches them, loads the checkpoint of iteration 8 (the
loss scale jumps outside ``update()``) and trains to the end, so iterations 8-10 run twice. The
collector's totals over both processes must equal what the two processes really did, and the jump
must be a restore, never a backoff or a growth.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

import pytest

from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.exposition import value
from ampwatch_support.patience import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = pathlib.Path(__file__).with_name("resume_job.py")
RUN = "resume-e2e"


def _truth(path: pathlib.Path) -> dict:
    """Totals over every iteration either process really ran (redone iterations count twice)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    iterations = [line for line in lines if "iteration" in line]
    totals = {"backoffs": 0, "growths": 0, "steps": {"a": 0, "b": 0}, "skipped": {"a": 0, "b": 0}}
    for line in iterations:
        totals["backoffs"] += line["after"] < line["before"]
        totals["growths"] += line["after"] > line["before"]
        for name, stepped in line["stepped"].items():
            totals["steps" if stepped else "skipped"][name] += 1
    totals["starts"] = [line for line in lines if "incarnation_start" in line]
    totals["final_scale"] = iterations[-1]["after"]
    return totals


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def test_a_job_killed_and_resumed_from_a_checkpoint_reports_totals_equal_to_ground_truth(tmp_path):
    truth_path, checkpoint = tmp_path / "truth.jsonl", tmp_path / "job.ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMPWATCH_", "RANK", "WORLD_SIZE"))}
    with CollectorProcess(db=str(tmp_path / "collector.db")) as collector:
        job = [sys.executable, str(JOB), "--collector", collector.url, "--run", RUN,
               "--checkpoint", str(checkpoint), "--truth", str(truth_path), "--iterations", "26", "--every", "4"]
        first = subprocess.run([*job, "--kill-after", "11"], env=env, capture_output=True, text=True, timeout=180)
        assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
        second = subprocess.run([*job, "--resume"], env=env, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "rebind" not in second.stderr, "the resumed job was warned about an unwatched scaler"

        truth = _truth(truth_path)
        assert [s["incarnation_start"] for s in truth["starts"]] == [0, 8]
        # The second process's close batch was acked before it exited.
        run = wait_until(lambda: (run := json.loads(_get(f"{collector.url}/v1/runs/{RUN}")))["closed"] and run,
                         what="the run to show closed", every=0.2)
        (rank,) = run["ranks"]
        assert rank["incarnations"] == 2 and rank["closed"]

        text = _get(collector.url + "/metrics")
        labels = {"run": RUN, "rank": "0"}
        assert value(text, "ampwatch_loss_scale_backoffs_total", **labels) == truth["backoffs"]
        assert value(text, "ampwatch_loss_scale_growths_total", **labels) == truth["growths"]
        assert value(text, "ampwatch_loss_scale_manual_sets_total", **labels) == 0
        assert value(text, "ampwatch_loss_scale", **labels) == truth["final_scale"]
        for name in ("a", "b"):
            o = dict(labels, optimizer=name)
            assert value(text, "ampwatch_optimizer_steps_total", **o) == truth["steps"][name], name
            assert value(text, "ampwatch_optimizer_skipped_steps_total", **o) == truth["skipped"][name], name
            # Each scheduler is stepped after every iteration, skipped or not: one count per skip.
            assert value(text, "ampwatch_optimizer_scheduler_steps_after_skip_total", **o) == truth["skipped"][name]

        events = json.loads(_get(f"{collector.url}/v1/runs/{RUN}/events?kind=scale_change&limit=1000"))["events"]
        restored = [e for e in events if e["cause"] == "restored"]
        assert len(restored) == 1 and restored[0]["incarnation"] == rank["incarnation"]
        assert restored[0]["before"] == 2.0 ** 12 and restored[0]["after"] == truth["starts"][1]["scale"]
        causes = [e["cause"] for e in events]
        assert causes.count("backoff") == truth["backoffs"] and causes.count("growth") == truth["growths"]
        assert rank["scaler"]["init_scale"] == truth["starts"][1]["scale"], "settings follow the restored state"
