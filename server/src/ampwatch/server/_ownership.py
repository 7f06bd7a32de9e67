"""Who owns a rank: which of its processes (incarnations) the collector shows, and which it puts out.

The rules are a table in docs/protocol.md#who-owns-a-rank; every row is a test in
``tests/test_rank_ownership.py``. In short:

- The owner is the newest incarnation first seen, of those not put out; but a process's history never owns
  the rank while a process that spoke for itself is there (a batch marked ``replayed`` is another process
  sending a dead one's spool), nor does a process without a key once the rank has shown one.
- A new incarnation notes every live process of another key it appeared beside (``displaced``). If one of
  those sends again for itself, two processes claim the rank: every incarnation that appeared beside it
  is put out, and the one that kept sending owns the rank again with that batch.
- A replayed batch is history only: it counts toward the totals, but never claims, displaces, owns, closes
  the rank or shows it alive.

Pure functions of incarnations; :mod:`._ingest` applies them, :class:`._state.RankView` picks the owner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ._incarnation import Incarnation

__all__ = ["same_process", "owner", "beside", "claimants"]


def same_process(key: str | None, other: str | None) -> bool:
    """Whether two process keys name one process: a missing key (an agent before ``process_key``) names none."""
    return key is not None and key == other


def owner(incarnations: Iterable[Incarnation]) -> Incarnation | None:
    """Return the incarnation whose gauges, liveness and close the rank shows (None: every one was put out).

    O(incarnations). Ranked by: having spoken for itself (not only replayed by another process), having a key
    when the rank has shown one, then first seen, newest first.
    """
    own = [inc for inc in incarnations if inc.conflict_with is None]
    keyed = any(inc.batch.process_key is not None for inc in own)
    return max(own, key=lambda inc: (not inc.replayed_only, inc.batch.process_key is not None or not keyed,
                                     inc.first_seen), default=None)


def beside(incarnations: Iterable[Incarnation], key: str | None, now: float, silent_after: float
           ) -> tuple[str, ...]:
    """Return the ids of the live processes a new incarnation of process ``key`` appears beside: not put out,
    not closed, not only replayed, seen within ``silent_after``, and of another process.

    A restart after a crash appears beside the dead process too (it looked live); that one never sends again,
    so the note is never judged. Another watch() of the same process displaces nothing.
    """
    return tuple(inc.id for inc in incarnations
                 if inc.conflict_with is None and not inc.closed and not inc.replayed_only
                 and now - inc.last_seen <= silent_after and not same_process(inc.batch.process_key, key))


def claimants(incarnations: Iterable[Incarnation], sender: Incarnation) -> list[Incarnation]:
    """Return the incarnations in conflict with ``sender``, which sends again for itself: those that appeared
    while it was live (``displaced`` names it), not yet put out; each with ``conflict_with`` set (nothing else
    changes here)."""
    return [dataclasses.replace(inc, conflict_with=sender.id) for inc in incarnations
            if inc.id != sender.id and inc.conflict_with is None and sender.id in inc.displaced]
