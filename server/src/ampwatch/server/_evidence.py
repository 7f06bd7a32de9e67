"""The evidence rows of GET /v1/suspects: which device was where in which skip or poisoned step, with which samples.

A row per first event of a streak (skip ``streak`` 1; a poisoned step's ``streak`` 1 or absent), written with its
batch in the store's group commit (``Writes.evidence``) and kept past its run (docs/suspects.md#what-is-kept).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import msgspec

from ._schema import Batch, DeviceInfo, PoisonedStepEvent, Samples, SkipEvent

__all__ = ["evidence_rows", "outlier_evidence_row", "device_key", "prune_evidence_job"]

_ENCODE = msgspec.json.encode


def _first_of_streak(event: SkipEvent | PoisonedStepEvent) -> bool:
    return event.streak == 1 or (event.streak is None and isinstance(event, PoisonedStepEvent))


def evidence_rows(batch: Batch, device: DeviceInfo | None, now: float) -> list[tuple]:
    """Return the ``evidence`` rows of ``batch``'s events (``store.EVIDENCE_COLUMNS``): none for most batches.

    ``device``: the rank's device as last known for the incarnation. A row's time is the event's, never later
    than ``now`` (an agent's clock ahead cannot keep its rows past the retention).
    """
    rows: list[tuple] = []
    encoded = None
    for event in batch.events:
        if not isinstance(event, (SkipEvent, PoisonedStepEvent)) or not _first_of_streak(event):
            continue
        if encoded is None:
            encoded = _ENCODE(device).decode() if device is not None else None
        samples = event.samples
        rows.append((batch.run, batch.rank, batch.incarnation, event.id, event.kind, min(event.time, now),
                     event.iteration, event.optimizer, batch.world_size, batch.host, batch.local_rank, encoded,
                     None if event.origin is None else int(event.origin),
                     int(getattr(event, "calibration", False)),
                     None if samples is None else _ENCODE(samples).decode()))
    return rows


def outlier_evidence_row(run: str, rank: int, incarnation: str, event_id: int, time: float, iteration: int,
                         optimizer: str, world_size: int, host: str, local_rank: int, device: DeviceInfo | None,
                         samples: Samples | None) -> tuple:
    """Return the ``evidence`` row of a ``gradient_outlier`` (:mod:`._outliers`): the rank alone is the origin of
    its (run, iteration, optimizer), with the spike's samples (docs/suspects.md, rule 13)."""
    return (run, rank, incarnation, event_id, "gradient_outlier", time, iteration, optimizer, world_size, host,
            local_rank, _ENCODE(device).decode() if device is not None else None, 1, 0,
            None if samples is None else _ENCODE(samples).decode())


def device_key(host: str, local_rank: int, uuid: str | None) -> str:
    """The name evidence is kept under: a GPU's UUID when known (the same whichever host or slot it moves to),
    else ``host:local_rank``."""
    return uuid if uuid else f"{host}:{local_rank}"


def prune_evidence_job(cutoff: float, max_rows: int) -> Callable[[sqlite3.Connection], int]:
    """Return a store job deleting evidence older than ``cutoff`` (Unix seconds) and the oldest beyond
    ``max_rows``; it returns how many rows it deleted. It writes only when there is something to delete, so a
    collector on a read-only disk (serving what it holds) is not made unready by it."""
    def job(conn: sqlite3.Connection) -> int:
        before = conn.total_changes
        if conn.execute("SELECT 1 FROM evidence WHERE time < ? LIMIT 1", (cutoff,)).fetchone():
            conn.execute("DELETE FROM evidence WHERE time < ?", (cutoff,))
        if conn.execute("SELECT count(*) FROM evidence").fetchone()[0] > max_rows:
            conn.execute("DELETE FROM evidence WHERE rowid IN (SELECT rowid FROM evidence ORDER BY time DESC, "
                         "rowid DESC LIMIT -1 OFFSET ?)", (max_rows,))
        return conn.total_changes - before
    return job
