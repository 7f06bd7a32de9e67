"""A real collector (``python -m ampwatch.server``) in a child process on a free loopback port.

For tests, benchmarks (bench/_servers.py) and the demo (examples/demo.py), which import it as installed
(``make venv`` installs ``support/`` editable).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from ampwatch_support.patience import START_S
from ampwatch_support.ports import free_port

__all__ = ["CollectorProcess"]


class CollectorProcess:
    """``python -m ampwatch.server`` in a child process; a context manager that always kills it.

    >>> with CollectorProcess(db="/tmp/x.db") as c:   # doctest: +SKIP
    ...     urllib.request.urlopen(c.url + "/metrics")
    """

    def __init__(self, db: str, *, port: int | None = None, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | None = None,
                 open_files: int | None = None) -> None:
        """``open_files``: the process's open-file limit, soft and hard (default: this process's)."""
        self.db, self.port, self.args, self.open_files = db, port or free_port(), list(args), open_files
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path or db + ".log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_S) -> CollectorProcess:
        """Start the process and wait until /readyz answers 200 (a hang after ``timeout`` seconds)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.server", "serve", "--port", str(self.port), "--db", self.db,
             "--log-level", "warning", *self.args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
            preexec_fn=None if self.open_files is None else self._limit_open_files)
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

    def _limit_open_files(self) -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) and reap the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill(signal.SIGTERM)
