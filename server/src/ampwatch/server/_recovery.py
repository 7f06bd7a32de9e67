"""Rebuild per-rank state from the database (at start, and for a rank that returns after it left memory)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from ._incarnation import Incarnation
from ._state import RankState
from ._store import Store

__all__ = ["load_ranks", "stored_ranks", "delete_history_job"]


def load_ranks(store: Store, *, seen_after: float | None = None, run: str | None = None,
               rank: int | None = None) -> list[RankState]:
    """Return ranks rebuilt from their stored incarnations (blocking: call it from a worker thread)."""
    where: list[str] = []
    params: list[object] = []
    if run is not None:
        where.append("run = ?")
        params.append(run)
    if rank is not None:
        where.append("rank = ?")
        params.append(rank)
    if seen_after is not None:
        where.append("(run, rank) IN (SELECT run, rank FROM incarnations GROUP BY run, rank "
                     "HAVING max(last_seen) > ?)")
        params.append(seen_after)
    sql = "SELECT * FROM incarnations" + (" WHERE " + " AND ".join(where) if where else "") + \
          " ORDER BY first_seen, last_seen"
    ranks: dict[tuple[str, int], RankState] = {}
    for row in store.query(sql, params):
        key = (row["run"], row["rank"])
        state = ranks.get(key)
        if state is None:
            state = ranks[key] = RankState(*key)
        state.install(Incarnation.from_row(row))
    return list(ranks.values())


def stored_ranks(store: Store) -> set[tuple[str, int]]:
    """Return every (run, rank) with history in the database (blocking)."""
    return {(row["run"], row["rank"]) for row in store.query("SELECT DISTINCT run, rank FROM incarnations")}


def delete_history_job(cutoff: float) -> Callable[[sqlite3.Connection], list[str]]:
    """Return a store job deleting every run last seen before ``cutoff`` (Unix seconds); it returns their names."""
    def job(conn: sqlite3.Connection) -> list[str]:
        old = [r[0] for r in conn.execute(
            "SELECT run FROM incarnations GROUP BY run HAVING max(last_seen) < ?", (cutoff,)).fetchall()]
        for run in old:  # the history of a run goes as a whole
            conn.execute("DELETE FROM events WHERE run = ?", (run,))
            conn.execute("DELETE FROM incarnations WHERE run = ?", (run,))
        return old
    return job
