"""Delivery across process boundaries: interpreter exit flushes, a forked child never sends."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ampwatch_support.patience import START_S
from ampwatch_support.recording_collector import RecordingCollector

pytestmark = pytest.mark.slow

PRELUDE = """
import os, sys, time
from ampwatch_support.delivery_harness import make_sender
url, mode = sys.argv[1], sys.argv[2]
"""


def _start(script: str, *args: str) -> subprocess.Popen:
    """Start ``script`` after the prelude in a fresh interpreter; stdin, out, err piped."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` to its end (a hang after START_S)."""
    process = _start(script, *args)
    try:
        out, err = process.communicate(timeout=START_S)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


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
        server.delay = 3600.0  # no answer while the process lives (stopping the server ends it)
        process = _start("""
            import atexit, json
            from ampwatch_support.delivery_harness import record_sender_joins
            exit_began = []
            # Registered first, so it runs last: after the agent's exit flush.
            atexit.register(lambda: print(f"flush took {time.monotonic() - exit_began[0]:.3f}; "
                                          f"joins {json.dumps(joins)}"))
            joins = record_sender_joins()
            sender, recorder = make_sender(url, push_interval=30.0, timeout=3600.0, close_timeout=1.0)
            recorder.skip()
            sys.stdin.readline()  # the test says when the first batch hangs on the collector
            exit_began.append(time.monotonic())
        """, server.url, "hang")
        try:
            assert server.wait_for(lambda s: len(s.arrivals) == 1)
            out, err = process.communicate("go\n", timeout=START_S)
        finally:
            process.kill()
        assert process.returncode == 0, err
        assert server.received == [], "the collector answered: this test proved nothing"
    print("\n" + out.strip())
    took, joins = out.split("flush took ")[1].split("; joins ")
    # The process ended with its batch unanswered and an hour of HTTP timeout left: the exit flush waited for
    # the sender at most the close timeout in all (how long it asked to wait, whatever the machine's speed),
    # and no less than that in fact (a loaded machine only waits longer).
    assert 0 < sum(json.loads(joins)) <= 1.0, joins
    assert float(took) >= 0.9, f"the exit flush gave up after {float(took):.2f} s with close_timeout=1"


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
            sender.close(60)
            print("parent-done")
        """, server.url, "fork")
        assert done.returncode == 0, done.stderr
        assert "parent-done" in done.stdout
        codes = [e.get("code") for b in server.received for e in b["events"]]
        assert "from_child" not in codes, "the forked child sent a batch"
        assert sum(b["closed"] for b in server.received) == 1, "only the parent may send its closed batch"
        assert server.event_ids() == [1, 2]
