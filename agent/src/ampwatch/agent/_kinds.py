"""Event kinds added to protocol 1 after its first collectors: sent only to a collector that takes them.

A collector from before them refuses (422) a whole batch holding one, and ignores unknown fields. A
collector that takes them lists them in each 2xx answer (``"kinds": [...]``, each v2 result too); the agent
remembers the last answer's list per collector URL (docs/agent.md#kinds-a-collector-takes):

| what the agent knows of the collector | an event of a listed kind (``LISTED_EVENT_KINDS``) |
|---|---|
| nothing yet (no answer) | sent with the others, in order: nothing is kept waiting |
| it refused (422) a batch holding one, no answer having listed it | the batch goes once more at once without them |
|  | (in ``dropped_events``, not ``rejected_batches``); later ones as on the next row; warned once |
| its last 2xx answer did not list the kind (an older collector) | dropped, in ``dropped_events``; warned once |
| its last 2xx answer listed the kind (again: it was upgraded) | sent |

A batch already built (in the outbox, or an earlier process's in the spool) is sent without the events of kinds
its collector's last answer did not list. Nothing waits in memory, so an outage with a spool loses no event.
Used on the sender thread only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from ampwatch.contract.batch import Event
from ampwatch.contract.protocol import LISTED_EVENT_KINDS

from ._batch import encode_batch
from ._http import Answer

__all__ = ["LISTED", "CollectorKinds", "listed_in"]

log = logging.getLogger("ampwatch.agent")

LISTED = frozenset(LISTED_EVENT_KINDS)
_MARKS = {kind: f'"kind":"{kind}"'.encode() for kind in LISTED_EVENT_KINDS}  # how the agent's compact JSON says it


def listed_in(answer: Answer) -> frozenset[str]:
    """Return the listed kinds a 2xx ``answer`` says its collector takes (none: an older collector)."""
    kinds = answer.body.get("kinds")
    if not isinstance(kinds, list):
        return frozenset()
    return LISTED.intersection(k for k in kinds if isinstance(k, str))


class CollectorKinds:
    """What each collector's last 2xx answer listed (or its refusal said)."""

    def __init__(self, url: str) -> None:
        self.url = url  # the collector this process's own events go to
        self.dropped = 0  # listed events dropped: a collector older than their kinds
        self._taken: dict[str, frozenset[str]] = {}
        self._warned: set[str] = set()

    def sort(self, events: list[Event]) -> list[Event]:
        """Return what of ``events`` (this process's) goes to its collector; a listed kind it is known not to take
        is dropped (table above). Costs nothing unless the collector is known to be older."""
        taken = self._taken.get(self.url)
        if taken is None or taken == LISTED:
            return events
        kept = [event for event in events if event.get("kind") not in LISTED or event.get("kind") in taken]
        self.dropped += len(events) - len(kept)
        return kept

    def answered(self, url: str, answer: Answer) -> None:
        """Note ``url``'s 2xx ``answer``: the listed kinds it takes from now on."""
        taken = listed_in(answer)
        before = self._taken.get(url)
        self._taken[url] = taken
        if taken != LISTED and (before is None or before - taken):
            self._warn(url, LISTED - taken)

    def fit(self, url: str, body: bytes, *, refused: bool = False) -> tuple[bytes, int] | None:
        """Return ``body`` without the events of listed kinds ``url`` does not take, and how many it dropped, or
        ``None``: send it as it is (or, ``refused``, it was refused for something else).

        ``refused``: ``url`` answered 422 to ``body``. Unless an answer of it listed every kind, it is taken for a
        collector older than the kinds the body holds: they are dropped from it (its answer to the body sent again
        says what it takes from then on).
        Costs nothing while ``url`` lists every kind, else a substring search per kind; rewriting decodes and
        encodes the batch once.
        """
        taken = self._taken.get(url)
        if taken == LISTED or (taken is None and not refused):
            return None
        unlisted = LISTED - (taken or frozenset())
        if not any(_MARKS[kind] in body for kind in unlisted):
            return None
        batch = json.loads(body)
        events = batch.get("events") or []
        batch["events"] = [e for e in events if e.get("kind") not in unlisted]
        dropped = len(events) - len(batch["events"])
        self.dropped += dropped
        return encode_batch(batch), dropped

    def _warn(self, url: str, missing: Iterable[str]) -> None:
        if url in self._warned:
            return
        self._warned.add(url)
        log.warning("ampwatch: the collector at %s does not take the event kinds %s (it is older than them): they "
                    "are dropped and counted in dropped_events; the spike counters and levels still go in state. "
                    "Upgrade it to see loss and gradient-norm spikes.", url, ", ".join(sorted(missing)))
