"""Simulated ranks of one big job (its own process): each sends when the agent's own schedule says.

Every rank trains at one iteration per ``--iteration-s`` (its own phase) and posts protocol v1
batches with the cumulative state and the events the real recorder emits for it: a storm rank
runs skip streaks (a skip and a backoff per skipped iteration, ``streak_end`` after) from
``--storm-at``. When a batch goes is decided by :class:`ampwatch.agent._schedule.PushSchedule`
and ``is_news``, the agent's own code, with the settings of ``--delivery``:

- ``before``: today's delivery up to issue 18: the full state every second, a streak's first
  skip at once (50 ms apart at most);
- ``after``: the agent's defaults: news soon (coalesced per ``NEWS_GAP``), a heartbeat every
  ``AMPWATCH_PUSH_INTERVAL``.

How a batch reaches the collector is a *transport* (:data:`TRANSPORTS`): ``per-rank`` (one
keep-alive connection and one request per batch, protocol v1, as the agent does) or
``node-relay`` (the opt-in node relay: the node's ranks' batches gathered into one protocol v2
request, each rank answered its part). A transport is a class built with ``(port, node)`` whose
``async post(rank, body) -> Answer`` is awaited by each of the node's 8 ranks.

Prints one JSON line when ready (``{"t0": ...}``: the wall-clock start of the timeline), then
writes the results to ``--out`` at the end: latencies, lateness, failures, bytes, and per storm
rank the skip times and the answers, for ``bench.fleet`` to check against scrapes and alerts.

    python -m bench._fleet_ranks --port P --ranks 16384 --delivery after --seconds 90 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import sys
import time
import uuid
from typing import Callable, Optional

from ampwatch.agent._schedule import NEWS_GAP, NEWS_HOLD, PushSchedule, is_news
from ampwatch.contract.node_batch import encode_node_batch
from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S

__all__ = ["DELIVERIES", "TRANSPORTS", "main"]

RANKS_PER_NODE = 8
AGENT_TIMEOUT_S = 5.0  # the agent's default AMPWATCH_TIMEOUT: no answer by then is a failed attempt
IDLE_CLOSE_S = 4.0  # uvicorn closes a kept-alive connection idle for 5 s: reconnect before, as the agent must
PARAM = [{"name": "decoder.layers.11.mlp.fc2.weight", "inf": 3, "nan": 0}]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery policy: the schedule's settings and what counts as news."""

    heartbeat: float
    news_gap: float
    news_hold: float
    news: Callable[[dict], bool]
    spread: bool  # whether the ranks of a job spread their first batches and news (PushSchedule's ranks=)


DELIVERIES = {
    # Up to issue 18 the sender built a batch every push interval (1 s) and, on the recorder's wake at a
    # streak's first skip, at most 50 ms after the previous one (_WAKE_GAP); nothing else woke it.
    "before": Delivery(1.0, 0.05, 0.0, lambda e: e["kind"] == "skip" and e["streak"] == 1, spread=False),
    "after": Delivery(float(HEARTBEAT_INTERVAL_S), NEWS_GAP, NEWS_HOLD, is_news, spread=True),
}


# ----- what a simulated rank does -------------------------------------------------------------------

class Plan:
    """One rank's training: iteration ``i`` ends at ``start + i * period``; skip streaks ``(first, length)``."""

    def __init__(self, start: float, period: float, streaks: list[tuple[int, int]]) -> None:
        self.start, self.period, self.streaks = start, period, streaks
        self.events = self._events()

    def iteration_at(self, t: float) -> int:
        """Iterations finished by wall time ``t``."""
        return max(0, int((t - self.start) / self.period + 1e-9))

    def time_of(self, iteration: int) -> float:
        """Wall time iteration ``iteration`` (1-based) ends, when its skip and events happen."""
        return self.start + iteration * self.period

    def _events(self) -> list[tuple[int, dict]]:
        """Every event of the plan with the iteration it happens in, as the recorder emits them."""
        out: list[tuple[int, dict]] = []
        scale = 65536.0
        for first, length in self.streaks:
            for k in range(1, length + 1):
                it = first + k - 1
                rung = k & (k - 1) == 0
                out.append((it, {"kind": "skip", "iteration": it, "optimizer": "gen", "streak": k,
                                 "params": PARAM if rung else [], "params_total": 1 if rung else None,
                                 "inspected": rung}))
                out.append((it, {"kind": "scale_change", "iteration": it, "cause": "backoff", "before": scale,
                                 "after": scale / 2}))
                scale /= 2
            out.append((first + length, {"kind": "streak_end", "optimizer": "gen", "iteration": first + length,
                                         "start_iteration": first, "length": length}))
        return out

    def state(self, iteration: int) -> tuple[dict, int, float]:
        """Return the ``gen`` optimizer's counters, the backoffs and the scale after ``iteration``."""
        skipped = consecutive = longest = streaks = 0
        reached: dict[str, int] = {}
        for first, length in self.streaks:
            if first > iteration:
                break
            done = min(length, iteration - first + 1)
            skipped += done
            streaks += 1
            longest = max(longest, done)
            consecutive = done if first + length > iteration else 0
            n = 1
            while n <= done and n <= 1024:
                reached[str(n)] = reached.get(str(n), 0) + 1
                n *= 2
        gen = {"steps": iteration - skipped, "skipped": skipped, "consecutive_skipped": consecutive,
               "longest_streak": longest, "streaks": streaks, "streaks_reached": reached,
               "scheduler_steps_after_skip": 0, "poisoned_steps": 0}
        return gen, skipped, 65536.0 * 0.5 ** skipped


def storm_streaks(rng: random.Random, first: int, until: int) -> list[tuple[int, int]]:
    """Streaks from iteration ``first``: one of 20 (it reaches the streak alert's 16), then short ones."""
    streaks, it, length = [], first, 20
    while it + length < until:
        streaks.append((it, length))
        it += length + rng.randint(2, 8)
        length = rng.choice((1, 1, 2, 3, 5, 8))
    return streaks


# ----- transports -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Answer:
    """One attempt's outcome: HTTP status (None: no answer in time) and bytes both ways."""

    status: Optional[int]
    sent_bytes: int
    received_bytes: int


class _KeptAlive:
    """Kept-alive HTTP connections to the collector, one per key, each from the node's own address."""

    def __init__(self, port: int, node: int) -> None:
        self.port = port
        self.source = node_address(node)
        self._conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = {}
        self.exchanges: list[tuple[float, float]] = []  # (sent, seconds) of every HTTP request that got an answer

    async def _exchange(self, key: int, body: bytes) -> tuple[Optional[int], int, int, bytes]:
        """POST ``body`` on connection ``key``: (status or None, bytes sent, bytes received, answer body).

        Reconnects (once) if the collector closed an idle kept-alive connection.
        """
        head = b"POST /v1/ingest HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n" \
               b"Content-Length: %d\r\n\r\n" % len(body)
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
                writer.write(head + body)
                status, received, answer = await _answer(reader)
            except asyncio.CancelledError:  # the agent's timeout: this connection is in an unknown state
                if writer is not None:
                    writer.close()
                raise
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                if writer is not None:
                    writer.close()
                if attempt == 0 and conn is not None:
                    continue  # a closed kept-alive connection is not an outage: once more on a new one
                return None, len(head) + len(body), 0, b""
            self._conns[key] = (reader, writer, time.monotonic())
            self.exchanges.append((sent, time.time() - sent))
            return status, len(head) + len(body), received, answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        for _, writer, _ in self._conns.values():
            writer.close()


class PerRankTransport(_KeptAlive):
    """One kept-alive connection per rank, one request per batch (protocol v1): what the agent does."""

    async def post(self, rank: int, body: bytes) -> Answer:
        """POST ``body`` for ``rank`` on its own connection."""
        status, sent, received, _ = await self._exchange(rank, body)
        return Answer(status, sent, received)


class NodeRelayTransport(_KeptAlive):
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
        self._pump: Optional[asyncio.Task] = None

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
            for (_, _, answer), result in zip(batch, results):
                if not answer.done():
                    answer.set_result(Answer(result, sent // len(batch), received // len(batch)))

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        super().close()


def _node_results(status: Optional[int], text: bytes, count: int) -> list[Optional[int]]:
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


def node_address(node: int) -> str:
    """Return the loopback address node ``node`` connects from, as if it were its own host.

    From one address, 16,384 ranks reconnecting every heartbeat (the collector closes idle
    kept-alive connections after 5 s) would run out of the 4-tuples that TIME_WAIT holds for
    60 s, and connections would stall: an artefact of loopback that 2,048 real hosts never see.
    """
    return f"127.1.{node // 250}.{node % 250 + 1}"


TRANSPORTS: dict[str, Callable[[int, int], _KeptAlive]] = {"per-rank": PerRankTransport,
                                                            "node-relay": NodeRelayTransport}
"""Delivery modes by name: ``factory(port, node)`` for each node of 8 ranks."""


async def _answer(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """Read one HTTP answer: (status, bytes received, body)."""
    line = await reader.readline()
    status, received, length = int(line.split(b" ")[1]), len(line), 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        received += len(line)
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    body = await reader.readexactly(length) if length else b""
    return status, received + 2 + length, body


# ----- one rank -------------------------------------------------------------------------------------

class Tally:
    """What every rank saw, by phase (``warm``, ``healthy``, ``storm``)."""

    def __init__(self, phases: dict[str, tuple[float, float]]) -> None:
        self.phases = phases
        self.latency: dict[str, list[tuple[float, float]]] = {p: [] for p in phases}  # (sent, seconds)
        self.late: dict[str, list[float]] = {p: [] for p in phases}  # send start minus when it was due
        self.requests = {p: 0 for p in phases}
        self.bytes = {p: 0 for p in phases}
        self.refused: dict[str, int] = {}  # answers other than 2xx, by status
        self.timeouts = 0
        self.missed = 0  # batches sent a whole heartbeat or more after they were due
        self.storm: dict[int, dict] = {}  # per storm rank: streak starts, rung-16 time, answers
        self.killed_last_ack: Optional[float] = None  # when the killed rank's last batch was answered

    def phase(self, t: float) -> Optional[str]:
        for name, (a, b) in self.phases.items():
            if a <= t < b:
                return name
        return None


async def _rank(rank: int, plan: Plan, delivery: Delivery, transport: _KeptAlive, run: str, world: int,
                end: float, kill_at: Optional[float], tally: Tally) -> None:
    schedule = PushSchedule(delivery.heartbeat, delivery.news_gap, delivery.news_hold,
                            ranks=world if delivery.spread else 1, rng=random.Random(rank))
    incarnation, seq, sent_it, event_id = uuid.uuid4().hex, 0, 0, 0
    head = json.dumps({"protocol": 1, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": run, "rank": rank,
                       "world_size": world, "local_rank": rank % RANKS_PER_NODE,
                       "host": f"node-{rank // RANKS_PER_NODE}", "pid": 1000 + rank,
                       "incarnation": incarnation})[:-1]
    scaler = {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
              "backoff_factor": 0.5, "growth_interval": 2000}
    delivery_counters = {"dropped_events": 0, "send_failures": 0, "rejected_batches": 0, "agent_errors": 0}
    disc = {"steps": 0, "skipped": 0, "consecutive_skipped": 0, "longest_streak": 0, "streaks": 0,
            "streaks_reached": {}, "scheduler_steps_after_skip": 0, "poisoned_steps": 0}
    news_times = [plan.time_of(it) for it, e in plan.events if delivery.news(e)]
    news_iterations = [it for it, e in plan.events if delivery.news(e)]
    storm = tally.storm.get(rank)
    first_contact = True
    await asyncio.sleep(max(0.0, plan.start - time.time()))  # the rank calls watch()
    schedule.begin(time.time())
    while True:
        now = time.time()
        if now >= end or (kill_at is not None and now >= kill_at):
            return  # the end of the bench, or SIGKILL: no close
        pending = [t for t, it in zip(news_times, news_iterations) if it > sent_it]
        if pending and pending[0] <= now:
            schedule.news(pending[0])  # the agent notes news when the recorder appends it
        due = schedule.due()
        wake = min(due, pending[0]) if pending and pending[0] > now else due
        if wake > now:
            await asyncio.sleep(min(wake, end) - now)
            continue
        iteration = plan.iteration_at(now)
        events = []
        for it, event in plan.events:
            if sent_it < it <= iteration:
                event_id += 1
                events.append(dict(event, id=event_id, time=plan.time_of(it)))
        gen, backoffs, scale = plan.state(iteration)
        seq += 1
        rest = {"seq": seq, "sent_at": now, "scaler": scaler,
                "state": {"iteration": iteration, "loss_scale": scale, "backoffs": backoffs, "growths": 0,
                          "manual_sets": 0, "optimizers": {"gen": gen, "disc": dict(disc, steps=iteration)},
                          "delivery": delivery_counters},
                "events": events, "closed": False}
        body = (head + ", " + json.dumps(rest)[1:]).encode()
        schedule.built(now)
        late = now - due
        if late >= delivery.heartbeat:
            tally.missed += 1
        backoff = 1.0
        while True:  # the agent's retry: the very same batch, with backoff, until it is acknowledged
            sent = time.time()
            try:
                answer = await asyncio.wait_for(transport.post(rank, body), AGENT_TIMEOUT_S)
            except asyncio.TimeoutError:
                answer = Answer(None, len(body), 0)
                tally.timeouts += 1
            done = time.time()
            phase = tally.phase(sent)
            if phase is not None:
                tally.requests[phase] += 1
                tally.bytes[phase] += answer.sent_bytes + answer.received_bytes
                if not first_contact and answer.status is not None:
                    tally.latency[phase].append((round(sent, 4), round(done - sent, 5)))
                    tally.late[phase].append(max(0.0, late))
            first_contact = False
            if answer.status is not None and 200 <= answer.status < 300:
                break
            if answer.status is not None:
                tally.refused[str(answer.status)] = tally.refused.get(str(answer.status), 0) + 1
            if done >= end:
                return
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(30.0, backoff * 2)
        sent_it = iteration
        if kill_at is not None:
            tally.killed_last_ack = done
        if storm is not None:
            storm["answers"].append((round(done, 4), gen["skipped"]))


async def _run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    delivery = DELIVERIES[args.delivery]
    if args.heartbeat:
        delivery = dataclasses.replace(delivery, heartbeat=args.heartbeat)
    t0 = time.time() + 1.0
    warm_end = t0 + args.warm
    storm_at = warm_end + args.healthy
    end = storm_at + args.storm
    phases = {"warm": (t0, warm_end), "healthy": (warm_end, storm_at), "storm": (storm_at, end)}
    tally = Tally(phases)
    storm_ranks = set(rng.sample(range(args.ranks), int(args.ranks * args.storm_share)))
    storm_ranks.discard(args.kill_rank)
    plans = []
    for rank in range(args.ranks):
        start = t0 + rng.uniform(0, 1.0)  # a job's ranks call watch() within a second of each other
        plan = Plan(start, args.iteration_s, [])
        if rank in storm_ranks:
            first = plan.iteration_at(storm_at) + 1 + rng.randint(0, 4)
            plan = Plan(start, args.iteration_s, storm_streaks(rng, first, plan.iteration_at(end) - 2))
            starts, before = [], 0
            for first_it, length in plan.streaks:  # (time of the streak's first skip, skipped counts with it)
                starts.append((round(plan.time_of(first_it), 4), before + 1))
                before += length
            tally.storm[rank] = {"starts": starts, "answers": [],
                                 "rung16": round(plan.time_of(plan.streaks[0][0] + 15), 4)
                                 if plan.streaks and plan.streaks[0][1] >= 16 else None}
        plans.append(plan)
    transports = [TRANSPORTS[args.transport](args.port, node)
                  for node in range((args.ranks + RANKS_PER_NODE - 1) // RANKS_PER_NODE)]
    print(json.dumps({"t0": t0, "warm_end": warm_end, "storm_at": storm_at, "end": end}), flush=True)
    # The plans and tallies of 16,384 ranks are a large heap: without this the generator's own full
    # collections stall every rank's sends for hundreds of ms, which would show as collector latency.
    gc.freeze()
    gc.set_threshold(50_000, 50, 1_000)
    cpu0 = time.process_time()
    await asyncio.gather(*(_rank(r, plans[r], delivery, transports[r // RANKS_PER_NODE], args.run, args.ranks,
                                 end, warm_end + args.kill_after if r == args.kill_rank else None, tally)
                           for r in range(args.ranks)))
    http: dict[str, list[float]] = {p: [] for p in phases}  # HTTP request latency, whoever sent it
    for transport in transports:
        transport.close()
        for sent, seconds in transport.exchanges:
            phase = tally.phase(sent)
            if phase is not None:
                http[phase].append(round(seconds, 5))
    return {"delivery": args.delivery, "transport": args.transport, "ranks": args.ranks, "phases": phases,
            "killed": {"rank": args.kill_rank, "at": warm_end + args.kill_after} if args.kill_rank >= 0 else None,
            "latency": tally.latency, "http_latency": http, "late": tally.late, "requests": tally.requests, "bytes": tally.bytes,
            "refused": tally.refused, "timeouts": tally.timeouts, "missed": tally.missed,
            "killed_last_ack": tally.killed_last_ack,
            "storm": {str(r): v for r, v in tally.storm.items()},
            "generator_cpu_s": round(time.process_time() - cpu0, 2)}


def main(argv: list[str] | None = None) -> int:
    """Run the simulated job; write its results as JSON to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench._fleet_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--delivery", choices=sorted(DELIVERIES), required=True)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="per-rank")
    parser.add_argument("--heartbeat", type=float, default=None, help="another push interval for this delivery")
    parser.add_argument("--run", default="fleet")
    parser.add_argument("--warm", type=float, required=True, help="seconds for every rank to start")
    parser.add_argument("--healthy", type=float, required=True, help="seconds of healthy training, measured")
    parser.add_argument("--storm", type=float, required=True, help="seconds with --storm-share ranks skipping")
    parser.add_argument("--storm-share", type=float, default=0.1)
    parser.add_argument("--iteration-s", type=float, default=1.0)
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank stops without closing, --kill-after")
    parser.add_argument("--kill-after", type=float, default=0.0, help="seconds into the healthy phase")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection per rank
    except (ImportError, ValueError, OSError):
        pass
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    result = runner(_run(args))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
