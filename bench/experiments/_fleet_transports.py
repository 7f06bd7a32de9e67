"""How a simulated rank's batch reaches the collector in ``bench.experiments._fleet_ranks``: :data:`TRANSPORTS`.

``per-rank``: one keep-alive connection and one request per batch (protocol v1), as the agent
does. ``node-relay``: the opt-in node relay, the node's ranks' batches gathered into one
protocol v2 request, each rank answered its part. A transport is built with ``(port, node)``
and its ``async post(rank, body) -> Answer`` is awaited by each of the node's ranks; it also
keeps every HTTP request's latency (``exchanges``), whoever sent it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable

from ampwatch.contract.node_batch import encode_node_batch
from ampwatch.contract.protocol import KEEP_ALIVE_S
from bench._async_http import INGEST_HEAD, read_answer, request

__all__ = ["Answer", "KeptAlive", "NodeRelayTransport", "PerRankTransport", "TRANSPORTS", "node_address"]

# the collector closes a connection idle that long: reconnect before, as the agent must
IDLE_CLOSE_S = KEEP_ALIVE_S - 1.0


@dataclasses.dataclass
class Answer:
    """One attempt's outcome: HTTP status (None: no answer in time) and bytes both ways."""

    status: int | None
    sent_bytes: int
    received_bytes: int


def node_address(node: int) -> str:
    """Return the loopback address node ``node`` connects from, as if it were its own host.

    From one address, 16,384 ranks reconnecting (the *before* side's collector closed idle
    kept-alive connections after 5 s, so every heartbeat reconnected) would run out of the 4-tuples
    that TIME_WAIT holds for 60 s, and connections would stall: an artefact of loopback that 2,048
    real hosts never see.
    """
    return f"127.1.{node // 250}.{node % 250 + 1}"


class KeptAlive:
    """Kept-alive HTTP connections to the collector, one per key, each from the node's own address."""

    def __init__(self, port: int, node: int) -> None:
        self.port = port
        self.source = node_address(node)
        self._conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = {}
        self.exchanges: list[tuple[float, float]] = []  # (sent, seconds) of every HTTP request that got an answer

    async def post(self, rank: int, body: bytes) -> Answer:
        """Deliver ``body``, ``rank``'s batch; return what became of it."""
        raise NotImplementedError

    async def _exchange(self, key: int, body: bytes) -> tuple[int | None, int, int, bytes]:
        """POST ``body`` on connection ``key``: (status or None, bytes sent, bytes received, answer body).

        Reconnects (once) if the collector closed an idle kept-alive connection.
        """
        message = request(INGEST_HEAD, body)
        sent = time.time()
        for attempt in (0, 1):
            conn = self._conns.pop(key, None)
            if conn is not None and time.monotonic() - conn[2] > IDLE_CLOSE_S:
                conn[1].close()
                conn = None
            writer = None
            try:
                if conn is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                                   local_addr=(self.source, 0))
                else:
                    reader, writer, _ = conn
                writer.write(message)
                status, received, answer = await read_answer(reader)
            except asyncio.CancelledError:  # the agent's timeout: this connection is in an unknown state
                if writer is not None:
                    writer.close()
                raise
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                if writer is not None:
                    writer.close()
                if attempt == 0 and conn is not None:
                    continue  # a closed kept-alive connection is not an outage: once more on a new one
                return None, len(message), 0, b""
            self._conns[key] = (reader, writer, time.monotonic())
            self.exchanges.append((sent, time.time() - sent))
            return status, len(message), received, answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        for _, writer, _ in self._conns.values():
            writer.close()


class PerRankTransport(KeptAlive):
    """One kept-alive connection per rank, one request per batch (protocol v1): what the agent does."""

    async def post(self, rank: int, body: bytes) -> Answer:
        """POST ``body`` for ``rank`` on its own connection."""
        status, sent, received, _ = await self._exchange(rank, body)
        return Answer(status, sent, received)


class NodeRelayTransport(KeptAlive):
    """The node relay (agent/_relay.py) as the bench runs it: one protocol v2 request per node.

    A rank's batch waits until every rank of the node that has posted so far has one waiting,
    or until its hold ends (news 0.2 s, counters only 1 s: ``relay_wait`` at the default
    push interval), then the waiting batches go as one v2 body on one kept-alive connection,
    one request at a time as the relay's single thread does; each rank gets its own result
    and its share of the request's bytes. A rank whose wait times out (the agent's timeout)
    leaves the queue and posts the same batch again, as the agent's retry does.
    """

    NEWS_HOLD_S = 0.2
    COUNTERS_HOLD_S = 1.0

    def __init__(self, port: int, node: int) -> None:
        super().__init__(port, node)
        self._members: set[int] = set()  # ranks that have posted through this relay (connected)
        self._waiting: dict[int, tuple[bytes, float, asyncio.Future]] = {}  # rank -> (body, due, answer)
        self._arrived = asyncio.Event()
        self._pump: asyncio.Task | None = None

    async def post(self, rank: int, body: bytes) -> Answer:
        """Hand ``body`` to the relay; return this rank's part of the node request's answer."""
        news = b'"events": []' not in body or b'"closed": true' in body  # the bench's json.dumps layout
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._members.add(rank)
        self._waiting[rank] = (body, time.monotonic() + (self.NEWS_HOLD_S if news else self.COUNTERS_HOLD_S),
                               answer)
        self._arrived.set()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        try:
            return await answer
        finally:
            if self._waiting.get(rank, (None, None, None))[2] is answer:
                del self._waiting[rank]  # timed out before it went: out of the queue

    async def _run(self) -> None:
        """Post while batches wait: when every member has one waiting, or the first one's hold ends."""
        while self._waiting:
            self._arrived.clear()
            due = min(d for _, d, _ in self._waiting.values())
            if len(self._waiting) < len(self._members) and due > time.monotonic():
                try:
                    await asyncio.wait_for(self._arrived.wait(), due - time.monotonic())
                except asyncio.TimeoutError:
                    pass
                continue
            ranks = sorted(self._waiting)
            batch = [self._waiting.pop(r) for r in ranks]
            status, sent, received, text = await self._exchange(0, encode_node_batch([b for b, _, _ in batch]))
            results = _node_results(status, text, len(batch))
            for (_, _, answer), result in zip(batch, results, strict=True):
                if not answer.done():
                    answer.set_result(Answer(result, sent // len(batch), received // len(batch)))

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        super().close()


def _node_results(status: int | None, text: bytes, count: int) -> list[int | None]:
    """Each rank's status from a v2 answer (the whole request's status when it has no per-rank results)."""
    if status == 200:
        try:
            results = json.loads(text)["results"]
            if len(results) == count:
                return [int(r["status"]) for r in results]
        except (ValueError, KeyError, TypeError):
            pass
        return [502] * count  # a malformed v2 answer: as the relay's _rank_answer says
    return [status] * count


TRANSPORTS: dict[str, Callable[[int, int], KeptAlive]] = {"per-rank": PerRankTransport,
                                                           "node-relay": NodeRelayTransport}
"""Delivery modes by name: ``factory(port, node)`` for each node of 8 ranks."""
