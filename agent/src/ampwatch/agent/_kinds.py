"""Event kinds added to protocol 1 after its first collectors: sent only to a collector that listed them.

A collector from before them refuses (422) a whole batch holding one, and ignores unknown fields. A
collector that takes them lists them in each 2xx answer (``"kinds": [...]``, each v2 result too); the agent
remembers the last answer's list per collector URL (docs/agent.md#kinds-a-collector-takes):

| the collector's last 2xx answer | an event of a listed kind (``LISTED_EVENT_KINDS``) |
|---|---|
| none yet | waits (at most ``max_events`` of them, the oldest dropped first) |
| listed its kind | sent; the waiting ones follow, with fresh ids |
| without ``kinds`` or its kind (an older collector) | dropped (waiting ones too), in ``dropped_events``; warned once |
| a later one listed it (the collector was upgraded) | sent again |

A batch already built (in the outbox, or an earlier process's in the spool) is sent without the events of kinds
its collector's last answer did not list; one refused with 422 while holding listed kinds (a spooled batch sent to
a collector never heard from, which turned out older) is sent once more without them.
Used on the sender thread only.
"""

from __future__ import annotations

import collections
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
    """What each collector's last 2xx answer listed; this process's listed events waiting for its first answer."""

    def __init__(self, url: str, capacity: int) -> None:
        self.url = url  # the collector this process's own events go to
        self.capacity = capacity
        self.dropped = 0  # listed events dropped: an older collector, or more waiting than ``capacity``
        self._taken: dict[str, frozenset[str]] = {}
        self._waiting: collections.deque[Event] = collections.deque()
        self._warned: set[str] = set()

    def sort(self, events: list[Event]) -> list[Event]:
        """Return what of ``events`` (this process's) goes now; a listed kind waits or is dropped (table above).

        Costs a set lookup per event, none once the collector listed every kind.
        """
        taken = self._taken.get(self.url)
        if taken == LISTED:
            return events
        kept = []
        for event in events:
            kind = event.get("kind")
            if kind not in LISTED or (taken is not None and kind in taken):
                kept.append(event)
            elif taken is None:
                if len(self._waiting) >= self.capacity:
                    self._waiting.popleft()
                    self.dropped += 1
                self._waiting.append(event)
            else:
                self.dropped += 1
        return kept

    def answered(self, url: str, answer: Answer) -> list[Event]:
        """Note ``url``'s 2xx ``answer``; return the waiting events it now takes (to queue again, for fresh ids:
        events sent meanwhile have higher ones, and a collector skips an id below those it applied)."""
        taken = listed_in(answer)
        before = self._taken.get(url)
        self._taken[url] = taken
        if taken != LISTED and (before is None or before - taken):
            self._warn(url, LISTED - taken)
        if url != self.url or not self._waiting:
            return []
        waiting, self._waiting = list(self._waiting), collections.deque()
        going = [e for e in waiting if e.get("kind") in taken]
        self.dropped += len(waiting) - len(going)
        return going

    def fit(self, url: str, body: bytes, *, refused: bool = False) -> tuple[bytes, int] | None:
        """Return ``body`` without the events of listed kinds ``url`` did not list (all of them when it
        ``refused`` the body) and how many it dropped, or ``None`` when it holds none: send it as it is.

        Costs nothing while ``url`` lists every kind, else a substring search per kind; rewriting decodes and
        encodes the batch once.
        """
        taken = frozenset() if refused else self._taken.get(url)
        if taken is None or taken == LISTED:
            return None
        unlisted = LISTED - taken
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
