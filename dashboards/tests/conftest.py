"""Fixtures of the dashboards tests: the Debian tools they drive for real."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/run (it installs it from Debian) or apt-get install it")
    return path


@pytest.fixture
def run_tool() -> Callable[..., subprocess.CompletedProcess]:
    """Return a runner for promtool, amtool, vmagent, vmalert or docker-compose: bounded in time, output captured."""
    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_tool(args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=60)
    return run
