"""On-disk outbox (``AMPWATCH_SPOOL_DIR``): batches survive an outage and a restart, within a size cap.

Layout: one folder per incarnation holding ``lock`` (an exclusive ``flock``
held while the process lives) and ``<seq>-<events>.json`` per batch. A new
agent adopts the folders whose lock it can take (their process is gone) and
sends their batches first, unchanged, so they keep their original identity.

Every batch carries the process key and is posted with the job's token, so the
spool is private whatever the umask: folders 0700, files 0600, made with those
modes and set again by descriptor. The spool folder must be the user's own (one
looser than 0700 is tightened); anything in it that the agent did not write (an
entry another user owns, one that is not a regular file or folder, a file others
may write) is refused unread, counted in :attr:`SpoolOutbox.refused_files` and
logged once.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import pathlib
import stat

from ampwatch.contract.placement import block_of

from ._outbox import Pending

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no adoption of other processes' spools
    fcntl = None  # type: ignore[assignment]

__all__ = ["SpoolOutbox"]

log = logging.getLogger("ampwatch.agent")

_PRIVATE_FOLDER, _PRIVATE_FILE = 0o700, 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH  # a file these may write is not vouched for by its owner


class SpoolOutbox:
    """Unacknowledged batches on disk, oldest first; the oldest are dropped past ``max_bytes``."""

    def __init__(self, directory: str | os.PathLike[str], incarnation: str, max_bytes: int) -> None:
        self.root = pathlib.Path(directory)
        self.max_bytes = max_bytes
        self.dropped_events = 0  # events in batches dropped because the spool was full
        self._queue: collections.deque[Pending] = collections.deque()
        self._bytes = 0
        self.refused_files = 0  # entries of the spool refused unread (another user's, not regular, writable by others)
        self._held: collections.Counter[pathlib.Path] = collections.Counter()  # folder -> queued batches
        self._locks: dict[pathlib.Path, int] = {}  # folder -> fd holding its flock
        self._refused: list[str] = []  # the first refusals, for the one log line
        _private_root(self.root)
        self.folder = self.root / incarnation
        os.mkdir(self.folder, _PRIVATE_FOLDER)
        os.chmod(self.folder, _PRIVATE_FOLDER)  # a umask may have taken the owner's bits too
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
        tmp.unlink(missing_ok=True)  # a leftover of ours: no one else can write in this folder
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _PRIVATE_FILE)
        try:
            os.fchmod(fd, _PRIVATE_FILE)
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._enqueue(Pending(seq=pending.seq, events=pending.events, run=pending.run, rank=pending.rank,
                              world_size=pending.world_size, path=path, size=len(body)))
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
            if folder == self.folder or not self._own_folder(folder):
                continue
            try:
                fd = self._lock(folder, blocking=False)
            except OSError as exc:  # alive (locked) or vanished; a planted link is refused
                if exc.errno == errno.ELOOP:
                    self._refuse(folder / "lock", "a symbolic link")
                continue
            self._locks[folder] = fd
            batches = sorted(folder.glob("*.json"))
            for path in batches:
                try:
                    seq, events = (int(x) for x in path.stem.split("-"))
                    body = self._read_own(path)
                    if body is None:
                        continue
                    header = json.loads(body)
                    pending = Pending(seq=seq, events=events, run=str(header["run"]), rank=int(header["rank"]),
                                      world_size=int(header["world_size"]), path=path, size=len(body), replayed=True)
                    block_of(pending.rank, pending.world_size)  # a rank its world cannot hold has no collector
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ampwatch: skipping unreadable spooled batch %s (%s)", path, exc)
                    continue
                self._enqueue(pending)
            if self._held[folder] <= 0:
                self._remove(folder)
        self._drop_oldest_past(self.max_bytes, keep=0)
        if self._refused:
            log.warning("ampwatch: refused %d entr%s of the spool %s that this process's user did not write "
                        "there (%s); not read, not sent (counted in refused_spool_files)", self.refused_files,
                        "y" if self.refused_files == 1 else "ies", self.root, "; ".join(self._refused))
        if self._queue:
            log.info("ampwatch: replaying %d spooled batch(es) from earlier processes", len(self._queue))

    def _own_folder(self, folder: pathlib.Path) -> bool:
        """Tell whether ``folder`` is an incarnation folder of this user's (tightened to 0700 if looser);
        refuse (count) anything else: a folder another user owns, a link, a file."""
        try:
            info = os.lstat(folder)
        except OSError:  # vanished
            return False
        if not stat.S_ISDIR(info.st_mode):
            self._refuse(folder, _kind(info.st_mode))
            return False
        if info.st_uid != os.geteuid():
            self._refuse(folder, f"a folder of uid {info.st_uid}")
            return False
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(folder, _PRIVATE_FOLDER)  # an older agent's, made under the umask
        return True

    def _read_own(self, path: pathlib.Path) -> bytes | None:
        """Return the spooled batch at ``path`` if this user wrote it (a regular file of theirs that no one else
        may write), else refuse it (count it) unread and return None; open without following a link, without
        blocking on a fifo, and judge the open file itself."""
        info = os.lstat(path)
        why = _not_own_file(info)
        if why is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
            try:
                opened = os.fstat(fd)
                why = _not_own_file(opened) or ("replaced while read" if opened.st_ino != info.st_ino else None)
                if why is None:
                    if stat.S_IMODE(opened.st_mode) & 0o077:
                        os.fchmod(fd, _PRIVATE_FILE)  # an older agent's, made under the umask
                    with os.fdopen(os.dup(fd), "rb") as file:
                        return file.read()
            finally:
                os.close(fd)
        self._refuse(path, why)
        return None

    def _refuse(self, path: pathlib.Path, why: str) -> None:
        """Count an entry of the spool that is not this user's own batch; the first few are named in the log."""
        self.refused_files += 1
        if len(self._refused) < 4:
            self._refused.append(f"{path}: {why}")

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
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW, _PRIVATE_FILE)
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


def _private_root(root: pathlib.Path) -> None:
    """Make the spool folder (and its missing parents) 0700, or check the one there: this user's own, tightened to
    0700 if looser; raise OSError naming the fix if it belongs to another user or is not a folder."""
    missing = []
    folder = root
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, _PRIVATE_FOLDER)
            os.chmod(folder, _PRIVATE_FOLDER)
        except FileExistsError:  # another rank of the host made it meanwhile
            pass
    info = os.stat(root)  # a link to a folder is followed: the folder is judged
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(root))
    if info.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"the spool folder belongs to uid {info.st_uid}, not to this process's "
                              f"user ({os.geteuid()}), who could not keep it private: set AMPWATCH_SPOOL_DIR to a "
                              "folder of this user's own", str(root))
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, _PRIVATE_FOLDER)
        log.info("ampwatch: made the spool folder %s private (0700; it was %o)", root, stat.S_IMODE(info.st_mode))


def _not_own_file(info: os.stat_result) -> str | None:
    """Say why a spooled batch's ``stat`` is not one this user wrote, or None when it is."""
    if not stat.S_ISREG(info.st_mode):
        return _kind(info.st_mode)
    if info.st_uid != os.geteuid():
        return f"a file of uid {info.st_uid}"
    if info.st_mode & _FOREIGN_WRITE:
        return f"a file others may write (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _kind(mode: int) -> str:
    """Name what a ``stat`` mode is, for a refusal."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file")):
        if test(mode):
            return name
    return "a device"


def _mtime(path: pathlib.Path) -> float:
    """Return the modification time of ``path`` itself, a link's own (0 when it vanished)."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0
