"""The fleet view: the runs of this collector's peers (``--peers``), asked in the background so no reader waits.

Each round asks every other peer's ``GET /v1/runs?scope=local`` (that replica's own runs, its
:data:`PEER_RUNS` most recently seen) at once, each with a deadline of :data:`PEER_DEADLINE_S`, sending
``--read-token`` when set (every replica of a deployment shares one). Rounds run every :data:`REFRESH_S`
and, sooner, when a reader asks for the fleet and the last round is older than :data:`FRESH_S` (the page,
every 3 s while open, so starts one per refresh); the reader gets the last answers at once, with their age,
never waiting on a peer (only a reader arriving before the very first round ended waits for it, at most one
deadline). A peer is, by its latest ask:

| the latest ask                                             | state  | its runs                      |
|------------------------------------------------------------|--------|-------------------------------|
| answered 200 with a run list within the deadline           | `up`   | that answer's                 |
| no answer within the deadline (a hung or overloaded peer)  | `slow` | its last answer's, with its age |
| or the ask before it still not over                        | `slow` | likewise                      |
| refused, unreachable, an HTTP error or not a run list      | `down` | likewise                      |

The asks run in a thread pool of this module's own (``http.client`` through ``urllib``, no proxy), never
the event loop's default one that the database reads use, so a hung peer holds at most one of its threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

__all__ = ["FRESH_S", "PEER_DEADLINE_S", "PEER_RUNS", "REFRESH_S", "Fleet", "PeerState"]

log = logging.getLogger("ampwatch.server")

PEER_DEADLINE_S = 0.75
"""Seconds a peer has to answer one ask; past it the peer is ``slow`` (under a second: the issue's bound)."""
REFRESH_S = 30.0
"""Seconds between rounds while nobody reads the fleet (an idle fleet asks little of its peers' databases)."""
FRESH_S = 1.0
"""A reader of an answer older than this starts a round (and is answered from the last one, at once)."""
PEER_RUNS = 1000
"""Runs asked of each peer, its most recently seen: the fleet answer pages over these (GET /v1/runs' most)."""
_MAX_ANSWER_BYTES = 16 << 20  # a peer's answer read at most (1,000 runs with 128-character names: ~250 KB)
_ROW_FIELDS: dict[str, Any] = {"run": str, "ranks": int, "first_seen": (int, float), "last_seen": (int, float),
               "in_metrics": bool, "split": (dict, type(None))}


@dataclasses.dataclass(slots=True)
class PeerState:
    """What this collector knows of one peer: its state, its last run list and when that came."""

    url: str
    state: str = "slow"  # until its first ask ends
    error: str | None = "not asked yet"
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    answered_at: float | None = None  # time.monotonic() of its last answer
    checked_at: float | None = None  # time.monotonic() its state was judged
    asking: concurrent.futures.Future | None = None

    def describe(self, now: float) -> dict[str, Any]:
        """The peer as ``GET /v1/runs`` lists it in ``replicas``."""
        def age(then: float | None) -> float | None:
            return None if then is None else round(now - then, 3)
        return {"url": self.url, "state": self.state, "answer_age": age(self.answered_at),
                "checked_age": age(self.checked_at), "error": self.error, "self": False}


class PeerError(Exception):
    """A peer answered, but not with a run list (or refused the ask): it counts as ``down``."""


def _runs_of(body: Any, url: str) -> list[dict[str, Any]]:
    """The rows of a peer's answer, each field checked and ``replica`` set to the peer's URL in ``--peers``."""
    if not isinstance(body, dict) or not isinstance(body.get("runs"), list):
        raise PeerError("its answer is not a run list (is it an ampwatch collector?)")
    rows = []
    for row in body["runs"]:
        if not isinstance(row, dict) or not all(
                isinstance(row.get(name), kind) and not (kind is int and isinstance(row[name], bool))
                for name, kind in _ROW_FIELDS.items() if name != "split"):
            raise PeerError("a row of its run list lacks run, ranks, first_seen, last_seen or in_metrics")
        split = row.get("split")
        rows.append({**{name: row[name] for name in _ROW_FIELDS if name != "split"},
                     "split": split if isinstance(split, dict) else None, "replica": url})
    return rows


def ask_peer(url: str, read_token: str | None, deadline_s: float) -> list[dict[str, Any]]:
    """Ask one peer for its own runs (blocking: run it in a thread). ``TimeoutError`` past the deadline,
    :class:`PeerError` or ``OSError`` when it refuses or cannot be reached."""
    headers = {"Accept": "application/json", "User-Agent": "ampwatch-collector (fleet view)"}
    if read_token:
        headers["Authorization"] = f"Bearer {read_token}"
    request = urllib.request.Request(f"{url}/v1/runs?scope=local&limit={PEER_RUNS}", headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the peer as listed, never a proxy
    try:
        with opener.open(request, timeout=deadline_s) as answer:
            body = answer.read(_MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as error:
        hint = " (every replica must share one --read-token)" if error.code in (401, 403) else ""
        raise PeerError(f"HTTP {error.code}{hint}") from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise TimeoutError() from None
        raise OSError(str(error.reason)) from None
    if len(body) > _MAX_ANSWER_BYTES:
        raise PeerError(f"its answer is over {_MAX_ANSWER_BYTES} bytes")
    try:
        return _runs_of(json.loads(body), url)
    except ValueError:
        raise PeerError("its answer is not JSON") from None


class Fleet:
    """This collector's view of its peers: :meth:`run` refreshes it, :meth:`answers` reads it without waiting.

    ``own`` is this collector's URL (``--advertise-url``); ``peers`` every collector of ``--peers``, this one
    included or not.
    """

    def __init__(self, own: str, peers: Iterable[str], read_token: str | None, *,
                 deadline_s: float = PEER_DEADLINE_S, period_s: float = REFRESH_S, fresh_s: float = FRESH_S) -> None:
        self.own, self.read_token = own, read_token
        self.deadline_s, self.period_s, self.fresh_s = deadline_s, period_s, fresh_s
        self.peers = {url: PeerState(url) for url in peers if url != own}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.peers)),
                                                           thread_name_prefix="ampwatch-fleet")
        self._wanted = asyncio.Event()
        self._first_round = asyncio.Event()
        self._round_started = -math.inf

    async def run(self) -> None:
        """Ask every peer each :data:`REFRESH_S`, or sooner when a reader wants a fresher answer."""
        while True:
            self._wanted.clear()
            self._round_started = time.monotonic()
            try:
                await asyncio.gather(*(self._ask(peer) for peer in self.peers.values()))
            except Exception:  # a bug here must not end the fleet view for good
                log.exception("asking the peers for their runs failed; will retry")
            self._first_round.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), self.period_s)

    async def _ask(self, peer: PeerState) -> None:
        if peer.asking is not None and not peer.asking.done():  # the last ask still hangs: no second thread
            peer.state, peer.error = "slow", f"no answer within {self.deadline_s:g} s"
            peer.checked_at = time.monotonic()
            return
        loop = asyncio.get_running_loop()
        peer.asking = self._pool.submit(ask_peer, peer.url, self.read_token, self.deadline_s)
        try:
            runs = await asyncio.wait_for(asyncio.wrap_future(peer.asking, loop=loop), self.deadline_s)
        except (asyncio.TimeoutError, TimeoutError):
            peer.state, peer.error = "slow", f"no answer within {self.deadline_s:g} s"
        except Exception as error:  # PeerError, OSError (refused, reset), http.client's (a garbled answer)
            peer.state, peer.error = "down", str(error) or type(error).__name__
        else:
            peer.state, peer.error, peer.runs, peer.answered_at = "up", None, runs, time.monotonic()
        peer.checked_at = time.monotonic()

    async def answers(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every peer's last run list (rows with ``replica``) and the ``replicas`` entries, without waiting on
        any peer; a round starts when the last one is older than ``fresh_s`` (this answer does not wait for it)."""
        if not self._first_round.is_set():  # only before the first round ended: at most one deadline
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._first_round.wait(), self.deadline_s + 0.1)
        now = time.monotonic()
        if now - self._round_started > self.fresh_s:
            self._wanted.set()
        rows = [row for peer in self.peers.values() for row in peer.runs]
        replicas = [{"url": self.own, "state": "up", "answer_age": 0.0, "checked_age": 0.0, "error": None,
                     "self": True}]
        return rows, replicas + [peer.describe(now) for peer in self.peers.values()]

    def close(self) -> None:
        """Stop the threads (an ask still hanging ends at its socket's deadline, in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
