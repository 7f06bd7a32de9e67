"""A real collector of an earlier commit: the server and contract of that commit, for ``PYTHONPATH``.

Tests of the agent against collectors in the field (one that knows only protocol v1, one from before the event
kinds of ``LISTED_EVENT_KINDS``) run the very code those collectors ran, taken from this checkout's git history.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import tarfile

import pytest

__all__ = ["ROOT", "older_collector", "BEFORE_LISTED_KINDS", "V1_ONLY"]

ROOT = pathlib.Path(__file__).resolve().parents[3]
V1_ONLY = "a95d20e"  # the last commit whose collector knows only protocol v1
BEFORE_LISTED_KINDS = "29e7ac7"  # the last commit whose collector knows neither loss_spike nor grad_norm_spike


def older_collector(commit: str, into: pathlib.Path, what: str) -> dict[str, str]:
    """Extract the server and contract of ``commit`` (``what`` says which collector it is) into ``into``; return
    the environment that runs :class:`~ampwatch_support.collector_process.CollectorProcess` on them.

    The contract travels with the server: the old server reads the alert declarations of its own time.
    Skips the test where this checkout's git history lacks that commit (a shallow clone, a source archive).
    """
    try:
        found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", commit + "^{commit}"],
                               capture_output=True).returncode == 0
    except FileNotFoundError:  # no git at all
        found = False
    if not found:
        pytest.skip(f"needs commit {commit} ({what}) in this checkout's git history, which a shallow clone or a "
                    "source archive lacks: `git fetch --unshallow` brings it")
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, "server/src", "contract/src"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    path = os.pathsep.join([str(into / "server" / "src"), str(into / "contract" / "src")])
    return {"PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
