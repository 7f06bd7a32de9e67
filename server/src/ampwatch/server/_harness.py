"""Start a real collector process on a free loopback port (for tests, benchmarks and demos)."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Optional, Sequence

__all__ = ["CollectorProcess", "free_port", "make_batch", "optimizer", "skip_event", "samples", "value"]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CollectorProcess:
    """``python -m ampwatch.server`` in a child process; a context manager that always kills it.

    >>> with CollectorProcess(db="/tmp/x.db") as c:   # doctest: +SKIP
    ...     urllib.request.urlopen(c.url + "/metrics")
    """

    def __init__(self, db: str, *, port: Optional[int] = None, args: Sequence[str] = (),
                 env: Optional[dict[str, str]] = None, log_path: Optional[str] = None) -> None:
        self.db, self.port, self.args = db, port or free_port(), list(args)
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path or db + ".log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "CollectorProcess":
        """Start the process and wait until /readyz answers 200."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.server", "serve", "--port", str(self.port), "--db", self.db,
             "--log-level", "warning", *self.args], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"collector not ready after {timeout}s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) and reap the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "CollectorProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill(signal.SIGTERM)


# Protocol v1 batches built by hand (tests and benchmarks; the real agent is tested against the same schema).
BASE: dict[str, Any] = {
    "protocol": 1, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": "exp-42", "rank": 0,
    "world_size": 2, "local_rank": 0, "host": "node-a", "pid": 4242,
    "incarnation": "6f1c0e0c3a5b4f6e9d2a7b8c9d0e1f2a", "seq": 1, "sent_at": 1764400000.25,
    "scaler": {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
               "backoff_factor": 0.5, "growth_interval": 2000},
    "state": {"iteration": 0, "loss_scale": 65536.0, "backoffs": 0, "growths": 0, "manual_sets": 0,
              "optimizers": {}, "delivery": {"dropped_events": 0, "send_failures": 0, "rejected_batches": 0,
                                             "agent_errors": 0}},
    "events": [], "closed": False,
}


def optimizer(steps: int = 0, skipped: int = 0, consecutive: int = 0, longest: int = 0, streaks: int = 0,
              reached: dict[str, int] | None = None, **extra: int) -> dict[str, Any]:
    """Counters of one optimizer as the agent sends them."""
    return {"steps": steps, "skipped": skipped, "consecutive_skipped": consecutive, "longest_streak": longest,
            "streaks": streaks, "streaks_reached": reached or {}, "scheduler_steps_after_skip": 0,
            "poisoned_steps": 0, **extra}


def make_batch(*, optimizers: dict[str, dict] | None = None, events: list[dict] | None = None,
               **fields: Any) -> dict[str, Any]:
    """A valid protocol v1 batch; keyword arguments replace top-level fields or ``state`` fields."""
    batch = copy.deepcopy(BASE)
    for key, value in fields.items():
        if key in batch["state"]:
            batch["state"][key] = value
        else:
            batch[key] = value
    batch["state"]["optimizers"] = optimizers if optimizers is not None else {"gen": optimizer()}
    batch["events"] = events or []
    return batch


def skip_event(id: int, optimizer: str = "gen", iteration: int = 0, streak: int = 1,
               params: tuple[str, ...] = ("fc.weight",)) -> dict[str, Any]:
    return {"id": id, "kind": "skip", "time": time.time(), "iteration": iteration, "optimizer": optimizer,
            "streak": streak, "params": [{"name": p, "inf": 1, "nan": 0} for p in params],
            "params_total": len(params), "inspected": True}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse an exposition into ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of an exposition, or None when absent."""
    return samples(text).get((name, frozenset(labels.items())))
