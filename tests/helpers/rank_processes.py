"""Ranks as real processes: start one running a :mod:`fault_training` script, wait on it, check what it reported.

Each rank is its own interpreter with the real agent, as on a real job, so a test can kill it,
stop it or fork from it without touching the test process. What a rank must have reported is
``fault_training.Trainer.truth()``, which its script writes out when it ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Optional

from exposition import value

__all__ = ["check_rank_truth", "spawn_rank", "wait_for"]

HELPERS = Path(__file__).resolve().parent


def spawn_rank(script: str, *args: str, rank: int = 0, world_size: int = 1,
               env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Run ``script`` (dedented; ``args`` in its ``sys.argv``) as rank ``rank`` of ``world_size``; output piped.

    The script can import these helpers; ``env`` adds to the environment. Retries back off at most 0.3 s, so the
    rank resumes within a test's patience; no disk spool, whatever the test process has.
    """
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "AMPWATCH_MAX_BACKOFF": "0.3", **(env or {})}
    environ.pop("AMPWATCH_SPOOL_DIR", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate: Callable[[], Any], timeout: float) -> None:
    """Poll ``predicate`` every 0.1 s until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def check_rank_truth(text: str, run: str, rank: int, truth: dict) -> None:
    """Assert that the exposition ``text`` shows the rank's ``truth`` exactly, as a rank that closed."""
    labels = {"run": run, "rank": str(rank)}
    main = dict(labels, optimizer="main")
    assert value(text, "ampwatch_optimizer_skipped_steps_total", **main) == len(truth["skipped_at"])
    assert value(text, "ampwatch_optimizer_steps_total", **main) == truth["steps"]
    assert value(text, "ampwatch_loss_scale_backoffs_total", **labels) == truth["backoffs"]
    assert value(text, "ampwatch_loss_scale_growths_total", **labels) == truth["growths"]
    assert value(text, "ampwatch_iteration", **labels) == truth["iterations"]
    assert value(text, "ampwatch_rank_closed", **labels) == 1
