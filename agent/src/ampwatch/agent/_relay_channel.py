"""A rank's side of the node relay: hand a batch to the host's relay, else post it directly.

Used only on the sender thread. :class:`NodeChannel` connects to the host's
relay (becoming it when nobody is); :class:`RelayedClient` has the same
``post``/``close`` as :class:`~ampwatch.agent._http.IngestClient`, so the sender
does not know which way a batch went. Whenever the relay cannot answer (it is
gone, dies mid-wait, or is slow) the very same batch is posted directly: a
batch the relay had already delivered is then a duplicate the collector
recognises by (run, rank, incarnation, seq), so nothing is lost or counted twice.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ._config import AgentConfig
from ._errors import AgentErrors
from ._fork import forget_in_forked_children
from ._http import Answer, IngestClient
from ._identity import Identity
from ._relay import REPLY_HEAD, NodeRelay, RelayPaths, encode_frame, relay_hold, relay_paths

__all__ = ["NodeChannel", "RelayedClient"]

log = logging.getLogger("ampwatch.agent")

RETRY_GAP = 1.0  # seconds: after failing to reach or become the relay, post directly this long before trying again
HUNG_RELAY_GAP = 30.0  # seconds: after a relay let a batch time out, post directly this long before trying it again


class NodeChannel:
    """This rank's connection to the host's relay, or the relay itself when this rank claimed it."""

    def __init__(self, config: AgentConfig, identity: Identity, errors: AgentErrors) -> None:
        self.config, self.identity, self.errors = config, identity, errors
        self.relay: NodeRelay | None = None
        self._paths: RelayPaths | None = None
        self._conn: socket.socket | None = None
        self._next_try = 0.0
        self._broken = False  # the relay directory is unusable: always post directly
        self._said_fallback = False
        self._pid = os.getpid()
        forget_in_forked_children(self)

    def post(self, url: str, body: bytes, timeout: float) -> Answer | None:
        """Hand ``body`` to the relay and return the collector's answer; ``None``: post it yourself.

        Waits at most ``timeout`` plus the relay's longest hold (1 s). Costs a Unix-socket round trip when the
        relay is up; when it is not, a failed ``connect`` at most once per second.
        """
        conn = self._connection()
        if conn is None:
            return None
        try:
            conn.settimeout(timeout + relay_hold(self.config))
            conn.sendall(encode_frame(url, body))
            head = _read_exactly(conn, REPLY_HEAD.size)
            reply = json.loads(_read_exactly(conn, REPLY_HEAD.unpack(head)[0]))
            retry_after = reply.get("retry_after")
            return Answer(reply["status"], reply["detail"], float(retry_after) if retry_after is not None else None)
        except TimeoutError:
            # Alive but not answering (stopped, or stuck on a slow collector): it keeps its lock, so nobody
            # takes over; post directly for a while rather than wait on it again at every batch.
            self._fall_back("did not answer in time", HUNG_RELAY_GAP)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._fall_back(f"is gone ({exc})", 0.0)  # next time: take over, or find the rank that did
        return None

    def _fall_back(self, why: str, gap: float) -> None:
        self._disconnect()
        self._next_try = time.monotonic() + gap
        if not self._said_fallback:
            self._said_fallback = True
            log.info("ampwatch: the node relay %s; this rank posts for itself until a relay answers again", why)

    def close(self) -> None:
        """Disconnect, and stop the relay if this rank runs it (the other ranks then elect a new one)."""
        if os.getpid() != self._pid:
            return
        self._disconnect()
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def _connection(self) -> socket.socket | None:
        """Return a connection to the relay, claiming the relay role when nobody holds it; ``None`` meanwhile."""
        if self._conn is not None:
            return self._conn
        if self._broken or time.monotonic() < self._next_try:
            return None
        self._next_try = time.monotonic() + RETRY_GAP
        try:
            if self._paths is None:
                self._paths = relay_paths(self.config, self.identity)
            conn = self._connect()
            if conn is None and self.relay is None:
                self.relay = NodeRelay.claim(self.config, self._paths, self.errors)
                if self.relay is not None:
                    conn = self._connect()
        except OSError as exc:
            self._broken = True
            self.errors.report("setting up the node relay (posting directly)", exc)
            return None
        self._conn = conn
        return conn

    def _connect(self) -> socket.socket | None:
        assert self._paths is not None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(1.0)
            with self._paths.address() as address:
                conn.connect(address)
        except OSError:  # no relay yet, or one that died and left its socket file
            conn.close()
            return None
        return conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _after_fork_in_child(self) -> None:
        """A forked child never sends: drop the inherited connection without touching the parent's relay."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.relay = None
        self._broken = True


class RelayedClient:
    """One collector reached through the node relay when it answers, else directly (same surface as IngestClient)."""

    def __init__(self, url: str, direct: IngestClient, node: NodeChannel) -> None:
        self.url, self._direct, self._node = url, direct, node

    def post(self, body: bytes, timeout: float) -> Answer:
        """Return the collector's answer to ``body``, through the relay or, failing that, directly."""
        answer = self._node.post(self.url, body, timeout)
        return answer if answer is not None else self._direct.post(body, timeout)

    def close(self) -> None:
        """Drop the direct connection (the sender closes the node channel itself)."""
        self._direct.close()


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the relay closed the connection")
        data += chunk
    return bytes(data)
