"""Count the agent's own failures and log each kind once: they never reach the training loop."""

from __future__ import annotations

import logging
import threading

__all__ = ["AgentErrors"]

log = logging.getLogger("ampwatch.agent")


class AgentErrors:
    """A counter of internal failures, reported as ``state.delivery.agent_errors``.

    >>> errors = AgentErrors()
    >>> errors.report("sender", ValueError("boom"))
    >>> errors.count
    1
    """

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def report(self, where: str, exc: BaseException) -> None:
        """Count ``exc``; log it with its traceback the first time ``where`` fails."""
        with self._lock:
            self.count += 1
            first = where not in self._seen
            self._seen.add(where)
        if first:
            log.error("ampwatch: internal error in %s (training continues; further errors here are only "
                      "counted in agent_errors)", where, exc_info=exc)
