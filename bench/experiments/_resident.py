"""This process's resident memory, for the benches that measure memory inside their own process.

``bench.experiments.alert_memory`` and ``bench.experiments.collector_memory`` take the difference of two readings around
what they measure; a server in another process is read through ``bench._servers.ProcessStats``.
"""

from __future__ import annotations

__all__ = ["resident_kib"]


def resident_kib() -> int:
    """Return this process's resident set (``VmRSS`` of /proc/self/status) in KiB; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
