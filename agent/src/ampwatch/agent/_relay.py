"""The node relay: one process per host takes its ranks' batches over a Unix socket and posts them together.

Runs on its own daemon thread in whichever rank first claims the host's relay
lock (``flock``, released by the kernel when that process dies, so another
rank can take over). Ranks hand over encoded v1 batches
(:mod:`ampwatch.agent._relay_channel`); the relay waits a little to gather
the other ranks' batches (:func:`relay_wait`), posts them as one protocol v2 request per
collector, and answers each rank with its own result. Against a collector
that refuses v2 it posts each batch as v1. Nothing here touches the training
thread; a failure closes the affected connection, and that rank then posts
for itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import selectors
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from ampwatch.contract.node_batch import MAX_NODE_BATCHES, encode_node_batch

from ._config import AgentConfig
from ._errors import AgentErrors
from ._fork import forget_in_forked_children
from ._http import Answer, IngestClient, Outcome
from ._identity import Identity
from ._limits import COLLECTOR_DEFAULTS

__all__ = ["RelayPaths", "relay_paths", "NodeRelay", "relay_wait", "relay_hold", "encode_frame", "encode_reply",
           "FRAME_HEAD", "REPLY_HEAD"]

log = logging.getLogger("ampwatch.agent")

FRAME_HEAD = struct.Struct("!HI")  # a rank's hand-over: URL length, body length, then the URL and the body
REPLY_HEAD = struct.Struct("!I")   # the relay's answer: length of a JSON {"status", "detail", "retry_after"}
MAX_BODY_BYTES = COLLECTOR_DEFAULTS["max_body_bytes"]
V1_RECHECK = 300.0  # seconds: how long a collector that refused v2 gets v1 before the relay tries v2 again
SOCKET_PATH_MAX = 107  # bytes of path a Unix socket address holds (Linux's sun_path is 108, with the NUL)


def relay_wait(config: AgentConfig, body: bytes) -> float:
    """Return how long the relay may hold ``body`` for other ranks' batches to join it (seconds).

    News (a batch with events, or the closing one) waits at most 0.2 s (half the push interval
    if shorter): the other ranks' news of the same step (DDP ranks skip together) joins it. A
    batch of counters only waits up to one push interval (at most 1 s), long enough for every
    rank of the host to hand over its own whatever their phases. Costs two substring searches
    (the agent's compact JSON has ``"events":[]`` exactly when there are no events).
    """
    if b'"events":[]' in body and b'"closed":true' not in body:
        return relay_hold(config)
    return min(0.2, config.heartbeat / 2)


def relay_hold(config: AgentConfig) -> float:
    """Return the longest the relay holds a batch before posting it (seconds)."""
    return min(1.0, config.heartbeat)


class RelayPaths:
    """Where one job's relay on this host listens: a socket and a lock file in a private directory."""

    def __init__(self, directory: str, key: str) -> None:
        self.directory = directory
        self.socket = os.path.join(directory, key + ".sock")
        self.lock = os.path.join(directory, key + ".lock")

    @contextlib.contextmanager
    def address(self) -> Iterator[str]:
        """Yield a name for the socket that ``bind()`` and ``connect()`` take, however long the directory's path.

        A Unix socket's address holds at most :data:`SOCKET_PATH_MAX` bytes (a deep ``tmp_path`` or home
        directory passes it). A longer path is reached through a descriptor of the directory,
        ``/proc/self/fd/N/<key>.sock`` (Linux), which names the same file; where there is no ``/proc``, OSError says so.
        """
        if len(os.fsencode(self.socket)) <= SOCKET_PATH_MAX:
            yield self.socket
            return
        if not os.path.isdir("/proc/self/fd"):
            raise OSError(errno.ENAMETOOLONG, f"the relay socket's path is longer than a Unix socket address holds "
                          f"({SOCKET_PATH_MAX} bytes): set AMPWATCH_RELAY_DIR to a shorter directory", self.socket)
        fd = os.open(self.directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield f"/proc/self/fd/{fd}/{os.path.basename(self.socket)}"
        finally:
            os.close(fd)


def relay_paths(config: AgentConfig, identity: Identity) -> RelayPaths:
    """Return this job's relay paths, creating the directory (0700); raise OSError when it is not private.

    The key covers everything the relay posts with (run, host, collectors, token), so ranks
    configured differently never share a relay. Costs a ``mkdir`` and an ``lstat``.
    """
    directory = config.relay_dir or _default_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"the relay directory {directory} must be a directory owned by this user with "
                              "permissions 0700 (set AMPWATCH_RELAY_DIR to a private directory)")
    material = "\x00".join((str(os.getuid()), identity.run, identity.host, config.token or "", *config.collectors))
    return RelayPaths(directory, hashlib.sha256(material.encode()).hexdigest()[:24])


def _default_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "ampwatch")
    return os.path.join(tempfile.gettempdir(), f"ampwatch-{os.getuid()}")


def encode_frame(url: str, body: bytes) -> bytes:
    """Return a rank's hand-over of ``body`` for the collector at ``url``."""
    raw = url.encode()
    return FRAME_HEAD.pack(len(raw), len(body)) + raw + body


def encode_reply(answer: Answer) -> bytes:
    """Return the relay's answer to one rank: what the collector said about that rank's batch."""
    payload = json.dumps({"status": answer.status, "detail": answer.detail,
                          "retry_after": answer.retry_after}).encode()
    return REPLY_HEAD.pack(len(payload)) + payload


class _Peer:
    """One rank's connection: bytes read so far, and the batch it waits to have posted."""

    __slots__ = ("sock", "buffer", "url", "body", "due")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, bytearray()
        self.url: str | None = None
        self.body: bytes | None = None
        self.due = 0.0  # monotonic time by which its batch is posted


class NodeRelay:
    """Posts this host's ranks' batches, one v2 request per collector at a time; see the module docstring."""

    def __init__(self, config: AgentConfig, paths: RelayPaths, lock_fd: int, listener: socket.socket,
                 errors: AgentErrors) -> None:
        self.config, self.paths, self.errors = config, paths, errors
        self._lock_fd, self._listener = lock_fd, listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._clients: dict[str, IngestClient] = {}
        self._v1_until: dict[str, float] = {}
        self._peers: dict[socket.socket, _Peer] = {}
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="ampwatch-relay", daemon=True)
        forget_in_forked_children(self)

    @classmethod
    def claim(cls, config: AgentConfig, paths: RelayPaths, errors: AgentErrors) -> NodeRelay | None:
        """Become the host's relay if no live process is (non-blocking); return it started, else ``None``."""
        fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None  # a live relay holds it (it may still be binding: the rank posts directly meanwhile)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                os.unlink(paths.socket)  # left by a relay that died: the lock says nobody serves it
            except FileNotFoundError:
                pass
            with paths.address() as address:
                listener.bind(address)
            os.chmod(paths.socket, 0o600)
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            os.close(fd)
            raise
        relay = cls(config, paths, fd, listener, errors)
        relay._thread.start()
        log.info("ampwatch: this process relays the batches of this host's ranks (%s)", paths.socket)
        return relay

    def close(self, timeout: float = 1.0) -> None:
        """Stop serving (ranks waiting on it post for themselves), release the socket and the lock."""
        if os.getpid() != self._pid or self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

    # -- the relay thread --------------------------------------------------------------------

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                try:
                    for key, _ in selector.select(self._wait()):
                        if key.fileobj is self._listener:
                            self._accept(selector)
                        elif key.fileobj is self._wake_r:
                            self._wake_r.recv(64)
                        else:
                            self._read(selector, self._peers[key.fileobj])  # type: ignore[index]
                    if self._due():
                        self._flush()
                except Exception as exc:  # never let the thread die silently: count, drop the peers, carry on
                    self.errors.report("the node relay", exc)
                    for peer in list(self._peers.values()):
                        self._drop(selector, peer)
                    self._stop.wait(0.5)
        finally:
            self._release(selector)

    def _wait(self) -> float | None:
        """Return how long select() may sleep: until the first waiting batch is due."""
        due = [p.due for p in self._peers.values() if p.body is not None]
        return None if not due else max(0.0, min(due) - time.monotonic())

    def _due(self) -> bool:
        """Return whether to post now: every connected rank has a batch waiting, or one batch is due."""
        waiting = [p for p in self._peers.values() if p.body is not None]
        if not waiting:
            return False
        return len(waiting) == len(self._peers) or time.monotonic() >= min(p.due for p in waiting)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            self._peers[sock] = _Peer(sock)
            selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, peer: _Peer) -> None:
        """Read what a rank sent; a whole frame becomes its waiting batch. EOF or a bad frame drops the rank."""
        try:
            chunk = peer.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk or peer.body is not None:  # gone, or a second batch before the answer: not our protocol
            self._drop(selector, peer)
            return
        peer.buffer += chunk
        if len(peer.buffer) < FRAME_HEAD.size:
            return
        url_len, body_len = FRAME_HEAD.unpack_from(peer.buffer)
        if body_len > MAX_BODY_BYTES:
            self._drop(selector, peer)
            return
        end = FRAME_HEAD.size + url_len + body_len
        if len(peer.buffer) < end:
            return
        url = bytes(peer.buffer[FRAME_HEAD.size:FRAME_HEAD.size + url_len]).decode("utf-8", "replace")
        if len(peer.buffer) > end or url not in self.config.collectors:
            self._drop(selector, peer)  # the relay posts only where its own ranks are configured to
            return
        peer.url, peer.body = url, bytes(peer.buffer[FRAME_HEAD.size + url_len:end])
        peer.due = time.monotonic() + relay_wait(self.config, peer.body)
        peer.buffer.clear()

    def _flush(self) -> None:
        """Post every waiting batch, grouped by collector, and answer each rank."""
        waiting = [p for p in self._peers.values() if p.body is not None]
        by_url: dict[str, list[_Peer]] = {}
        for peer in waiting:
            by_url.setdefault(peer.url, []).append(peer)  # type: ignore[arg-type]
        for url, peers in by_url.items():
            for chunk in _chunks(peers):
                answers = self._post(url, [p.body for p in chunk])  # type: ignore[misc]
                for peer, answer in zip(chunk, answers, strict=True):
                    peer.url = peer.body = None
                    try:
                        peer.sock.settimeout(1.0)  # a reply is small and its rank is reading: never long
                        peer.sock.sendall(encode_reply(answer))
                        peer.sock.setblocking(False)
                    except OSError:  # the rank gave up waiting: it posts for itself (the collector dedups)
                        try:
                            peer.sock.shutdown(socket.SHUT_RDWR)  # no half reply: the next read drops it
                        except OSError:
                            pass

    def _post(self, url: str, bodies: list[bytes]) -> list[Answer]:
        """Post ``bodies`` to ``url`` as one v2 request (v1 each when one, or the collector refuses v2)."""
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = IngestClient(url, self.config.token)
        timeout = self.config.timeout
        if len(bodies) > 1 and self._v1_until.get(url, 0.0) <= time.monotonic():
            answer = client.post(encode_node_batch(bodies), timeout)
            answers = _per_rank(answer, len(bodies))
            if answers is not None:
                return answers
            # Refused as a whole: a collector that knows only v1 says 422 (or 400), one with a smaller body
            # limit than the default 413: post each batch as v1.
            self._v1_until[url] = time.monotonic() + V1_RECHECK
            log.info("ampwatch: %s refused a protocol v2 batch (HTTP %s); the relay posts protocol v1 for the "
                     "next %d s", url, answer.status, V1_RECHECK)
        return [client.post(body, timeout) for body in bodies]

    def _drop(self, selector: selectors.BaseSelector, peer: _Peer) -> None:
        self._peers.pop(peer.sock, None)
        try:
            selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()

    def _release(self, selector: selectors.BaseSelector) -> None:
        """Close every connection, remove the socket, then let go of the lock (in that order)."""
        for peer in list(self._peers.values()):
            self._drop(selector, peer)
        selector.close()
        for client in self._clients.values():
            client.close()
        self._listener.close()
        try:
            os.unlink(self.paths.socket)
        except OSError:
            pass
        os.close(self._lock_fd)
        self._wake_r.close()
        self._wake_w.close()

    def _after_fork_in_child(self) -> None:
        """Close the inherited socket and lock in a forked child, so they die with the parent.

        Takes no lock (another thread of the parent may have held one at fork time): ``close()``
        does nothing in a child, as the pid tells it.
        """
        for sock in (self._listener, self._wake_r, self._wake_w, *self._peers):
            sock.close()
        self._peers.clear()
        try:
            os.close(self._lock_fd)
        except OSError:
            pass


def _per_rank(answer: Answer, count: int) -> list[Answer] | None:
    """Return each rank's answer from a v2 answer; ``None`` when the collector refused v2 itself."""
    if answer.status == 200:
        try:
            results = json.loads(answer.detail)["results"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(results, list) or len(results) != count:
            return None
        return [_rank_answer(r) for r in results]
    if answer.outcome is Outcome.REJECTED and answer.status in (400, 404, 405, 413, 415, 422):
        return None
    return [answer] * count  # no answer, back-pressure, auth...: the same for every rank, each acts on it


def _rank_answer(result: Any) -> Answer:
    if not isinstance(result, dict) or not isinstance(result.get("status"), int):
        return Answer(502, '{"error": "relay", "retry": true, "message": "the collector\'s v2 answer is malformed"}')
    result = dict(result)
    status = result.pop("status")
    retry_after = result.pop("retry_after", None)
    return Answer(status, json.dumps(result), float(retry_after) if isinstance(retry_after, (int, float)) else None)


def _chunks(peers: list[_Peer]) -> Iterator[list[_Peer]]:
    """Split ``peers`` so each request stays under a default collector's body limit and batch count."""
    chunk: list[_Peer] = []
    size = 64
    for peer in peers:
        length = len(peer.body) + 12  # type: ignore[arg-type]
        if chunk and (size + length > MAX_BODY_BYTES or len(chunk) == MAX_NODE_BATCHES):
            yield chunk
            chunk, size = [], 64
        chunk.append(peer)
        size += length
    if chunk:
        yield chunk
