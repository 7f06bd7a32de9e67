"""Start the real Prometheus (and friends) for end-to-end tests; stop every process it started, even on failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from ampwatch_support.patience import START_S

__all__ = ["Processes", "binary", "get", "query", "query_range", "start_prometheus", "wait_for_scrapes", "wait_until"]


def binary(name: str) -> str:
    """Return the path of a Debian-installed program, or fail the test saying how to install it."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/run (it installs it from Debian)")
    return path


def get(url: str, timeout: float = 5.0) -> bytes:
    """Return the body of a GET."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_until(predicate: Callable[[], Any], timeout: float, what: Callable[[], str] | str) -> Any:
    """Poll ``predicate`` until it returns something true; fail with ``what`` after ``timeout`` seconds.

    Unlike patience.wait_until, an OSError (Prometheus not listening yet) counts as not yet.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for: {what() if callable(what) else what}")


class Processes:
    """Start processes in their own session and stop each of them (by its id) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.started = logs, []

    def start(self, name: str, args: list[str], **kwargs: Any) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
        self.started.append((name, process, log))
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for _, process, log in reversed(self.started):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # the session this helper started for it
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
            log.close()


def start_prometheus(processes: Processes, folder: Path, port: int, rules: str, targets: Sequence[str],
                     alertmanager: str | None = None, interval: str = "1s", name: str = "prometheus",
                     external_labels: dict[str, str] | None = None) -> str:
    """Start Prometheus scraping ``targets`` every ``interval`` with the rule file ``rules``; return its URL.

    ``name`` names its process, log, files and data in ``folder``, so that several can share one folder;
    ``external_labels`` are added to every alert it sends (what tells two Prometheus apart in one Alertmanager).
    """
    (folder / f"{name}-rules.yaml").write_text(rules)
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   **({"external_labels": external_labels} if external_labels else {})},
        "rule_files": [f"{name}-rules.yaml"],
        "scrape_configs": [{"job_name": "ampwatch", "static_configs": [{"targets": list(targets)}]}],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    (folder / f"{name}.yml").write_text(yaml.safe_dump(config))
    processes.start(name, [binary("prometheus"), f"--config.file={folder / f'{name}.yml'}",
                           f"--storage.tsdb.path={folder / name}", f"--web.listen-address=127.0.0.1:{port}"])
    return f"http://127.0.0.1:{port}"


def query(prometheus: str, expr: str) -> list[dict]:
    """Return the series of an instant query, now."""
    answer = json.loads(get(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def query_range(prometheus: str, expr: str, start: float, end: float | None = None) -> list[dict]:
    """Return the series of a range query at a 1 s step from ``start`` to ``end`` (default: now)."""
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end or time.time(), "step": "1"})
    answer = json.loads(get(f"{prometheus}/api/v1/query_range?{params}"))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def wait_for_scrapes(processes: Processes, prometheus: str, targets: int = 1, name: str = "prometheus") -> None:
    """Wait until Prometheus is ready and then until it has scraped ``targets`` targets successfully.

    Prometheus scrapes a few seconds after it is ready (target discovery is throttled to every 5 s): what a
    test sends before that first scrape would be missing from its history.
    """
    wait_until(lambda: get(prometheus + "/-/ready"), START_S,
               lambda: f"{name} ready\n" + processes.log(name))
    wait_until(lambda: len(query_range(prometheus, "up == 1", time.time() - 2)) >= targets, START_S,
               f"Prometheus to scrape {targets} target(s)")
