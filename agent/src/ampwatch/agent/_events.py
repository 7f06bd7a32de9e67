"""A bounded, thread-safe buffer of events between the training thread and the sender."""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import weakref

from ampwatch.contract.batch import Event

from ._schedule import is_news

__all__ = ["EventBuffer"]


class EventBuffer:
    """Events waiting for delivery; the oldest are dropped first when full.

    The training thread calls :meth:`append` (a lock-free deque append plus a
    counter); the sender thread calls :meth:`drain`. Every event gets an ``id``
    that increases by one per event within this process (incarnation), so the
    collector can recognise an event it has already applied. Appending news
    (``_schedule.is_news``) sets ``wake``, when the sender has set one.

    >>> buf = EventBuffer(capacity=2)
    >>> for i in range(3):
    ...     _ = buf.append({"kind": "skip", "iteration": i})
    >>> [e["iteration"] for e in buf.drain()], buf.dropped
    ([1, 2], 1)
    """

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._queue: collections.deque[Event] = collections.deque()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.dropped = 0  # events discarded because the buffer was full
        self.wake: threading.Event | None = None  # set on news: the sender's "send soon"
        _live.add(self)

    def append(self, event: Event) -> Event:
        """Add ``event`` (stamped with ``id`` and ``time``) and return it."""
        event.setdefault("time", time.time())
        with self._lock:
            event["id"] = next(self._ids)  # under the lock: ids follow queue order whoever appends
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(event)
        if self.wake is not None and is_news(event):
            self.wake.set()
        return event

    def drain(self, limit: int | None = None) -> list[Event]:
        """Remove and return up to ``limit`` of the oldest events (all when ``None``)."""
        with self._lock:
            n = len(self._queue) if limit is None else min(limit, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def requeue(self, events: list[Event]) -> None:
        """Put events taken by :meth:`drain` back at the front (delivery failed), keeping the cap."""
        with self._lock:
            room = self.capacity - len(self._queue)
            keep = events[-room:] if room > 0 else []
            self.dropped += len(events) - len(keep)
            self._queue.extendleft(reversed(keep))

    def __len__(self) -> int:
        return len(self._queue)


_live: weakref.WeakSet[EventBuffer] = weakref.WeakSet()


def _fresh_locks_in_child() -> None:
    """After fork, in the child: replace locks the parent's sender thread may have held at fork time."""
    for buffer in list(_live):
        buffer._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)
