"""The collector's own timings, when asked (``AMPWATCH_SERVER_TRACE=<file>``): where each ingest request's time
went, and what else ran meanwhile, one JSON object a line (docs/collector.md#the-collectors-own-timings).

Kinds of line (times: ``t`` the Unix time it began, durations in ms):

- ``req``: one ingest request, from the handler's first line to its answer sent: ``read`` (the body), ``parse``,
  ``turn`` (waiting for the rank's previous batch), ``apply`` (checks and the new state, up to the store),
  ``queue`` (the store job waiting for its group commit to begin), ``write`` (the group's rows), ``commit``
  (``COMMIT``: the WAL's fsync, and a checkpoint when one lands in it), ``resume`` (the commit done to the
  request running again: the event loop's wait), ``after`` (alerts, counters), ``send``; ``total``;
  ``status``, ``rank``, ``events``, ``group`` (jobs in its group commit).
- ``commit``: one group commit: ``jobs``, ``write``, ``commit``, ``checkpoint`` (whether the database file itself
  was written during its COMMIT: a checkpoint in it, SQLite's own, or the store's checkpoint thread's meanwhile).
- ``checkpoint``: a run of the store's checkpoint thread that copied pages: ``ms``, ``frames`` (in the WAL),
  ``copied``.
- ``gc``: one collection: ``gen``, ``ms``, ``cpu_ms``, ``collected``, ``thread``.
- ``pass``: one periodic alert pass: ``ms``, ``cpu_ms``. ``render``: one ``/metrics`` render: ``ms``, ``cpu_ms``.
- ``lag``: the event loop ran a 10 ms timer ``ms`` late (logged from 2 ms).
- ``cpu``: per 10 ms, the CPU each of the process's threads used (``threads``: name -> ms, from
  ``/proc/self/task/*/schedstat``), and how late the sampling thread woke (``late``: mostly waiting for the GIL).

Off (the default), every hook is a test of a module global or a context-variable lookup. On, lines are kept in
memory and written at shutdown (and every 50,000 lines), so that the writing does not land among the timings it
reports.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TRACE_ENV", "Trace", "active", "start", "stop", "mark", "stored", "timed"]

TRACE_ENV = "AMPWATCH_SERVER_TRACE"
_FLUSH_EVERY = 50_000  # lines
_SAMPLE_S = 0.01
_REQUEST_PHASES = ("read", "parse", "turn", "apply", "queue", "write", "commit", "resume", "after", "send")

active: Trace | None = None
"""The trace being written, or None (off)."""

_request: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("ampwatch_trace_request")


class Trace:
    """Lines of one trace file, kept in memory until written."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines: list[tuple[str, float, dict]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._gc_started: dict[int, tuple[float, float]] = {}
        open(path, "w").close()  # a path that cannot be written fails at start, not at shutdown

    def add(self, kind: str, t: float, **fields: Any) -> None:
        """Keep one line (any thread)."""
        self._lines.append((kind, t, fields))
        if len(self._lines) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            with open(self.path, "a") as f:
                f.writelines(json.dumps({"k": kind, "t": round(t, 4), **fields}) + "\n" for kind, t, fields in lines)

    # requests ------------------------------------------------------------------------------------
    def begin(self) -> contextvars.Token:
        """Start a request's record (in its task's context): :func:`mark` adds its phases."""
        return _request.set({"t": time.time(), "at": time.perf_counter()})

    def end(self, token: contextvars.Token, status: int) -> None:
        record = _request.get()
        _request.reset(token)
        at, t = record.pop("at"), record.pop("t")
        now = time.perf_counter()
        fields = {p: round(1000 * record.pop(p), 2) for p in _REQUEST_PHASES if p in record}
        fields["send"] = round(1000 * (now - record.pop("last", at)), 2)
        self.add("req", t, total=round(1000 * (now - at), 2), status=status, **fields, **record)

    # the process's threads -----------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._gc_started[ident] = (time.perf_counter(), time.thread_time())
            return
        began = self._gc_started.pop(ident, None)
        if began is not None:
            ms = 1000 * (time.perf_counter() - began[0])
            self.add("gc", time.time() - ms / 1000, gen=info["generation"], ms=round(ms, 2),
                     cpu_ms=round(1000 * (time.thread_time() - began[1]), 2), collected=info["collected"],
                     thread=threading.current_thread().name)

    def _sample_threads(self) -> None:
        """Every 10 ms: each thread's CPU since the last sample, and how late this thread woke."""
        last: dict[int, int] = {}  # thread id -> its CPU ns so far
        due = time.perf_counter() + _SAMPLE_S
        while not self._stopped.wait(max(0.0, due - time.perf_counter())):
            late = time.perf_counter() - due
            due += _SAMPLE_S * (1 + int(late // _SAMPLE_S))
            used: dict[str, float] = {}  # by name: the worker threads share theirs
            for thread in threading.enumerate():
                tid = thread.native_id
                try:
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        ns = int(f.read().split()[0])
                except (OSError, ValueError, IndexError, TypeError):
                    continue
                if tid in last and ns > last[tid]:
                    used[thread.name] = used.get(thread.name, 0.0) + (ns - last[tid]) / 1e6
                last[tid] = ns  # type: ignore[index]
            used = {name: round(ms, 1) for name, ms in used.items() if ms >= 0.5}
            if used or late > 0.002:
                self.add("cpu", time.time(), late=round(1000 * late, 1), threads=used)

    async def watch_loop(self) -> None:
        """Log how late the event loop runs a 10 ms timer (from 2 ms), until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + _SAMPLE_S
            await asyncio.sleep(_SAMPLE_S)
            late = loop.time() - due
            if late > 0.002:
                self.add("lag", time.time(), ms=round(1000 * late, 1))


def start(path: str | None = None) -> Trace | None:
    """Start the trace to ``path`` (default: ``$AMPWATCH_SERVER_TRACE``; neither: stay off) and its watchers."""
    global active
    path = path or os.environ.get(TRACE_ENV)
    if not path or active is not None:
        return active
    trace = active = Trace(path)
    gc.callbacks.append(trace._on_gc)
    threading.Thread(target=trace._sample_threads, name="ampwatch-trace-sampler", daemon=True).start()
    return trace


def stop() -> None:
    """Stop the trace and write what it holds."""
    global active
    trace, active = active, None
    if trace is None:
        return
    trace._stopped.set()
    if trace._on_gc in gc.callbacks:
        gc.callbacks.remove(trace._on_gc)
    trace.flush()


def mark(phase: str, **fields: Any) -> None:
    """End ``phase`` of the current request (time since the previous mark), adding ``fields`` to its line."""
    record = _request.get(None)
    if record is None:
        return
    now = time.perf_counter()
    record[phase] = record.get(phase, 0.0) + now - record.get("last", record["at"])
    record["last"] = now
    record.update(fields)


def stored(timing: tuple[float, float, float, int] | None) -> None:
    """End the current request's wait for its group commit, split by the writer's ``timing`` (perf_counter at the
    group's begin, its rows written, its COMMIT done; and its jobs): ``queue``, ``write``, ``commit``, ``resume``."""
    record = _request.get(None)
    if record is None or timing is None:
        return
    began, written, committed, jobs = timing
    now = time.perf_counter()
    last = record.get("last", record["at"])
    for phase, a, b in (("queue", last, began), ("write", began, written), ("commit", written, committed),
                        ("resume", committed, now)):
        record[phase] = record.get(phase, 0.0) + max(0.0, b - a)
    record["last"] = now
    record["group"] = jobs


def timed(kind: str, work: Callable[[], Any]) -> Any:
    """Run ``work`` (in the calling thread) and log its wall and CPU time as a ``kind`` line."""
    trace = active
    if trace is None:
        return work()
    t, began, cpu = time.time(), time.perf_counter(), time.thread_time()
    try:
        return work()
    finally:
        trace.add(kind, t, ms=round(1000 * (time.perf_counter() - began), 2),
                  cpu_ms=round(1000 * (time.thread_time() - cpu), 2))
