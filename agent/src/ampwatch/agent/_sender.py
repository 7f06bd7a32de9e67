"""Background delivery of batches to the collector (placeholder API; the delivery work implements it)."""

from __future__ import annotations

from typing import Any, Callable

from ._config import AgentConfig
from ._events import EventBuffer
from ._identity import Identity

__all__ = ["Sender"]


class Sender:
    """Sends ``snapshot()`` + drained events to the collector from a daemon thread.

    ``snapshot()`` returns ``{"scaler": {...}, "state": {...}}`` as in docs/protocol.md,
    without ``state["delivery"]``, which the sender fills in itself.
    """

    def __init__(self, config: AgentConfig, identity: Identity,
                 snapshot: Callable[[], dict[str, Any]], events: EventBuffer) -> None:
        self.config, self.identity, self.snapshot, self.events = config, identity, snapshot, events

    def start(self) -> None:
        """Start the background thread (no-op without collectors)."""

    def wake(self) -> None:
        """Ask for a batch soon (e.g. a new skip streak started); never blocks."""

    def close(self, timeout: float = 5.0) -> None:
        """Send a final batch with ``closed: true`` and stop, waiting at most ``timeout`` seconds."""
