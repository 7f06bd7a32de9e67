"""Wall time of one group commit beside a busy event loop: a statement per row against a statement per table.

sqlite3 lets go of the GIL at every statement it runs; a thread that lets go of it beside a busy one waits
up to the switch interval (5 ms) to get it back. A group commit that writes each batch's rows with statements
of their own (as the store did up to issue 26) then takes one such wait per row while the event loop parses
a burst of batches, and every batch in the group waits for it. The store's writer now writes a group's rows
as one statement per table, 128 rows at most (``ampwatch.server._store.Writes``).

Both ways write the same rows (one incarnation row and one event per batch) in one transaction on a fresh
WAL database with the collector's settings, first alone, then beside a thread that runs Python code
without pause (what the event loop does in a burst). Median of 10 commits each.

    python -m bench.experiments.store_convoy [--batches 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from ampwatch.server._store import (
    _EVENT_COLUMNS,
    _INCARNATION_COLUMNS,
    _INSERT_EVENTS,
    _UPSERT,
    Store,
    Writes,
    _statement,
)

__all__ = ["main"]

BODY = json.dumps({"kind": "skip", "pad": "x" * 300})


def _writes(batches: int, seq: int) -> list[Writes]:
    return [Store.write_incarnation("bench", rank, {"incarnation": "i", "first_seen": 1.0, "last_seen": float(seq),
                                                    "last_seq": seq, "max_event_id": seq, "closed": 0,
                                                    "batch": BODY, "counters": BODY},
                                    [("bench", rank, "i", seq, "skip", 1.0, seq, "gen", BODY)])
            for rank in range(batches)]


def _row_by_row(store: Store, writes: list[Writes]) -> None:
    """The writer up to issue 26: a statement per incarnation row, ``executemany`` for each batch's events."""
    conn = store._writer
    conn.execute("BEGIN")
    for w in writes:
        conn.execute(_statement(_UPSERT, _INCARNATION_COLUMNS, 1), w.incarnation)
        conn.executemany(_statement(_INSERT_EVENTS, _EVENT_COLUMNS, 1), w.events)
    conn.execute("COMMIT")


def _per_table(store: Store, writes: list[Writes]) -> None:
    store._commit(list(writes))


def _median_ms(commit: Callable[[Store, list[Writes]], None], store: Store, batches: int, first_seq: int) -> tuple:
    walls, cpus = [], []
    for seq in range(first_seq, first_seq + 10):
        writes = _writes(batches, seq)
        wall, cpu = time.perf_counter(), time.thread_time()
        commit(store, writes)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    return round(1000 * statistics.median(walls), 1), round(1000 * statistics.median(cpus), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.store_convoy",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=200, help="batches in the group commit")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(i * i for i in range(1000))

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(os.path.join(tmp, "convoy.db"))  # its writer thread waits idle: the commits run here
        seq = 1
        try:
            for beside in ("alone", "beside a busy thread"):
                if beside != "alone":
                    threading.Thread(target=busy, daemon=True).start()
                for way, commit in (("a statement per row", _row_by_row), ("a statement per table", _per_table)):
                    wall, cpu = _median_ms(commit, store, args.batches, seq)
                    seq += 10
                    print(f"{args.batches} batches, {beside}, {way}: {wall} ms wall, {cpu} ms CPU a commit")
        finally:
            stop.set()
            store.close()
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
