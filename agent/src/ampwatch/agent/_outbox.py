"""Batches built but not yet acknowledged, oldest first; in memory (one batch) by default."""

from __future__ import annotations

import dataclasses
import pathlib

__all__ = ["Pending", "MemoryOutbox", "REPLAYED"]


@dataclasses.dataclass(slots=True)
class Pending:
    """One encoded batch waiting for an answer; ``run``, ``rank`` and ``world_size`` pick its collector."""

    seq: int
    events: int
    run: str
    rank: int
    world_size: int
    body: bytes | None = None
    path: pathlib.Path | None = None
    size: int = 0
    replayed: bool = False
    """Another process's batch, adopted from its spool after it died: sent marked ``"replayed": true``, so the
    collector keeps it as that process's history and never takes it for the process being alive."""

    def load(self) -> bytes:
        """Return the encoded batch (read from the spool when it lives on disk), marked if ``replayed``."""
        if self.body is not None:
            return self.body
        assert self.path is not None
        body = self.path.read_bytes()
        if not self.replayed:
            return body
        # A batch is a JSON object (adoption read it as one): the mark goes first, the rest byte for byte.
        return REPLAYED + body.lstrip()[1:]


REPLAYED = b'{"replayed":true,'
"""What a replayed batch's body starts with (docs/protocol.md#who-owns-a-rank)."""


class MemoryOutbox:
    """Holds at most one batch: while it is unanswered, new events wait in the bounded EventBuffer."""

    dropped_events = 0  # an in-memory outbox never drops a batch it holds

    def __init__(self) -> None:
        self._batch: Pending | None = None

    def full(self) -> bool:
        """Return whether a new batch must wait for the held one to be answered."""
        return self._batch is not None

    def put(self, pending: Pending) -> None:
        """Hold ``pending`` until :meth:`pop`."""
        if self._batch is not None:
            raise RuntimeError("MemoryOutbox holds one batch at a time")
        self._batch = pending

    def make_room(self, size: int) -> bool:
        """Return ``False``: an in-memory outbox drops nothing (``full()`` holds new batches back)."""
        return False

    def head(self) -> Pending | None:
        """Return the oldest unanswered batch, or ``None``."""
        return self._batch

    def pop(self) -> None:
        """Forget the oldest batch (acknowledged, or rejected for good)."""
        self._batch = None

    def close(self) -> None:
        """Release resources (nothing to do in memory)."""

    def after_fork_in_child(self) -> None:
        """Let go of whatever a forked child must not touch (nothing in memory)."""

    def __len__(self) -> int:
        return 0 if self._batch is None else 1
