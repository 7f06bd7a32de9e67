"""The collector process keeps its live heap frozen, and still collects garbage cycles in full once an hour."""

from __future__ import annotations

import gc
import weakref

from ampwatch.server import _gc


class _Node:
    def __init__(self) -> None:
        self.other: object = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # freed only by the cycle collector
    return weakref.ref(a)


def test_live_objects_are_frozen_and_a_cycle_frozen_meanwhile_is_collected_by_the_hourly_full_collection():
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleeping(seconds: float):
        return lambda _: now.__setitem__(0, now[0] + seconds)

    try:
        gc.collect()
        cycle = _cycle()
        _gc._keep_frozen(sleep=sleeping(_gc.FREEZE_EVERY_S), clock=clock, rounds=1)
        assert gc.get_freeze_count() > 0
        assert cycle() is not None  # frozen: young and full collections no longer see it
        gc.collect()
        assert cycle() is not None
        # An hour on, the next round thaws and collects everything, then freezes what is live again.
        _gc._keep_frozen(sleep=sleeping(_gc.FULL_COLLECTION_EVERY_S), clock=clock, rounds=1)
        assert cycle() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


_BUFFERS = """
import sys
from ampwatch.server import _gc
if sys.argv[1] == "tuned":
    _gc.tune_gc()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
before = rss()
for _ in range(3):  # as /metrics does at each scrape: a few megabytes of text, garbage once sent
    text = bytearray(4 << 20)
    text[::4096] = b"x" * len(text[::4096])  # touch every page
    del text
print(rss() - before)
"""


def test_the_collector_process_gives_large_freed_buffers_back_to_the_system():
    import subprocess
    import sys

    grown = {mode: int(subprocess.run([sys.executable, "-c", _BUFFERS, mode], capture_output=True, text=True,
                                      check=True, timeout=60).stdout) for mode in ("tuned", "default")}
    # glibc's default moves its mmap threshold up to the largest block freed, so the second buffer stays in the
    # heap, pages and all (about 4 MiB); with the collector's fixed threshold each one is unmapped when freed.
    assert grown["tuned"] < 1024 <= grown["default"], grown


_STORM = """
import gc, json, sys
thresholds, freeze_every_s = json.loads(sys.argv[1])
gc.collect()
gc.freeze()
gc.set_threshold(*thresholds)
BATCHES_PER_S = 2_000  # a whole-job storm at 1,024 ranks: every rank's news within a second or so
walked = []
gc.callbacks.append(lambda phase, info: walked.append(len(gc.get_objects(0)))
                    if phase == "start" and info["generation"] == 0 else None)
# Each batch makes 42 tracked objects: the rank's new state (36), which frees its previous one, and 6 that
# outlive it (as history entries do). CPython counts young allocations net of the objects freed, so only 1 in 7
# of what a batch makes moves that count (in the collector: 43,409 young objects when it reached 5,000).
states, history = {}, []
for batch in range(40_000):
    state = [[batch] for _ in range(35)]
    history.append([[batch] for _ in range(5)])
    states[batch % 1_024] = state
    if batch % int(freeze_every_s * BATCHES_PER_S) == 0:
        gc.freeze()  # what the collector's freezer does every freeze_every_s
print(max(walked, default=0))
"""


def test_in_a_whole_job_storm_a_young_collection_walks_few_live_objects():
    import json
    import subprocess
    import sys

    def walked(thresholds, freeze_every_s) -> int:
        return int(subprocess.run([sys.executable, "-c", _STORM, json.dumps([thresholds, freeze_every_s])],
                                  capture_output=True, text=True, check=True, timeout=120).stdout)

    tuned = walked(_gc.GC_THRESHOLDS, _gc.FREEZE_EVERY_S)
    before = walked((5_000, 20, 20), 2.0)  # the settings that measured 30-70 ms young collections in a storm
    # Each object walked costs about a microsecond of a collection the event loop waits for.
    assert tuned <= 10_000 < 30_000 <= before, (tuned, before)
