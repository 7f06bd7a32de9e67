"""The wide-body attack: one batch whose ``state`` holds hundreds of thousands of keys or millions of objects.

A 5.6 MiB body of one object with 500,000 keys, under the default 8 MiB body limit: a collector that
builds it into Python objects before validating it spends seconds and hundreds of MiB on it while
every other agent waits. :func:`bodies` are its forms (keys whose values are no optimizer's
counters; valid counters of 90,000 optimizers, as many as fit in 8 MiB; 2.7 million empty objects in a
field of the state no protocol version knows), each also with the loss scale written as the bare
``NaN`` token Python's json module writes (a body msgspec refuses, which the collector once handed to that
module whole: seconds and hundreds of MiB again); :func:`play` posts each
to a collector while another agent keeps sending, and reports what it cost.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["bodies", "play", "reset_peak", "peak_kib"]

_COUNTERS = '{"steps":0,"skipped":0,"consecutive_skipped":0,"longest_streak":0,"streaks":0}'


def bodies(batch: dict[str, Any]) -> dict[str, bytes]:
    """The attack's bodies, built on ``batch`` (a valid protocol v1 batch as a dict, without optimizers)."""
    wide = ",".join(f'"k{i:06d}":0' for i in range(500_000))
    valid = ",".join(f'"o{i:06d}":{_COUNTERS}' for i in range(90_000))
    objects = ",".join(["{}"] * 2_790_000)
    forms = {}
    for suffix, scale in (("", batch["state"]["loss_scale"]), ("_nan", math.nan)):  # json.dumps writes NaN bare
        state = dict(batch["state"], loss_scale=scale, optimizers={})
        head, _, tail = json.dumps(dict(batch, state=state)).partition('"optimizers": {}')
        forms[f"500k_keys{suffix}"] = f'{head}"optimizers": {{{wide}}}{tail}'.encode()
        forms[f"90k_optimizers{suffix}"] = f'{head}"optimizers": {{{valid}}}{tail}'.encode()
        forms[f"2790k_objects{suffix}"] = f'{head}"optimizers": {{}}, "bulk": [{objects}]{tail}'.encode()
    return forms


def reset_peak(pid: int) -> None:
    """Reset the process's peak resident memory (VmHWM) to its current one (Linux: ``clear_refs`` 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_kib(pid: int) -> int:
    """The process's peak resident memory since the last :func:`reset_peak`, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def play(post: Callable[[bytes], int], pid: int, other: Callable[[], int]) -> dict[str, Any]:
    """Post each body with ``post`` (returns the status) while ``other`` (an agent's batch; returns its status)
    is sent every 20 ms from another thread; return per body its status, seconds, the collector's peak
    memory growth and the other agent's slowest answer meanwhile."""
    result = {}
    for name, body in bodies_cache().items():
        stop, slowest = threading.Event(), [0.0]

        def agent(stop: threading.Event = stop, slowest: list[float] = slowest) -> None:
            while not stop.is_set():
                started = time.perf_counter()
                other()
                slowest[0] = max(slowest[0], time.perf_counter() - started)
                stop.wait(0.02)
        reset_peak(pid)
        base = peak_kib(pid)
        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        started = time.perf_counter()
        status = post(body)
        seconds = time.perf_counter() - started
        stop.set()
        thread.join()
        result[name] = {"mib": round(len(body) / 2 ** 20, 1), "status": status, "seconds": round(seconds, 2),
                        "peak_rss_growth_mib": round((peak_kib(pid) - base) / 1024, 1),
                        "other_agent_slowest_ms": round(1000 * slowest[0], 1)}
    return result


_CACHE: dict[str, bytes] = {}


def bodies_cache() -> dict[str, bytes]:
    """:func:`bodies` of the test helpers' base batch, built once."""
    if not _CACHE:
        from ampwatch_support.batches import make_batch
        _CACHE.update(bodies(make_batch(run="wide-body")))
    return _CACHE
