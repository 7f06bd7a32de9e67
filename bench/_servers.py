"""The servers under test, each in its own process on a free loopback port, and their CPU and memory."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

# The collector process and free ports: one copy for tests, benchmarks and the demo.
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.ports import free_port

__all__ = ["PUSHGATEWAY", "CollectorProcess", "ProcessStats", "Usage", "collector", "free_port", "machine_busy_s",
           "pin_to_cores", "pushgateway", "server", "load"]

PUSHGATEWAY = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
_TICKS = os.sysconf("SC_CLK_TCK")


class ProcessStats:
    """CPU seconds and memory of one process, read from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_s(self) -> float:
        """User + system CPU seconds so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of proc(5))

    def memory_kib(self) -> dict[str, int]:
        """VmRSS (now) and VmHWM (peak) in KiB."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
        return out


def pin_to_cores(pid: int, cores: set[int]) -> list[int]:
    """Pin every thread of process ``pid`` (and so the threads they start) to the CPUs ``cores``; return the cores
    its threads may run on now, read back."""
    allowed: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cores)
        allowed |= os.sched_getaffinity(int(task))
    return sorted(allowed)


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, any process) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICKS


class Usage:
    """CPU seconds of the collectors, of the process driving them and of the whole machine at named marks, and the
    cores each used between two marks: who had the machine's cores, the other jobs on it included."""

    def __init__(self, collectors: list[ProcessStats], driver: ProcessStats) -> None:
        self._collectors, self._driver = collectors, driver
        self.collectors: dict[str, list[float]] = {}
        self.driver: dict[str, float] = {}
        self.machine: dict[str, float] = {}
        self.at: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Read every counter now, as mark ``name``."""
        self.at[name] = time.time()
        self.collectors[name] = [stats.cpu_s() for stats in self._collectors]
        self.driver[name] = self._driver.cpu_s()
        self.machine[name] = machine_busy_s()

    def between(self, start: str, end: str) -> dict:
        """Cores used from mark ``start`` to mark ``end``: each collector, the driver, the machine, the rest."""
        wall = self.at[end] - self.at[start]
        each = [round((b - a) / wall, 3) for a, b in zip(self.collectors[start], self.collectors[end], strict=True)]
        driver = round((self.driver[end] - self.driver[start]) / wall, 3)
        machine = round((self.machine[end] - self.machine[start]) / wall, 3)
        return {"collectors": each, "simulation": driver, "machine": machine,
                "others": round(max(0.0, machine - sum(each) - driver), 3), "cores": os.cpu_count()}


class Server:
    """A started server: its base URL, its target kind for the load generator, and its process."""

    def __init__(self, kind: str, url: str, port: int, proc: subprocess.Popen, db: str | None = None) -> None:
        self.kind, self.url, self.port, self.proc, self.db = kind, url, port, proc, db
        self.stats = ProcessStats(proc.pid)


@contextlib.contextmanager
def collector(args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              port: int | None = None) -> Iterator[Server]:
    """A real ampwatch collector on a fresh database (killed on exit), on ``port`` (default: a free one)."""
    with tempfile.TemporaryDirectory() as tmp, \
            CollectorProcess(os.path.join(tmp, "bench.db"), port=port, args=args, env=env) as c:
        yield Server("ampwatch", c.url, c.port, c.proc, db=c.db)


@contextlib.contextmanager
def pushgateway() -> Iterator[Server]:
    """The Debian Prometheus Pushgateway as people run it (in memory, no persistence file), killed on exit."""
    if not os.path.exists(PUSHGATEWAY):
        raise RuntimeError(f"{PUSHGATEWAY} not found: install the Debian package prometheus-pushgateway")
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(url + "/-/ready", timeout=1):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"pushgateway did not start: {log.read()[-500:]!r}") from None
                    time.sleep(0.05)
            yield Server("pushgateway", url, port, proc)
        finally:
            proc.kill()
            proc.wait(10)


def server(kind: str) -> contextlib.AbstractContextManager[Server]:
    """Start ``ampwatch`` or ``pushgateway``."""
    return collector() if kind == "ampwatch" else pushgateway()


def load(srv: Server, ranks: int, seconds: int, saturate: int = 0, skip_every: int = 50,
         target: str | None = None, per_node: int = 8, interval: float = 1.0) -> dict:
    """Run the load generator in its own process against ``srv``; add the server's CPU and memory.

    ``target`` is the generator's (default: the server's kind; ``ampwatch-node``: one v2 node batch of
    ``per_node`` ranks per request); ``interval``: seconds between two updates of a sender.
    """
    import json
    cpu0, t0 = srv.stats.cpu_s(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "bench._loadgen", "--target", target or srv.kind,
                          "--port", str(srv.port),
                          "--ranks", str(ranks), "--seconds", str(seconds), "--saturate", str(saturate),
                          "--skip-every", str(skip_every), "--per-node", str(per_node),
                          "--interval", str(interval)],
                         capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    result = json.loads(out.stdout)
    result["server_cpu_s"] = round(srv.stats.cpu_s() - cpu0, 2)
    result["server_cpu_pct"] = round(100 * result["server_cpu_s"] / wall, 1)
    result["server_cpu_us_per_update"] = round(1e6 * result["server_cpu_s"] / max(1, result["answered"]), 1)
    result.update({k.lower(): v for k, v in srv.stats.memory_kib().items()})
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return result
