"""The senders of ``bench._loadgen``: paced ones (one update per rank per interval) and saturating ones.

A :class:`Load` says what goes where (target, job, event rate, ranks per node); each sender keeps
one kept-alive connection and sends one request at a time, as an agent does, and notes what came
back in the shared :class:`Tally`. Latency is from send to the full answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable

from bench._async_http import INGEST_HEAD, read_answer, request
from bench._loadgen_bodies import (
    PER_NODE,
    SKIP_EVERY,
    ampwatch_node_template,
    ampwatch_template,
    pushgateway_template,
    storm_template,
)

__all__ = ["AGENT_TIMEOUT_S", "TARGETS", "Load", "Tally", "paced_sender", "saturating_connection"]

TARGETS = ("ampwatch", "ampwatch-node", "pushgateway")
AGENT_TIMEOUT_S = 2.0  # the agent's default AMPWATCH_TIMEOUT: a slower answer is a failed send, retried


@dataclasses.dataclass(frozen=True)
class Load:
    """What the generator sends: to ``target`` (one of :data:`TARGETS`), for job ``run`` of ``ranks`` ranks."""

    target: str
    run: str
    ranks: int
    every: int = SKIP_EVERY  # a skip and a backoff every this many updates of a rank
    per_node: int = PER_NODE  # ranks per node (one v2 request carries them all), target ampwatch-node

    @property
    def senders(self) -> int:
        """How many senders carry the ranks: one per rank, or one per node."""
        return -(-self.ranks // self.per_node) if self.target == "ampwatch-node" else self.ranks

    def template(self, index: int) -> Callable[[int], bytes]:
        """Return ``seq -> body`` for sender ``index`` (a rank, or a node for ``ampwatch-node``)."""
        if self.target == "ampwatch-node":
            return ampwatch_node_template(self.run, index, self.ranks, self.per_node, self.every)
        build = ampwatch_template if self.target == "ampwatch" else pushgateway_template
        return build(self.run, index, self.ranks, self.every)

    def head(self, rank: int) -> bytes:
        """Return the request line and headers of ``rank``'s requests, but for the ``Content-Length``."""
        if self.target.startswith("ampwatch"):
            return INGEST_HEAD
        return (f"PUT /metrics/job/{self.run}/rank/{rank} HTTP/1.1\r\nHost: bench\r\n"
                f"Content-Type: text/plain; version=0.0.4\r\n").encode()


class Tally:
    """What every sender saw."""

    def __init__(self) -> None:
        self.latency: list[float] = []  # seconds, steady state only (after each rank's first 2 updates)
        self.latency_all: list[float] = []  # seconds, every answered update (first contact included)
        self.latency_storm: list[float] = []  # seconds, updates sent during the storm (``--storm``)
        self.timeouts = 0  # answers slower than the agent's timeout (2 s), unanswered ones included
        self.missed = 0  # update slots a rank skipped because the answers came too slowly
        self.unanswered = 0  # requests still unanswered at the end of the grace period
        self.lag: list[float] = []      # seconds the send started after its schedule (generator or server behind)
        self.answered = 0  # rank updates applied (a v2 request carries several)
        self.requests = 0  # requests answered
        self.failures: dict[int, int] = {}
        self.first_send = float("inf")
        self.last_answer = 0.0
        self.reconnects = 0  # kept-alive connections the server had closed while idle (uvicorn: after 5 s)

    def count(self, statuses: dict[int, int]) -> None:
        """Note one answered request: ``{status: rank updates}``."""
        self.requests += 1
        for status, updates in statuses.items():
            if 200 <= status < 300:
                self.answered += updates
            else:
                self.failures[status] = self.failures.get(status, 0) + updates


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                    body: bytes) -> dict[int, int]:
    """Send one request; return ``{status: rank updates}`` (a v2 answer's per-rank statuses, else the HTTP one)."""
    writer.write(request(head, body))
    status, _, answer = await read_answer(reader)
    if status == 200 and answer.startswith(b'{"protocol": 2'):
        statuses: dict[int, int] = {}
        for result in json.loads(answer)["results"]:
            statuses[result["status"]] = statuses.get(result["status"], 0) + 1
        return statuses
    return {status: 1}


async def paced_sender(load: Load, port: int, rank: int, start: float, seconds: int, grace: float, tally: Tally,
                       interval: float = 1.0, storm: tuple[float, float] | None = None,
                       pattern: str = "streaks") -> None:
    """Send sender ``rank``'s update once per ``interval`` from ``start`` for ``seconds``, spread over the interval.

    ``storm``: ``(from, to)`` on the ``perf_counter`` clock, when every update skips (bench/_storm.py).
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if storm is not None:
        build = storm_template(load.run, rank, load.ranks, pattern)
    else:
        plain = load.template(rank)
        build = lambda seq, _storm, _intervals: plain(seq)  # noqa: E731
    head = load.head(rank)
    hard_stop = start + seconds + grace
    seq = slot = 0
    last_slot = -1
    senders = load.senders

    async def exchange(body: bytes) -> dict[int, int]:
        nonlocal reader, writer
        try:
            return await _exchange(reader, writer, head, body)
        except (ConnectionError, asyncio.IncompleteReadError, RuntimeError):  # RuntimeError: uvloop, closed before
            # The server closed the idle kept-alive connection: reconnect and send again, as an agent does.
            writer.close()
            tally.reconnects += 1
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                return await _exchange(reader, writer, head, body)
            except (OSError, asyncio.IncompleteReadError):
                return {0: 1}  # refused or reset again: a failed send (status 0), tried again at the next slot
    try:
        while (due := start + (rank / senders + slot) * interval) < start + seconds:  # spread over each interval
            now = time.perf_counter()
            if now - due >= interval:
                # A whole interval behind: skip to the current slot, as an agent sends its latest state, not a backlog.
                behind = int((now - due) / interval)
                slot += behind
                tally.missed += behind
                continue
            if due > now:
                await asyncio.sleep(due - now)
            seq += 1
            slot += 1
            in_storm = storm is not None and storm[0] <= due < storm[1]
            body = build(seq, in_storm, slot - 1 - last_slot)  # training went on through the missed slots
            last_slot = slot - 1
            sent = time.perf_counter()
            try:
                statuses = await asyncio.wait_for(exchange(body), max(0.001, hard_stop - sent))
            except asyncio.TimeoutError:
                tally.unanswered += 1
                tally.timeouts += 1
                tally.latency.append(hard_stop - sent)  # censored: at least this long
                return
            done = time.perf_counter()
            tally.first_send = min(tally.first_send, sent)
            tally.last_answer = max(tally.last_answer, done)
            tally.latency_all.append(done - sent)
            tally.timeouts += done - sent > AGENT_TIMEOUT_S
            if in_storm:
                tally.latency_storm.append(done - sent)
            if seq > 2:
                tally.latency.append(done - sent)
                tally.lag.append(max(0.0, sent - due))
            tally.count(statuses)
    finally:
        writer.close()


async def saturating_connection(load: Load, port: int, senders: list[int], until: float, grace: float,
                                tally: Tally) -> None:
    """Send the updates of ``senders`` back to back on one connection until ``until`` (``perf_counter``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    builders = {r: (load.template(r), load.head(r)) for r in senders}
    seq = 0
    try:
        while time.perf_counter() < until:
            seq += 1
            for r in senders:  # back to back: the next request goes as soon as the answer is in
                build, head = builders[r]
                sent = time.perf_counter()
                try:
                    statuses = await asyncio.wait_for(_exchange(reader, writer, head, build(seq)),
                                                      max(0.001, until + grace - sent))
                except asyncio.TimeoutError:
                    tally.unanswered += 1
                    return
                done = time.perf_counter()
                tally.first_send = min(tally.first_send, sent)
                tally.last_answer = max(tally.last_answer, done)
                tally.latency.append(done - sent)
                tally.latency_all.append(done - sent)
                tally.count(statuses)
                if done >= until:
                    break
    finally:
        writer.close()
