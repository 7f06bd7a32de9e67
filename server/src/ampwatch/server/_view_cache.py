"""Bodies of the run view (summary rows, scale spread) kept until the run changes: one build serves every tab.

A body is built at a *version* (the run's change generation from :class:`~._state.CollectorState`,
plus whatever else it reads, such as the run's firing alerts) and served while the version holds,
up to ``max_age_s`` (what slides with time alone, such as a recent skip ratio, is at most that old)
or an earlier expiry the builder names (the moment a rank would turn silent). A body younger than
its ``min_age_s`` is served even when the version moved: in a whole-job storm every batch moves it,
and this bounds the rebuilds to one per ``min_age_s`` however many tabs read. A lookup is O(1); at
most ``size`` bodies are held, the oldest dropped first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["ViewCache"]


class ViewCache:
    """Keep the latest body per key and its version; rebuild only when the version moves or it expires.

    >>> cache = ViewCache(max_age_s=60)
    >>> cache.get("summary", 1, lambda: ({"n": 1}, None))
    {'n': 1}
    >>> cache.get("summary", 1, lambda: ({"n": 2}, None)), cache.builds, cache.hits
    ({'n': 1}, 1, 1)
    """

    def __init__(self, max_age_s: float = 10.0, size: int = 64, clock: Callable[[], float] = time.time) -> None:
        self.max_age_s, self.size, self._clock = max_age_s, size, clock
        self._bodies: dict[Hashable, tuple[Hashable, float, float, Any]] = {}  # key -> version, fresh, expires, body
        self.builds = 0
        self.hits = 0

    def get(self, key: Hashable, version: Hashable, build: Callable[[], tuple[Any, float | None]],
            min_age_s: float = 0.0) -> Any:
        """Return the body held for ``key`` at ``version``, else ``build()``'s (body, expiry or None) held anew."""
        body = self.peek(key, version)
        return body if body is not None else self.put(key, version, *build(), min_age_s=min_age_s)

    def peek(self, key: Hashable, version: Hashable) -> Any:
        """Return the body held for ``key`` at ``version`` if it has not expired, else None."""
        held = self._bodies.get(key)
        now = self._clock()
        if held is not None and (now < held[1] or (held[0] == version and now < held[2])):
            self.hits += 1
            return held[3]
        return None

    def put(self, key: Hashable, version: Hashable, body: Any, expires: float | None = None,
            min_age_s: float = 0.0) -> Any:
        """Hold ``body`` for ``key`` at ``version`` until ``expires`` (or ``max_age_s`` from now, if sooner), and
        whatever the version for ``min_age_s``."""
        self.builds += 1
        self._bodies.pop(key, None)
        while len(self._bodies) >= self.size:
            del self._bodies[next(iter(self._bodies))]
        now = self._clock()
        until = now + self.max_age_s
        self._bodies[key] = (version, now + min_age_s, until if expires is None else min(until, expires), body)
        return body
