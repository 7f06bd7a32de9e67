"""On-disk outbox (``AMPWATCH_SPOOL_DIR``): batches survive an outage and a restart, within a size cap.

Layout: one folder per incarnation holding ``lock`` (an exclusive ``flock``
held while the process lives) and ``<seq>-<events>.json`` per batch. A new
agent adopts the folders whose lock it can take (their process is gone) and
sends their batches first, unchanged, so they keep their original identity.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib

from ._outbox import Pending

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no adoption of other processes' spools
    fcntl = None  # type: ignore[assignment]

__all__ = ["SpoolOutbox"]

log = logging.getLogger("ampwatch.agent")


class SpoolOutbox:
    """Unacknowledged batches on disk, oldest first; the oldest are dropped past ``max_bytes``."""

    def __init__(self, directory: str | os.PathLike[str], incarnation: str, max_bytes: int) -> None:
        self.root = pathlib.Path(directory)
        self.max_bytes = max_bytes
        self.dropped_events = 0  # events in batches dropped because the spool was full
        self._queue: collections.deque[Pending] = collections.deque()
        self._bytes = 0
        self._held: collections.Counter[pathlib.Path] = collections.Counter()  # folder -> queued batches
        self._locks: dict[pathlib.Path, int] = {}  # folder -> fd holding its flock
        self.root.mkdir(parents=True, exist_ok=True)
        self.folder = self.root / incarnation
        self.folder.mkdir()
        self._locks[self.folder] = self._lock(self.folder, blocking=True)
        self._adopt_orphans()

    def full(self) -> bool:
        """Return ``False``: the spool takes new batches and drops the oldest past its cap."""
        return False

    def put(self, pending: Pending) -> None:
        """Write ``pending`` to disk (atomically), then enforce the size cap."""
        body = pending.load()
        path = self.folder / f"{pending.seq:012d}-{pending.events}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)
        self._enqueue(Pending(seq=pending.seq, events=pending.events, run=pending.run,
                              rank=pending.rank, path=path, size=len(body)))
        self._drop_oldest_past(self.max_bytes, keep=1)  # only if make_room() was not asked first

    def make_room(self, size: int) -> bool:
        """Drop the oldest batches so that ``size`` more bytes fit; return whether any were dropped."""
        return self._drop_oldest_past(self.max_bytes - size, keep=0)

    def head(self) -> Pending | None:
        """Return the oldest unanswered batch, or ``None``."""
        return self._queue[0] if self._queue else None

    def pop(self) -> None:
        """Delete the oldest batch from disk (acknowledged, rejected, or over the cap)."""
        pending = self._queue.popleft()
        assert pending.path is not None
        self._bytes -= pending.size
        pending.path.unlink(missing_ok=True)  # missing: someone cleaned the spool by hand
        folder = pending.path.parent
        self._held[folder] -= 1
        if folder != self.folder and self._held[folder] <= 0:
            self._remove(folder)

    def close(self) -> None:
        """Release the locks; remove this incarnation's folder when everything was delivered."""
        for folder in list(self._locks):
            if folder != self.folder:
                os.close(self._locks.pop(folder))
        if self._held[self.folder] <= 0:
            self._remove(self.folder)
        elif self.folder in self._locks:
            os.close(self._locks.pop(self.folder))  # left for the next agent to replay

    def after_fork_in_child(self) -> None:
        """Close the lock descriptors without unlocking: the parent still holds the locks."""
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def _adopt_orphans(self) -> None:
        """Queue the batches of earlier incarnations whose process is gone (their lock is free)."""
        for folder in sorted(self.root.iterdir(), key=_mtime):
            if folder == self.folder or not folder.is_dir():
                continue
            try:
                fd = self._lock(folder, blocking=False)
            except OSError:  # alive (locked) or vanished
                continue
            self._locks[folder] = fd
            batches = sorted(folder.glob("*.json"))
            for path in batches:
                try:
                    seq, events = (int(x) for x in path.stem.split("-"))
                    body = path.read_bytes()
                    header = json.loads(body)
                    pending = Pending(seq=seq, events=events, run=str(header["run"]),
                                      rank=int(header["rank"]), path=path, size=len(body), replayed=True)
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ampwatch: skipping unreadable spooled batch %s (%s)", path, exc)
                    continue
                self._enqueue(pending)
            if self._held[folder] <= 0:
                self._remove(folder)
        self._drop_oldest_past(self.max_bytes, keep=0)
        if self._queue:
            log.info("ampwatch: replaying %d spooled batch(es) from earlier processes", len(self._queue))

    def _drop_oldest_past(self, limit: int, *, keep: int) -> bool:
        """Drop the oldest batches (keeping the newest ``keep``) until at most ``limit`` bytes remain."""
        dropped = False
        while self._bytes > limit and len(self._queue) > keep:
            self.dropped_events += self._queue[0].events
            self.pop()
            dropped = True
        return dropped

    def _enqueue(self, pending: Pending) -> None:
        """Append ``pending`` to the queue and account for its size and folder."""
        assert pending.path is not None
        self._queue.append(pending)
        self._bytes += pending.size
        self._held[pending.path.parent] += 1

    def _lock(self, folder: pathlib.Path, *, blocking: bool) -> int:
        """Open ``folder/lock`` and take its exclusive flock; raise OSError if another process holds it."""
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError:
            os.close(fd)
            raise
        return fd

    def _remove(self, folder: pathlib.Path) -> None:
        """Delete an emptied spool folder and release its lock."""
        for leftover in folder.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        (folder / "lock").unlink(missing_ok=True)
        fd = self._locks.pop(folder, None)
        if fd is not None:
            os.close(fd)
        try:
            folder.rmdir()
        except OSError:  # not empty (a file we could not parse): leave it for a human
            pass


def _mtime(path: pathlib.Path) -> float:
    """Return the modification time of ``path`` (0 when it vanished)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
