"""The store's writer: a group commit writes its batches' rows a statement per table, exactly as row by row would."""

from __future__ import annotations

import asyncio
import glob
import os
import pathlib
import re
import shutil
import sqlite3
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ampwatch.server import _store
from ampwatch.server._checkpoints import Checkpointer
from ampwatch.server._store import Store, Writes
from ampwatch_support.patience import wait_until

SERVER = pathlib.Path(__file__).resolve().parents[1]


def _row(seq: int, closed: int = 0) -> dict:
    return {"incarnation": "i", "first_seen": 1.0, "last_seen": float(seq), "last_seq": seq, "max_event_id": seq,
            "closed": closed, "batch": "{}", "counters": f'{{"seq": {seq}}}'}


def _event(rank: int, event_id: int, body: str = "{}") -> tuple:
    return ("r", rank, "i", event_id, "skip", 1.0, event_id, "gen", body)


def _group(store: Store, jobs: list[Any]) -> list[Any]:
    """Submit ``jobs`` while the writer is held by a job of its own, so that they make one group commit; return
    each job's outcome (its result, or the exception it raised)."""
    started, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        started.set()
        release.wait(10)

    async def run() -> list[Any]:
        held = store.submit(hold)
        assert started.wait(10)  # its group is taken: the jobs below make the next one
        futures = [store.submit(job) for job in jobs]
        release.set()
        await held
        return await asyncio.gather(*futures, return_exceptions=True)
    return asyncio.run(run())


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "store.db"))
    yield s
    s.close()


def _traced(store: Store) -> list[str]:
    statements: list[str] = []
    store._writer.set_trace_callback(statements.append)
    return statements


def _read(store: Store, sql: str) -> list[tuple]:
    return [tuple(row) for row in sqlite3.connect(store.path).execute(sql).fetchall()]


def _inserts(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().upper().startswith("INSERT")]


def test_a_group_commit_of_200_batches_writes_each_table_a_statement_per_128_rows(store):
    # sqlite3 lets go of the GIL at each statement, and waits up to 5 ms to get it back beside a busy event loop:
    # 400 statements made one commit of a burst take seconds (python -m bench.experiments.store_convoy).
    statements = _traced(store)
    _group(store, [Store.write_incarnation("r", rank, _row(1), [_event(rank, 1)]) for rank in range(200)])
    inserts = _inserts(statements)
    assert len(inserts) == 4, [s[:60] for s in inserts[:5]]  # 128 + 72 (padded to 128) rows, two tables
    assert _read(store, "SELECT count(*) FROM incarnations") == [(200,)]
    assert _read(store, "SELECT count(*) FROM events") == [(200,)]


def test_rows_written_together_land_as_written_one_by_one(store):
    added: list[int] = []
    store.on_events_added = added.append
    _group(store, [Store.write_incarnation("r", 0, _row(1), [_event(0, 1), _event(0, 2)]),
                   Store.write_incarnation("r", 1, _row(1), [])])
    # A later batch of rank 0 updates its row; a resent event is ignored, and not counted.
    assert _group(store, [Store.write_incarnation("r", 0, _row(2, closed=1), [_event(0, 2, '"again"'), _event(0, 3)]),
                          Store.insert_events([_event(1, 1)])]) == [None, None]
    assert _read(store, "SELECT rank, last_seq, closed, counters FROM incarnations ORDER BY rank") == \
        [(0, 2, 1, '{"seq": 2}'), (1, 1, 0, '{"seq": 1}')]
    assert _read(store, "SELECT rank, id, body FROM events ORDER BY rank, id") == \
        [(0, 1, "{}"), (0, 2, "{}"), (0, 3, "{}"), (1, 1, "{}")]
    assert added == [2, 2]


def test_a_function_job_sees_the_rows_written_before_it_in_its_group(store):
    count: Callable[[sqlite3.Connection], int] = lambda conn: conn.execute(  # noqa: E731
        "SELECT count(*) FROM incarnations").fetchone()[0]
    outcomes = _group(store, [Store.write_incarnation("r", 0, _row(1), []), count,
                              Store.write_incarnation("r", 1, _row(1), []), count])
    assert outcomes == [None, 1, None, 2]


def test_a_batch_sqlite_cannot_take_fails_alone_and_the_others_in_its_group_are_stored(store):
    bad = Store.write_incarnation("r", 1, _row(1), [_event(1, 2 ** 64)])  # over SQLite's 64-bit integers
    outcomes = _group(store, [Store.write_incarnation("r", 0, _row(1), [_event(0, 1)]), bad,
                              Store.write_incarnation("r", 2, _row(1), [_event(2, 1)])])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], OverflowError)
    assert _read(store, "SELECT rank FROM incarnations ORDER BY rank") == [(0,), (2,)]
    assert _read(store, "SELECT rank FROM events ORDER BY rank") == [(0,), (2,)]


def test_more_rows_than_a_statement_takes_are_split_and_all_stored(store):
    statements = _traced(store)
    events = [_event(0, k) for k in range(1, 1301)]
    assert _group(store, [Writes(events=events)]) == [None]
    assert len(_inserts(statements)) == 11  # 128 rows a statement
    assert _read(store, "SELECT count(*), min(id), max(id) FROM events") == [(1300, 1, 1300)]


def test_groups_of_every_size_use_a_few_statements_that_sqlite3_keeps_prepared(store):
    # sqlite3 keeps the last 128 statements prepared, about 0.8 KiB a row: one statement per group size held 54 MB.
    statements = _traced(store)
    added: list[int] = []
    store.on_events_added = added.append
    for size in range(1, 131):
        _group(store, [Store.write_incarnation("r", rank, _row(size), [_event(rank, size)]) for rank in range(size)])
    # The trace shows each statement with its values: told apart by table and rows.
    shapes = {(s.split("(")[0].split()[-1], s.count("('r', ")) for s in _inserts(statements)}
    assert shapes == {(table, 2 ** k) for table in ("incarnations", "events") for k in range(8)}  # 1, 2, 4, ..., 128
    assert sum(added) == sum(range(1, 131))  # the padding's copies of a row are not counted, nor stored twice
    assert _read(store, "SELECT count(*) FROM events") == [(sum(range(1, 131)),)]
    assert _read(store, "SELECT count(*), max(last_seq) FROM incarnations") == [(130, 130)]


def _oldest_python() -> str | None:
    """An interpreter of the oldest Python the collector declares (``requires-python``), on PATH or pyenv's."""
    version = re.search(r'requires-python = ">=(\d+\.\d+)"', (SERVER / "pyproject.toml").read_text()).group(1)
    found = [shutil.which(f"python{version}")]
    found += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")))
    return next((path for path in found if path and subprocess.run([path, "-c", ""], capture_output=True,
                                                                    timeout=60).returncode == 0), None)


_WRITE_ALONE = """
import asyncio, importlib.util, sqlite3, sys
spec = importlib.util.spec_from_file_location("store", sys.argv[1])  # stdlib only: no package to install
store = sys.modules["store"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store)

async def write():
    s = store.Store(sys.argv[2])
    try:
        await s.submit(store.Writes(events=[("r", 0, "i", k, "skip", 1.0, k, "gen", "{}") for k in range(1, 1301)]))
    finally:
        s.close()
asyncio.run(write())
print(sqlite3.connect(sys.argv[2]).execute("SELECT count(*), min(id), max(id) FROM events").fetchone())
"""


def test_the_store_writes_on_the_oldest_python_the_collector_declares(tmp_path):
    # sqlite3's Connection.getlimit is new in Python 3.11: the store must not need it on 3.10.
    python = _oldest_python()
    if python is None:
        pytest.skip("no interpreter of the oldest Python the collector declares on this machine")
    done = subprocess.run([python, "-c", _WRITE_ALONE, _store.__file__, str(tmp_path / "store.db")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(1300,", "1,", "1300)"]


def _write_megabytes(store: Store, megabytes: int) -> None:
    """Commit ``megabytes`` of event rows, 200 KB a commit."""
    body = "x" * 2000

    async def run() -> None:
        for k in range(5 * megabytes):
            await store.submit(Writes(events=[_event(0, 100 * k + i, body) for i in range(100)]))
    asyncio.run(run())


def test_commits_never_checkpoint_and_the_checkpoint_thread_copies_the_wal_into_the_database(tmp_path):
    # 6 MB of WAL: past the 1,000 pages (4 MB) at which SQLite's own checkpoint would run in a COMMIT. Only a
    # checkpoint writes the database file itself (WAL mode), so its size says whether one ran.
    alone = Store(str(tmp_path / "alone.db"))
    try:
        _write_megabytes(alone, 6)
        assert os.path.getsize(alone.path) < 1 << 20  # no COMMIT copied the WAL into it
    finally:
        alone.close()
    store = Store(str(tmp_path / "store.db"))
    checkpoints = Checkpointer(store)
    try:
        _write_megabytes(store, 6)
        wait_until(lambda: os.path.getsize(store.path) > 5 << 20, what="the checkpoint thread copying the WAL")
    finally:
        checkpoints.close()
        store.close()
