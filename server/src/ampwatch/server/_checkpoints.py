"""Checkpoints of the database's WAL in a thread of their own, so that no COMMIT carries one.

SQLite checkpoints (copies the WAL's pages into the database file, then syncs it) in the COMMIT that takes the
WAL past 1,000 pages, and in every COMMIT after it while it stays past them (a reader's snapshot can hold it
there). A storm's bursts write thousands of WAL frames a second, so those checkpoints landed in the bursts: in a
3-minute storm run at 1,024 ranks 66 commits carried one, in runs of up to ten, with COMMIT p50 / p90 / max
6.6 / 34 / 84 ms against 0.3 / 3 / 103 ms for the other 7,208, and every batch queued behind such a commit waited
for it (AMPWATCH_SERVER_TRACE, docs/benchmarks.md section 7). The store keeps SQLite's own only as a bound
(``_store.WAL_BOUND_PAGES``); this thread's PASSIVE checkpoint never waits for the writer or a reader, nor they
for it. It waits for a pause in the commits (:data:`QUIET_S`, :data:`WAIT_S` at most): its sync and the COMMITs'
share the disk, and commits during one of its runs took p50 / p90 1.6 / 18 ms against 0.23 / 1.9 ms for the
others. A lockstep job's batches come in bursts (its heartbeats too): in a storm run at 1,024 ranks half of the
quarter-seconds held no commit at all and the busiest 10% held 90-134, so a tenth of a second without one is a
gap between two bursts (20 ms still came inside them).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

from ._store import Store, connect

__all__ = ["Checkpointer", "EVERY_S", "QUIET_S", "WAIT_S"]

log = logging.getLogger("ampwatch.server")

EVERY_S = 0.5
QUIET_S = 0.1
WAIT_S = 5.0


class Checkpointer:
    """Checkpoint ``store``'s WAL every ``every_s`` (PASSIVE: as far as no reader still needs it) on a connection of
    its own, until :meth:`close`; a failure is logged once and tried again."""

    def __init__(self, store: Store, every_s: float = EVERY_S) -> None:
        self.store, self.every_s = store, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ampwatch-store-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = connect(self.store.path)
        failed = False
        try:
            while not self._stop.wait(self.every_s):
                self._wait_for_a_pause()
                t, began = time.time(), time.perf_counter()
                try:
                    _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as error:
                    if not failed:
                        log.warning("checkpointing %s failed (%s); retrying (further failures not logged)",
                                    self.store.path, error)
                    failed = True
                    continue
                if (trace := self.store.trace) is not None and copied:
                    trace("checkpoint", t, ms=round(1000 * (time.perf_counter() - began), 2), frames=frames,
                          copied=copied)
        finally:
            conn.close()

    def _wait_for_a_pause(self) -> None:
        """Return once no COMMIT ended in the last :data:`QUIET_S`, or after :data:`WAIT_S`."""
        deadline = time.monotonic() + WAIT_S
        while (now := time.monotonic()) < deadline and not self._stop.is_set():
            quiet_for = now - self.store.last_commit
            if quiet_for >= QUIET_S:
                return
            time.sleep(QUIET_S - quiet_for)

    def close(self, timeout: float = 10.0) -> None:
        """Stop (a checkpoint under way finishes first); call before closing the store."""
        self._stop.set()
        self._thread.join(timeout)
