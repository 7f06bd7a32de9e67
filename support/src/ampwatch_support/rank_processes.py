"""Ranks as real processes: start one running a :mod:`fault_training` script, wait on it, check what it reported.

Each rank is its own process with the real agent, as on a real job, so a test can kill it, stop it or
fork from it without touching the test process. Ranks are forked from one server process that imported
torch once (multiprocessing's forkserver, as ``torch.multiprocessing`` can start ranks): a fresh
interpreter spends about 5 s of CPU importing torch and building its first optimizer, which on a loaded
2-core machine kept four ranks from reporting for over a minute. Nothing of the agent runs before the
fork. What a rank must have reported is ``fault_training.Trainer.truth()``, which its script writes out
when it ends.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ampwatch_support.exposition import value
from ampwatch_support.patience import SETTLE_S, wait_until

__all__ = ["RankProcess", "check_rank_truth", "kill_all", "spawn_rank", "wait_for"]

# What every rank imports first, done once in the fork server: torch, and what its first optimizer pulls in.
_PRELOAD = ["torch", "torch._dynamo", "ampwatch.agent"]
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


class RankProcess:
    """A rank forked from the fork server; the parts of :class:`subprocess.Popen` the tests use.

    Its output (stdout and stderr together) goes to a file that :meth:`communicate` reads back.
    """

    def __init__(self, script: str, argv: list[str], environ: dict[str, str]) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="ampwatch-rank-", suffix=".log")
        self._process = _context.Process(target=_run_rank, args=(script, argv, environ, self._log.name),
                                         name="rank " + environ["RANK"])
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the rank ended (minus the signal that killed it), else None."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the rank to end and return its output (and None, as Popen does for stderr)."""
        self.wait(timeout)
        return Path(self._log.name).read_text(errors="replace"), None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_rank(script: str, argv: list[str], environ: dict[str, str], log: str) -> None:
    """In the forked rank: take its environment and output file, run ``script``, exit as an interpreter does."""
    os.environ.clear()
    os.environ.update(environ)
    with open(log, "ab", buffering=0) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.argv = ["-c", *argv]
    try:
        exec(compile(script, "<rank script>", "exec"), {"__name__": "__main__"})
    finally:
        atexit._run_exitfuncs()  # a forked child skips them; a rank's interpreter would run them (the exit flush)


def spawn_rank(script: str, *args: str, rank: int = 0, world_size: int = 1,
               env: dict[str, str] | None = None) -> RankProcess:
    """Run ``script`` (dedented; ``args`` in its ``sys.argv``) as rank ``rank`` of ``world_size``; output kept.

    The script can import ``ampwatch_support``; ``env`` adds to the environment. Retries back off at most 0.3 s, so the
    rank resumes within a test's patience; no disk spool unless ``env`` names one, whatever the test process has.
    """
    environ = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "AMPWATCH_MAX_BACKOFF": "0.3"}
    environ.pop("AMPWATCH_SPOOL_DIR", None)
    environ.update(env or {})
    return RankProcess(textwrap.dedent(script), list(args), environ)


def kill_all(ranks: Iterable[RankProcess]) -> None:
    """Kill every rank still running (one a test stopped with SIGSTOP too), and reap it: a test's teardown."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(SETTLE_S)


def wait_for(predicate: Callable[[], Any], timeout: float = SETTLE_S, what: str = "the ranks") -> None:
    """Poll ``predicate`` every 0.1 s until it returns something true; fail after ``timeout`` seconds."""
    wait_until(predicate, timeout, what, every=0.1)


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
