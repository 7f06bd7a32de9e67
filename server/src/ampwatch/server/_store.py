"""SQLite storage: one writer thread with group commit, and read connections for queries and recovery."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Store", "StoreClosed", "Writes", "prepare_database", "connect", "EVIDENCE_COLUMNS", "WAL_BOUND_PAGES"]

log = logging.getLogger("ampwatch.server")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incarnations (
    run TEXT NOT NULL, rank INTEGER NOT NULL, incarnation TEXT NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, last_seq INTEGER NOT NULL,
    max_event_id INTEGER NOT NULL, closed INTEGER NOT NULL,
    batch TEXT NOT NULL,     -- last applied batch without events (identity, scaler, gauges)
    counters TEXT NOT NULL,  -- clamped cumulative counters, longest streaks, latest offending parameters
    PRIMARY KEY (run, rank, incarnation)
);
CREATE INDEX IF NOT EXISTS incarnations_last_seen ON incarnations (last_seen);
CREATE TABLE IF NOT EXISTS events (
    run TEXT NOT NULL, rank INTEGER NOT NULL, incarnation TEXT NOT NULL, id INTEGER NOT NULL,
    kind TEXT NOT NULL, time REAL NOT NULL, iteration INTEGER NOT NULL, optimizer TEXT,
    body TEXT NOT NULL,
    UNIQUE (run, rank, incarnation, id)
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run);
CREATE TABLE IF NOT EXISTS evidence (  -- what GET /v1/suspects judges (docs/suspects.md); kept past its run
    run TEXT NOT NULL, rank INTEGER NOT NULL, incarnation TEXT NOT NULL, id INTEGER NOT NULL,
    kind TEXT NOT NULL, time REAL NOT NULL, iteration INTEGER NOT NULL, optimizer TEXT NOT NULL,
    world_size INTEGER NOT NULL, host TEXT NOT NULL, local_rank INTEGER NOT NULL,
    device TEXT,       -- the batch's device as last known for the incarnation (JSON), null if never sent
    origin INTEGER,    -- the event's origin flag: 1, 0, or null (not watched)
    calibration INTEGER NOT NULL,
    samples TEXT,      -- the event's samples (JSON: ids, count, digest), null when it has none
    UNIQUE (run, rank, incarnation, id)
);
CREATE INDEX IF NOT EXISTS evidence_by_time ON evidence (time);
"""

_INCARNATION_COLUMNS = ("run", "rank", "incarnation", "first_seen", "last_seen", "last_seq", "max_event_id", "closed",
                        "batch", "counters")
_UPSERT = """
INSERT INTO incarnations ({columns}) VALUES {rows}
ON CONFLICT (run, rank, incarnation) DO UPDATE SET
    last_seen = excluded.last_seen, last_seq = excluded.last_seq, max_event_id = excluded.max_event_id,
    closed = excluded.closed, batch = excluded.batch, counters = excluded.counters
"""
_EVENT_COLUMNS = ("run", "rank", "incarnation", "id", "kind", "time", "iteration", "optimizer", "body")
_INSERT_EVENTS = "INSERT OR IGNORE INTO events ({columns}) VALUES {rows}"
EVIDENCE_COLUMNS = ("run", "rank", "incarnation", "id", "kind", "time", "iteration", "optimizer", "world_size", "host",
                    "local_rank", "device", "origin", "calibration", "samples")
_INSERT_EVIDENCE = "INSERT OR IGNORE INTO evidence ({columns}) VALUES {rows}"

# Rows per statement: sqlite3 lets go of the GIL at every statement it runs, and a thread that lets go of it
# beside a busy one waits up to the switch interval (5 ms) to get it back. Written a row per statement, a
# group commit of 200 batches took 3.1 s beside a busy thread instead of 3 ms alone, and every batch in it
# waited for that (a storm's ingest is such a thread); a statement per table, 31 ms
# (python -m bench.experiments.store_convoy, on an otherwise idle machine: the waits are longest there).
# A statement's rows are padded to a power of two with copies of its last row (an upsert or an ignored
# insert of the same row again changes nothing), so that a table has 8 statements, each prepared once:
# sqlite3 keeps the last 128 prepared, about 0.8 KiB per row, and one per group size held 54 MB.
_ROWS_PER_STATEMENT = 128

# No COMMIT checkpoints (._checkpoints does, in a thread of its own): SQLite's own checkpoint is kept only as a
# bound, for a WAL that thread could not keep up with.
WAL_BOUND_PAGES = 16_384  # 64 MiB at SQLite's default 4 KiB pages


@dataclasses.dataclass(frozen=True, slots=True)
class Writes:
    """A store job as data: the writer runs the rows of every ``Writes`` of a group commit as one statement per
    table (up to :data:`_ROWS_PER_STATEMENT` rows), rather than a statement per row."""

    incarnation: tuple | None = None
    """One ``incarnations`` row to insert or update, in the order of ``_INCARNATION_COLUMNS``."""
    events: list[tuple] = dataclasses.field(default_factory=list)
    """``events`` rows (``_EVENT_COLUMNS``) to insert; those already stored are ignored."""
    evidence: list[tuple] = dataclasses.field(default_factory=list)
    """``evidence`` rows (:data:`EVIDENCE_COLUMNS`, :mod:`._evidence`) to insert; those already stored are ignored."""


Job = Writes | Callable[[sqlite3.Connection], Any]
"""What the writer runs in a transaction: rows to write, or a function of the connection (its result is the
future's)."""


@functools.lru_cache(maxsize=64)
def _statement(template: str, columns: tuple[str, ...], rows: int) -> str:
    row = "(" + ", ".join("?" * len(columns)) + ")"
    return template.format(columns=", ".join(columns), rows=", ".join([row] * rows))


class StoreClosed(RuntimeError):
    """The store was closed or its writer died; the collector answers 503 and the agent retries."""


def prepare_database(path: str) -> str:
    """Make sure the database ``path`` can be opened: its folder made (0700) and the file created (0600) if missing.

    The database holds host names, process ids and parameter names: only the collector's user reads it.
    SQLite gives the ``-wal`` and ``-shm`` files the database file's permissions; files an earlier
    version left readable by others are made 0600. Return the absolute path; raise ValueError with one
    line that names the path and the fix.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    try:
        for created in reversed(missing):
            os.mkdir(created, 0o700)
    except OSError as error:
        raise ValueError(f"--db {path}: cannot create its folder {created} ({error.strerror}): create it first "
                         f"(install -d -m 0700 {os.path.dirname(path)}) or give --db a file in a folder this "
                         "user can write") from None
    if not os.path.lexists(path):  # an existing one opens even read-only: reads are served, ingest gets 503
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as error:
            raise ValueError(f"--db {path}: cannot create it ({error.strerror}): make its folder writable by this "
                             "user, or give --db a file in another folder") from None
    for suffix in ("", "-wal", "-shm"):
        try:
            mode = os.stat(path + suffix).st_mode
            if mode & 0o077:
                os.chmod(path + suffix, 0o600)
                log.info("made %s readable by its owner only (it was %o)", path + suffix, mode & 0o777)
        except FileNotFoundError:
            pass
        except OSError as error:  # not ours to change: say so, go on
            log.warning("%s stays readable by others: %s", path + suffix, error.strerror)
    return path


def connect(path: str) -> sqlite3.Connection:
    """A connection to the database at ``path`` as every connection of the collector opens it (WAL, FULL sync)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: a COMMIT is on disk before we answer 2xx (NORMAL could lose the last commits on power loss).
    conn.execute("PRAGMA synchronous=FULL")
    conn.row_factory = sqlite3.Row
    return conn


class Store:
    """Durable history; :meth:`submit` queues a write and returns a future resolved after COMMIT."""

    def __init__(self, path: str, max_group: int = 512) -> None:
        self.path = prepare_database(path)
        self.max_group = max_group
        self.trace: Callable[..., object] | None = None
        """Set when the collector traces its timings (``_trace.Trace.add``): called with a line's kind, start time and
        fields for each group commit and checkpoint (this module needs only the standard library)."""
        self.on_events_added: Callable[[int], object] | None = None
        """Called in the writer thread, after each COMMIT, with how many events it stored (duplicates not)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = connect(self.path)
        self._writer.executescript(_SCHEMA)
        self._writer.execute(f"PRAGMA wal_autocheckpoint={WAL_BOUND_PAGES}")
        self._local = threading.local()
        self._closed = False
        self.commits = 0  # transactions committed (a group commit counts once)
        self.failing: str | None = None  # the last write error, until a write succeeds again
        self._last = (0.0, 0.0, False)  # traced only: the last COMMIT's start and end, whether it checkpointed
        self._timings: dict[asyncio.Future, tuple[float, float, float, int]] = {}  # traced only (_trace)
        self.last_commit = 0.0
        """``time.monotonic()`` at the end of the last COMMIT."""
        self._thread = threading.Thread(target=self._write_loop, name="ampwatch-store-writer", daemon=True)
        self._thread.start()

    # writes --------------------------------------------------------------------------------------
    def submit(self, job: Job) -> asyncio.Future[Any]:
        """Run ``job`` in the next transaction; the future resolves once it is committed (to None for
        :class:`Writes`, else to ``job(conn)``)."""
        if self._closed or not self._thread.is_alive():
            raise StoreClosed("the database writer is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((job, loop, future))
        return future

    @staticmethod
    def write_incarnation(run: str, rank: int, row: dict, events: list[tuple],
                          evidence: list[tuple] | None = None) -> Writes:
        """Return a job that upserts one incarnation row and inserts events and evidence (duplicates ignored)."""
        params = dict(row, run=run, rank=rank)
        return Writes(tuple(params[column] for column in _INCARNATION_COLUMNS), events, evidence or [])

    @staticmethod
    def insert_events(events: list[tuple], evidence: list[tuple] | None = None) -> Writes:
        """Return a job that inserts events and evidence, ignoring those already stored."""
        return Writes(events=events, evidence=evidence or [])

    def _write_loop(self) -> None:
        conn = self._writer
        while True:
            item = self._queue.get()
            if item is None:
                break
            group = [item]
            while len(group) < self.max_group:  # group commit: take whatever queued up meanwhile
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                group.append(nxt)
            trace = self.trace
            began = time.perf_counter()
            try:
                results = self._commit([job for job, _, _ in group])
                if trace is not None:
                    self._traced(trace, group, began)
            except Exception:
                # Something in the group failed: run each job alone so one bad job cannot sink the others.
                results = [self._commit_one(job) for job, _, _ in group]
            by_loop: dict[Any, list] = {}
            for (_, loop, future), result in zip(group, results, strict=True):
                by_loop.setdefault(loop, []).append((future, result))
            for loop, done in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_resolve, done)
                except RuntimeError:
                    pass  # the loop closed while we committed; nobody waits any more
        conn.close()

    def _traced(self, trace: Callable[..., object], group: list, began: float) -> None:
        """Log the group commit just made, and keep its timing for each of its requests (:meth:`timing_of`)."""
        written, committed, checkpointed = self._last
        timing = (began, written, committed, len(group))
        for job, _, future in group:
            if isinstance(job, Writes):
                self._timings[future] = timing
        trace("commit", time.time() - (time.perf_counter() - began), jobs=len(group),
              write=round(1000 * (written - began), 2), commit=round(1000 * (committed - written), 2),
              checkpoint=checkpointed)

    def timing_of(self, future: asyncio.Future) -> tuple[float, float, float, int] | None:
        """The group commit that resolved ``future`` (traced only): perf_counter at its begin, rows written and COMMIT
        done, and its jobs."""
        return self._timings.pop(future, None) if self._timings else None

    def _main_file_state(self) -> tuple[int, int]:
        """Size and modification time of the database file itself: only a checkpoint writes it (WAL mode)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return 0, 0
        return st.st_size, st.st_mtime_ns

    def _commit(self, jobs: list[Job]) -> list[tuple[Any, BaseException | None]]:
        conn = self._writer
        conn.execute("BEGIN")
        try:
            results: list[tuple[Any, BaseException | None]] = []
            rows: list[Writes] = []  # written together before the next function job, which may read them
            added = 0
            for job in jobs:
                if isinstance(job, Writes):
                    rows.append(job)
                    results.append((None, None))
                    continue
                added += self._write(rows)
                rows = []
                results.append((job(conn), None))
            added += self._write(rows)
            written = time.perf_counter()
            main_file = self._main_file_state() if self.trace is not None else None
            conn.execute("COMMIT")
            if main_file is not None:
                self._last = (written, time.perf_counter(), main_file != self._main_file_state())
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself on some errors (e.g. disk full)
                conn.execute("ROLLBACK")
            raise
        self.commits += 1
        self.last_commit = time.monotonic()
        if added and self.on_events_added is not None:
            self.on_events_added(added)
        if self.failing is not None:
            log.warning("database writes to %s succeed again (the failing batches were not acknowledged; "
                        "agents resend them)", self.path)
            self.failing = None
        return results

    def _write(self, writes: list[Writes]) -> int:
        """Write the rows of ``writes`` a statement per table and up to :data:`_ROWS_PER_STATEMENT` rows; return how
        many events were new."""
        conn = self._writer
        _execute_rows(conn, _UPSERT, _INCARNATION_COLUMNS, [w.incarnation for w in writes if w.incarnation])
        before = conn.total_changes
        _execute_rows(conn, _INSERT_EVENTS, _EVENT_COLUMNS, [e for w in writes for e in w.events])
        added = conn.total_changes - before
        _execute_rows(conn, _INSERT_EVIDENCE, EVIDENCE_COLUMNS, [e for w in writes for e in w.evidence])
        return added

    def _commit_one(self, job: Job) -> tuple[Any, BaseException | None]:
        try:
            return self._commit([job])[0]
        except Exception as exc:
            # Logged once per kind of failure: a full disk must not also fill the log with a trace per batch.
            if str(exc) != self.failing:
                self.failing = str(exc)
                log.error("database write to %s failed (%s); batches are not applied and get 503 until a write "
                          "succeeds (agents retry): free disk space or make the file writable. Further failures "
                          "like this one are not logged", self.path, exc, exc_info=exc)
            return None, exc

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes and stop the writer (bounded by ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("database writer still busy after %.0fs at shutdown; queued batches are not acknowledged",
                        timeout)

    @property
    def healthy(self) -> bool:
        return not self._closed and self._thread.is_alive()

    # reads ---------------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path)
        return conn

    def query(self, sql: str, params: Any = ()) -> list[dict]:
        """Run a read query on this thread's connection (call it from a worker thread)."""
        return [dict(row) for row in self._reader().execute(sql, params).fetchall()]

    def size_bytes(self) -> int:
        """Database file plus its WAL, in bytes."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(self.path + suffix)
            except OSError:
                pass
        return total


def _execute_rows(conn: sqlite3.Connection, template: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    per_statement = _power_of_two_within(min(_ROWS_PER_STATEMENT, _variable_limit(conn) // len(columns)))
    for first in range(0, len(rows), per_statement):
        chunk = rows[first:first + per_statement]
        padded = _power_of_two_within(2 * len(chunk) - 1)  # the smallest power of two >= len(chunk)
        chunk += [chunk[-1]] * (padded - len(chunk))
        conn.execute(_statement(template, columns, padded), [value for row in chunk for value in row])


def _variable_limit(conn: sqlite3.Connection) -> int:
    """The most ``?`` one statement may hold: 32,766 by default, 999 in old builds. Python 3.10 cannot ask
    (``Connection.getlimit`` is new in 3.11): there, 999, which every build takes."""
    if sys.version_info >= (3, 11):
        return conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    return 999


def _power_of_two_within(n: int) -> int:
    """The largest power of two <= ``n`` (1 at least)."""
    return 1 << max(0, n.bit_length() - 1)


def _resolve(done: list) -> None:
    for future, (value, error) in done:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
