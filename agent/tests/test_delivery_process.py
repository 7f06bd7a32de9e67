"""Delivery across process boundaries: interpreter exit flushes, a forked child never sends."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from recording_collector import RecordingCollector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HELPERS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "helpers"

PRELUDE = """
import os, sys, time
from delivery_harness import make_sender
url, mode = sys.argv[1], sys.argv[2]
"""


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_interpreter_exit_flushes_waiting_events_in_a_closed_batch():
    with RecordingCollector() as server:
        done = _run("""
            sender, recorder = make_sender(url, push_interval=30.0)
            for _ in range(4):
                recorder.skip()
            # no close(): the interpreter exits and the atexit flush must deliver
        """, server.url, "exit")
        assert done.returncode == 0, done.stderr
        assert server.acked and server.acked[-1]["closed"] is True
        assert server.event_ids() == [1, 2, 3, 4]


def test_interpreter_exit_with_a_hanging_collector_waits_no_longer_than_the_close_timeout():
    with RecordingCollector() as server:
        server.delay = 30.0
        done = _run("""
            import atexit
            exit_began = []
            # Registered first, so it runs last: after the agent's exit flush.
            atexit.register(lambda: print(f"flush took {time.monotonic() - exit_began[0]:.3f}"))
            sender, recorder = make_sender(url, push_interval=30.0, timeout=60.0, close_timeout=1.0)
            recorder.skip()
            time.sleep(0.2)  # the first batch is now hanging on the collector
            exit_began.append(time.monotonic())
        """, server.url, "hang")
        assert done.returncode == 0, done.stderr
        took = float(done.stdout.split("flush took ")[1])
        assert 0.5 < took < 1.0 + 0.5, f"the exit flush took {took:.2f} s with close_timeout=1"


def test_a_forked_child_never_sends_not_even_at_its_exit():
    with RecordingCollector() as server:
        done = _run("""
            sender, recorder = make_sender(url, push_interval=0.05)
            recorder.skip()
            time.sleep(0.3)
            pid = os.fork()
            if pid == 0:  # the child, like a DataLoader worker started with fork
                recorder.events.append({"kind": "warning", "iteration": 0, "code": "from_child", "message": "x"})
                sender.wake()
                time.sleep(0.5)
                sender.close(2)
                sys.exit(0)  # a normal exit: atexit handlers run in the child too
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            recorder.skip()
            sender.close(5)
            print("parent-done")
        """, server.url, "fork")
        assert done.returncode == 0, done.stderr
        assert "parent-done" in done.stdout
        codes = [e.get("code") for b in server.received for e in b["events"]]
        assert "from_child" not in codes, "the forked child sent a batch"
        assert sum(b["closed"] for b in server.received) == 1, "only the parent may send its closed batch"
        assert server.event_ids() == [1, 2]
