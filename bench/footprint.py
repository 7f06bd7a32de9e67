"""Collector footprint: database growth per rank-hour at a 1 s push interval, and bytes per stored event.

Two fresh collectors take the same paced load (N ranks, one batch per second, a skip and a backoff
event every 50th batch) for a short and a longer time; each stops cleanly (its WAL is checkpointed)
and the difference in database size per extra rank-second is the growth rate. An event-free batch
only rewrites its rank's row, so growth is the events; the bytes per event give the growth of any
other event rate (e.g. a skip storm: one skip event per iteration per skipping optimizer).

    python -m bench.footprint [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile

from bench import _servers

__all__ = ["run", "main"]


def _database(path: str) -> dict:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything into the database file, whose size we want
        events, event_bytes = conn.execute("SELECT count(*), coalesce(sum(length(body)), 0) FROM events").fetchone()
        rows, row_bytes = conn.execute(
            "SELECT count(*), coalesce(sum(length(batch) + length(counters)), 0) FROM incarnations").fetchone()
    finally:
        conn.close()
    return {"file_bytes": os.path.getsize(path), "events": events, "event_body_bytes": event_bytes,
            "incarnations": rows, "incarnation_bytes": row_bytes}


def _one(ranks: int, seconds: int, skip_every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "footprint.db")
        with _servers.CollectorProcess(db) as proc:
            srv = _servers.Server("ampwatch", proc.url, proc.port, proc.proc, db=db)
            load = _servers.load(srv, ranks, seconds, skip_every=skip_every)
        return dict(_database(db), ranks=ranks, seconds=seconds, answered=load["answered"])


def run(ranks: int = 256, short: int = 4, long: int = 16, skip_every: int = 5) -> dict:
    """Measure growth per rank-hour from a short and a long run; return both and the rates."""
    # Events are what grows the database; one skip + one backoff every ``skip_every`` batches makes enough
    # of them in seconds (a clean rank adds nothing after its first batch: its row is rewritten in place).
    a, b = _one(ranks, short, skip_every), _one(ranks, long, skip_every)
    extra_rank_s = (b["answered"] - a["answered"])  # one batch per rank-second
    growth = (b["file_bytes"] - a["file_bytes"]) / max(1, extra_rank_s)
    extra_events = b["events"] - a["events"]
    per_event = (b["file_bytes"] - a["file_bytes"]) / max(1, extra_events)
    return {"short": a, "long": b, "skip_every": skip_every, "bytes_per_rank_second": round(growth, 1),
            "bytes_per_rank_hour": round(growth * 3600),
            "events_per_rank_hour": round(3600 * extra_events / max(1, extra_rank_s), 1),
            "bytes_per_event_on_disk": round(per_event, 1),
            "bytes_per_incarnation_row": round(b["incarnation_bytes"] / max(1, b["incarnations"]), 1)}


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.footprint", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 ranks, 3 s and 8 s")
    args = parser.parse_args(argv)
    print(json.dumps(run(64, 3, 8, skip_every=2) if args.quick else run(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
