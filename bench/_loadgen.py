"""Bounded load generator (its own process): N simulated ranks push one update each per interval.

The same generator drives the ampwatch collector (``POST /v1/ingest``, a protocol v1 batch per rank; or,
as target ``ampwatch-node``, one protocol v2 batch per simulated node of ``--per-node`` ranks, as a node
relay posts) and the Prometheus Pushgateway (``PUT /metrics/job/<run>/rank/<rank>``, the same counters in
the text format). ``answered`` always counts rank updates, whatever carried them.
Each rank keeps one keep-alive connection and sends one request at a time, as an agent does; latency
is from send to the full answer. Bodies are built from a template so the generator stays cheap, and it
reports how late its own sends were (``lag``) and its own CPU, so a slow generator shows up as such.

    python -m bench._loadgen --target ampwatch --port P --ranks 1024 --seconds 10
    python -m bench._loadgen --target pushgateway --port P --ranks 1024 --seconds 10 --saturate 32
    python -m bench._loadgen --target ampwatch-node --per-node 8 --port P --ranks 1024 --seconds 10
    python -m bench._loadgen --target ampwatch --port P --ranks 1024 --seconds 90 --interval 2 \\
        --storm 20,60 --pattern streaks     # a whole-job skip storm from 20 s to 80 s (bench/_storm.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Callable, Optional

from bench._storm import PATTERNS, StormRank

from ampwatch.contract.node_batch import encode_node_batch

__all__ = ["ampwatch_body", "ampwatch_node_template", "pushgateway_body", "run", "main"]

SKIP_EVERY = 50  # default: one skip and one backoff every 50th update: realistic, and it exercises the event path
PER_NODE = 8  # default: ranks per simulated node (target ampwatch-node)
_OPT = ("gen", "disc")
_every = [SKIP_EVERY]  # this process's event rate (set from --skip-every)
_per_node = [PER_NODE]  # this process's ranks per node (set from --per-node)


def _counters(seq: int, every: int) -> dict:
    skips = seq // every
    return {"seq": seq, "iteration": seq * 10, "steps": seq - skips, "skips": skips, "backoffs": skips}


_SCALER = {"enabled": True, "kind": "GradScaler", "init_scale": 65536.0, "growth_factor": 2.0,
           "backoff_factor": 0.5, "growth_interval": 2000}


def _identity(run: str, rank: int, ranks: int) -> str:
    """The start of a rank's batches (identity of a fresh incarnation), open for the rest of the object."""
    head = {"protocol": 1, "agent": {"version": "0.1.0", "torch": "2.13.0"}, "run": run, "rank": rank,
            "world_size": ranks, "local_rank": rank % 8, "host": f"node-{rank // 8}", "pid": 1000 + rank,
            "incarnation": uuid.uuid4().hex}
    return json.dumps(head)[:-1]


def ampwatch_template(run: str, rank: int, ranks: int, every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body`` of a protocol v1 batch for one rank (two optimizers)."""
    prefix = _identity(run, rank, ranks)
    delivery = {"dropped_events": 0, "send_failures": 0, "rejected_batches": 0, "agent_errors": 0}

    def body(seq: int) -> bytes:
        c = _counters(seq, every)
        skips, now = c["skips"], time.time()
        gen = {"steps": c["steps"], "skipped": skips, "consecutive_skipped": 0, "longest_streak": min(skips, 1),
               "streaks": skips, "streaks_reached": {"1": skips} if skips else {}, "scheduler_steps_after_skip": 0,
               "poisoned_steps": 0}
        events = []
        if seq % every == 0:
            events = [{"id": 2 * skips - 1, "kind": "skip", "time": now, "iteration": seq, "optimizer": "gen",
                       "streak": 1, "params": [{"name": "decoder.layers.11.mlp.fc2.weight", "inf": 3, "nan": 0}],
                       "params_total": 1, "inspected": True},
                      {"id": 2 * skips, "kind": "scale_change", "time": now, "iteration": seq, "cause": "backoff",
                       "before": 65536.0, "after": 32768.0}]
        rest = {"seq": seq, "sent_at": now, "scaler": _SCALER,
                "state": {"iteration": c["iteration"], "loss_scale": 32768.0, "backoffs": skips, "growths": 0,
                          "manual_sets": 0,
                          "optimizers": {"gen": gen, "disc": dict(gen, skipped=0, streaks=0, streaks_reached={})},
                          "delivery": delivery},
                "events": events, "closed": False}
        return (prefix + ", " + json.dumps(rest)[1:]).encode()
    return body


def ampwatch_node_template(run: str, node: int, ranks: int, per_node: int = PER_NODE,
                           every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body`` of a protocol v2 batch: ranks ``node * per_node ...`` of a ``ranks``-rank job at ``seq``.

    What a node relay posts when every rank of the node has a batch waiting (docs/protocol.md, v2).
    """
    members = [ampwatch_template(run, rank, ranks, every)
               for rank in range(node * per_node, min(ranks, (node + 1) * per_node))]
    return lambda seq: encode_node_batch([build(seq) for build in members])


def storm_template(run: str, rank: int, ranks: int, pattern: str) -> Callable[[int, bool, int], bytes]:
    """Return ``(seq, storm, intervals) -> body``: a batch of a rank with two optimizers covering ``intervals``
    push intervals of training (more than 1 after missed slots), skipping on all of them in a storm."""
    prefix = _identity(run, rank, ranks)
    model = StormRank(pattern)

    def body(seq: int, storm: bool, intervals: int = 1) -> bytes:
        events = model.push(storm, intervals)
        rest = {"seq": seq, "sent_at": time.time(), "scaler": _SCALER, "state": model.state(), "events": events,
                "closed": False}
        return (prefix + ", " + json.dumps(rest)[1:]).encode()
    return body


def pushgateway_template(run: str, rank: int, ranks: int, every: int = SKIP_EVERY) -> Callable[[int], bytes]:
    """Return ``seq -> body``: the same counters as the batch, as a Pushgateway group in the text format."""
    def body(seq: int) -> bytes:
        c = _counters(seq, every)
        skips = c["skips"]
        per_opt = {"gen": (c["steps"], skips, skips), "disc": (c["steps"], 0, 0)}
        lines = []
        for name, kind, index in (("ampwatch_optimizer_steps_total", "counter", 0),
                                  ("ampwatch_optimizer_skipped_steps_total", "counter", 1),
                                  ("ampwatch_optimizer_skip_streaks_total", "counter", 2)):
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f'{name}{{optimizer="{o}"}} {v[index]}' for o, v in per_opt.items())
        lines.append("# TYPE ampwatch_optimizer_consecutive_skipped_steps gauge")
        lines.extend(f'ampwatch_optimizer_consecutive_skipped_steps{{optimizer="{o}"}} 0' for o in _OPT)
        lines.append("# TYPE ampwatch_optimizer_longest_skip_streak gauge")
        lines.extend(f'ampwatch_optimizer_longest_skip_streak{{optimizer="{o}"}} {min(skips, 1) if o == "gen" else 0}'
                     for o in _OPT)
        for name, kind, value in (("ampwatch_loss_scale", "gauge", 32768.0),
                                  ("ampwatch_loss_scale_backoffs_total", "counter", skips),
                                  ("ampwatch_loss_scale_growths_total", "counter", 0),
                                  ("ampwatch_iteration", "gauge", c["iteration"])):
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {value}")
        return ("\n".join(lines) + "\n").encode()
    return body


def ampwatch_body(run: str, rank: int, ranks: int, seq: int) -> bytes:
    """One protocol v1 batch (for tests and one-off use)."""
    return ampwatch_template(run, rank, ranks)(seq)


def pushgateway_body(run: str, rank: int, ranks: int, seq: int) -> bytes:
    """One Pushgateway group body (for tests and one-off use)."""
    return pushgateway_template(run, rank, ranks)(seq)


def _template(target: str, run: str, index: int, ranks: int) -> Callable[[int], bytes]:
    """Return ``seq -> body`` for sender ``index`` (a rank, or a node for ``ampwatch-node``)."""
    if target == "ampwatch-node":
        return ampwatch_node_template(run, index, ranks, _per_node[0], _every[0])
    return (ampwatch_template if target == "ampwatch" else pushgateway_template)(run, index, ranks, _every[0])


def _senders(target: str, ranks: int) -> int:
    """Return how many senders carry ``ranks`` ranks: one per rank, or one per node."""
    return -(-ranks // _per_node[0]) if target == "ampwatch-node" else ranks


def _request(target: str, run: str, rank: int) -> bytes:
    if target.startswith("ampwatch"):
        return b"POST /v1/ingest HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    return (f"PUT /metrics/job/{run}/rank/{rank} HTTP/1.1\r\nHost: bench\r\n"
            f"Content-Type: text/plain; version=0.0.4\r\n").encode()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                    body: bytes) -> dict[int, int]:
    """Send one request; return ``{status: rank updates}`` (a v2 answer's per-rank statuses, else the HTTP one)."""
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    line = await reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    status = int(line.split(b" ")[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    answer = await reader.readexactly(length) if length else b""
    if status == 200 and answer.startswith(b'{"protocol": 2'):
        statuses: dict[int, int] = {}
        for result in json.loads(answer)["results"]:
            statuses[result["status"]] = statuses.get(result["status"], 0) + 1
        return statuses
    return {status: 1}


def _count(tally: "_Tally", statuses: dict[int, int]) -> None:
    tally.requests += 1
    for status, updates in statuses.items():
        if 200 <= status < 300:
            tally.answered += updates
        else:
            tally.failures[status] = tally.failures.get(status, 0) + updates


class _Tally:
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


AGENT_TIMEOUT_S = 2.0  # the agent's default AMPWATCH_TIMEOUT: a slower answer is a failed send, retried


async def _paced_rank(target: str, port: int, run: str, rank: int, ranks: int, start: float, seconds: int,
                      grace: float, tally: _Tally, interval: float = 1.0,
                      storm: Optional[tuple[float, float]] = None, pattern: str = "streaks") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if storm is not None:
        build = storm_template(run, rank, ranks, pattern)
    else:
        plain = _template(target, run, rank, ranks)
        build = lambda seq, _storm, _intervals: plain(seq)  # noqa: E731
    head = _request(target, run, rank)
    hard_stop = start + seconds + grace
    seq = slot = 0
    last_slot = -1
    senders = _senders(target, ranks)

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
            _count(tally, statuses)
    finally:
        writer.close()


async def _saturating_connection(target: str, port: int, run: str, ranks: list[int], world: int, until: float,
                                 grace: float, tally: _Tally) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    builders = {r: (_template(target, run, r, world), _request(target, run, r)) for r in ranks}
    seq = 0
    try:
        while time.perf_counter() < until:
            seq += 1
            for r in ranks:  # back to back: the next request goes as soon as the answer is in
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
                _count(tally, statuses)
                if done >= until:
                    break
    finally:
        writer.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(target: str, port: int, ranks: int, seconds: int, saturate: int, grace: float,
               interval: float = 1.0, storm: Optional[tuple[float, float]] = None, pattern: str = "streaks") -> dict:
    tally = _Tally()
    window = None
    run = f"bench-{ranks}"
    cpu0 = time.process_time()
    if saturate:
        until = time.perf_counter() + seconds
        senders = _senders(target, ranks)
        groups = [list(range(c, senders, saturate)) for c in range(min(saturate, senders))]
        await asyncio.gather(*(_saturating_connection(target, port, run, g, ranks, until, grace, tally)
                               for g in groups))
    else:
        start = time.perf_counter() + 0.5
        if storm is not None:
            window = (start + storm[0], start + storm[0] + storm[1])
        await asyncio.gather(*(_paced_rank(target, port, run, r, ranks, start, seconds, grace, tally, interval,
                                           window, pattern) for r in range(_senders(target, ranks))))
    elapsed = max(1e-9, tally.last_answer - min(tally.first_send, tally.last_answer))
    if not tally.latency:  # a run too short for steady state: every answer counts
        tally.latency = tally.latency_all
    ms = 1000.0
    out = {"target": target, "ranks": ranks, "seconds": seconds, "mode": "saturate" if saturate else "paced",
           "connections": saturate or _senders(target, ranks), "requests": tally.requests,
           "answered": tally.answered, "failures": tally.failures,
           "elapsed_s": round(elapsed, 3), "updates_per_s": round(tally.answered / elapsed, 1),
           "p50_ms": round(_pct(tally.latency, .50) * ms, 2), "p99_ms": round(_pct(tally.latency, .99) * ms, 2),
           "max_ms": round(max(tally.latency, default=float("nan")) * ms, 2),
           "p99_all_ms": round(_pct(tally.latency_all, .99) * ms, 2) if tally.latency_all else None,
           "offered_per_s": None if saturate else round(ranks / interval, 1), "missed_slots": tally.missed,
           "unanswered": tally.unanswered, "reconnects": tally.reconnects,
           "lag_p99_ms": round(_pct(tally.lag, .99) * ms, 2) if tally.lag else None,
           "timeouts": tally.timeouts, "interval_s": interval,
           "generator_cpu_s": round(time.process_time() - cpu0, 2)}
    if window is not None:
        # Wall-clock bounds of the storm, for whoever samples the server meanwhile (bench/storm.py).
        wall = time.time() - time.perf_counter()
        out.update(pattern=pattern, storm_wall=[window[0] + wall, window[1] + wall],
                   storm_answered=len(tally.latency_storm),
                   storm_p50_ms=round(_pct(tally.latency_storm, .50) * ms, 2),
                   storm_p99_ms=round(_pct(tally.latency_storm, .99) * ms, 2),
                   storm_max_ms=round(max(tally.latency_storm, default=float("nan")) * ms, 2))
    return out


def run(target: str, port: int, ranks: int, seconds: int, saturate: int = 0, grace: float = 5.0,
        interval: float = 1.0, storm: Optional[tuple[float, float]] = None, pattern: str = "streaks") -> dict:
    """Drive ``target`` on ``port`` (in this process); return throughput, latency and the generator's own cost.

    ``storm``: ``(after_s, seconds)``: every rank skips every iteration in that window (bench/_storm.py).
    """
    try:
        import uvloop  # the server side has it too; a cheaper loop keeps the generator out of the measurement
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(_run(target, port, ranks, seconds, saturate, grace, interval, storm, pattern))


def main(argv: list[str] | None = None) -> int:
    """Run one load level and print its result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bench._loadgen", description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=("ampwatch", "ampwatch-node", "pushgateway"), required=True)
    parser.add_argument("--per-node", type=int, default=PER_NODE,
                        help="ranks per node (one v2 request carries them all) for --target ampwatch-node")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--skip-every", type=int, default=SKIP_EVERY,
                        help="a skip and a backoff event every this many updates of a rank")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds after the last slot before unanswered requests are given up (bounds the run)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between two updates of one rank (the agent's push interval or heartbeat)")
    parser.add_argument("--saturate", type=int, default=0, metavar="CONNECTIONS",
                        help="instead of one update per rank per second, send back to back on this many connections")
    parser.add_argument("--storm", metavar="AFTER,SECONDS",
                        help="a whole-job skip storm: every rank skips every iteration from AFTER for SECONDS")
    parser.add_argument("--pattern", choices=PATTERNS, default="streaks",
                        help="the events of a storm: as the agent sends them now (streaks) or before issue 14")
    args = parser.parse_args(argv)
    _every[0] = args.skip_every
    _per_node[0] = args.per_node
    storm = None
    if args.storm:
        if args.target != "ampwatch":  # the storm model is one rank's; node batches carry healthy ranks only
            parser.error("--storm drives the ampwatch collector only")
        after, seconds = (float(x) for x in args.storm.split(","))
        storm = (after, seconds)
    print(json.dumps(run(args.target, args.port, args.ranks, args.seconds, args.saturate, args.grace,
                         args.interval, storm, args.pattern)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
