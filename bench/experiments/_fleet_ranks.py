"""Simulated ranks of one big job (its own process): each sends when the agent's own schedule says.

Every rank trains at one iteration per ``--iteration-s`` (its own phase) and posts protocol v1
batches with the cumulative state and the events the real recorder emits for it: a storm rank
runs skip streaks (a skip and a backoff per skipped iteration, ``streak_end`` after) from
``--storm-at``. With ``--lockstep`` the job is a DDP job: its ranks iterate together (within
``LOCKSTEP_DRIFT_S``), every one of them skips through the storm and the checkpoint restore that
ends it, so each one's news comes at the same iteration (``bench.experiments._fleet_plan.JobTimeline``).
When a batch goes is decided by :class:`ampwatch.agent._schedule.PushSchedule`
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
rank the skip times and the answers, for ``bench.experiments.fleet`` to check against scrapes and alerts.

    python -m bench.experiments._fleet_ranks --port P --ranks 16384 --delivery after --seconds 90 --out r.json
    python -m bench.experiments._fleet_ranks --port P1 --port P2 ...   # 2 replicas: each rank to its block's

With several ``--port``, each rank reports to the collector the contract's placement names
(:func:`placement`: ``ampwatch.contract.placement``, the agents' rule), and the latencies are also
kept by collector (``latency_by_collector``, ``http_latency_by_collector``: in ``--port`` order). With
``--only-port`` only that collector's share of the ranks runs (a replica measured on its own).

This module is the process: the job's timeline and plans, and the results. A rank's plan and its
delivery policy are in ``bench.experiments._fleet_plan``, its sender loop in ``bench.experiments._fleet_rank``, the
transports in ``bench.experiments._fleet_transports``.
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

from ampwatch.contract.placement import BLOCK_RANKS, collector_for, normalize
from bench._async_http import run_loop
from bench._rank_batch import RANKS_PER_NODE
from bench.experiments._fleet_plan import DELIVERIES, JobTimeline, LockstepPlan, Plan, storm_streaks
from bench.experiments._fleet_rank import Tally, run_rank
from bench.experiments._fleet_transports import TRANSPORTS, KeptAlive

__all__ = ["DELIVERIES", "LOCKSTEP_DRIFT_S", "TRANSPORTS", "main", "placement"]

LOCKSTEP_DRIFT_S = 0.01
"""How far apart in time a lockstep job's ranks end the same iteration (DDP's all-reduce holds them together)."""


async def _run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    delivery = DELIVERIES[args.delivery]
    if args.heartbeat:
        delivery = dataclasses.replace(delivery, heartbeat=args.heartbeat)
    if args.news_spread is not None:
        delivery = dataclasses.replace(delivery, news_spread=args.news_spread)
    t0 = time.time() + 1.0
    warm_end = t0 + args.warm
    storm_at = warm_end + args.healthy
    storm_end = storm_at + args.storm
    end = storm_end + args.recovery + args.hold
    phases = {"warm": (t0, warm_end), "healthy": (warm_end, storm_at), "storm": (storm_at, storm_end)}
    if args.lockstep:
        phases.update(recovery=(storm_end, storm_end + args.recovery), hold=(storm_end + args.recovery, end))
    tally = Tally(phases)
    plans: list = []
    if args.lockstep:  # a DDP job: the ranks iterate together, and all of them skip in the storm
        first = int((storm_at - t0) / args.iteration_s) + 1
        timeline = JobTimeline(first, int(args.storm / args.iteration_s), int((end - t0) / args.iteration_s) + 2)
        for rank in range(args.ranks):
            plan = LockstepPlan(t0 + rng.uniform(0, LOCKSTEP_DRIFT_S), args.iteration_s, timeline)
            starts, rung16 = plan.storm_starts()
            if rank != args.kill_rank and starts:
                tally.storm[rank] = {"starts": starts, "answers": [], "rung16": rung16}
            plans.append(plan)
    storm_ranks = set(rng.sample(range(args.ranks), int(args.ranks * args.storm_share))) if not plans else set()
    storm_ranks.discard(args.kill_rank)
    for rank in range(args.ranks if not plans else 0):
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
    ports = placement(args.run, args.ranks, args.port, args.block_ranks)
    tally.collector_of = [args.port.index(port) for port in ports]
    tally.latency_by = [{p: [] for p in phases} for _ in args.port]
    active = [rank for rank, port in enumerate(ports) if args.only_port in (None, port)]
    for rank in [rank for rank in tally.storm if args.only_port not in (None, ports[rank])]:
        del tally.storm[rank]  # a rank of another replica's share: not run (--only-port)
    transports: dict[tuple[int, int], KeptAlive] = {}  # (node, port): a node's ranks of one block share one
    for rank in active:
        port = ports[rank]
        if (rank // RANKS_PER_NODE, port) not in transports:
            transports[rank // RANKS_PER_NODE, port] = TRANSPORTS[args.transport](port, rank // RANKS_PER_NODE)
    print(json.dumps({"t0": t0, "warm_end": warm_end, "storm_at": storm_at, "storm_end": storm_end, "end": end}),
          flush=True)
    # The plans and tallies of 16,384 ranks are a large heap: without this the generator's own full
    # collections stall every rank's sends for hundreds of ms, which would show as collector latency.
    gc.freeze()
    gc.set_threshold(50_000, 50, 1_000)
    cpu0 = time.process_time()
    await asyncio.gather(*(run_rank(r, plans[r], delivery, transports[r // RANKS_PER_NODE, ports[r]], args.run,
                                    args.ranks,
                                    end, warm_end + args.kill_after if r == args.kill_rank else None, tally,
                                    args.levels_every)
                           for r in active))
    http: dict[str, list[float]] = {p: [] for p in phases}  # HTTP request latency, whoever sent it
    http_by: list[dict[str, list[float]]] = [{p: [] for p in phases} for _ in args.port]  # and by collector
    for (_, port), transport in transports.items():
        transport.close()
        for sent, seconds in transport.exchanges:
            phase = tally.phase(sent)
            if phase is not None:
                http[phase].append(round(seconds, 5))
                http_by[args.port.index(port)][phase].append(round(seconds, 5))
    return {"delivery": args.delivery, "transport": args.transport, "ranks": args.ranks, "run": args.run,
            "phases": phases,
            "levels_every": args.levels_every,
            "killed": {"rank": args.kill_rank, "at": warm_end + args.kill_after} if args.kill_rank >= 0 else None,
            "collectors": [f"http://127.0.0.1:{port}" for port in args.port], "block_ranks": args.block_ranks,
            "active_ranks": len(active),
            "latency_by_collector": tally.latency_by, "http_latency_by_collector": http_by,
            "latency": tally.latency, "http_latency": http, "late": tally.late, "requests": tally.requests,
            "bytes": tally.bytes, "levelled": tally.levelled, "refused": tally.refused, "timeouts": tally.timeouts,
            "missed": tally.missed,
            "killed_last_ack": tally.killed_last_ack,
            "storm": {str(r): v for r, v in tally.storm.items()},
            "generator_cpu_s": round(time.process_time() - cpu0, 2)}


def placement(run: str, ranks: int, ports: list[int], block_ranks: int = BLOCK_RANKS) -> list[int]:
    """The port of the collector each rank reports to, by the agents' own rule over collectors on loopback."""
    by_url = {normalize(f"http://127.0.0.1:{port}"): port for port in ports}
    return [by_url[collector_for(run, rank, ranks, by_url, block_ranks)] for rank in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    """Run the simulated job; write its results as JSON to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments._fleet_ranks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, action="append", required=True,
                        help="a collector's port on loopback; repeat it for several replicas: each rank reports to "
                             "the one the contract's placement names (ampwatch.contract.placement.collector_for)")
    parser.add_argument("--only-port", type=int, default=None,
                        help="run only the ranks the placement puts on this --port: one replica's share of the job")
    parser.add_argument("--block-ranks", type=int, default=BLOCK_RANKS,
                        help=f"ranks of one run a collector holds before the run is split (default {BLOCK_RANKS:,})")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--delivery", choices=sorted(DELIVERIES), required=True)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="per-rank")
    parser.add_argument("--heartbeat", type=float, default=None, help="another push interval for this delivery")
    parser.add_argument("--news-spread", type=float, default=None,
                        help="the widest spread of a job's news, seconds (default: the agent's NEWS_SPREAD)")
    parser.add_argument("--run", default="fleet")
    parser.add_argument("--warm", type=float, required=True, help="seconds for every rank to start")
    parser.add_argument("--healthy", type=float, required=True, help="seconds of healthy training, measured")
    parser.add_argument("--storm", type=float, required=True, help="seconds with --storm-share ranks skipping")
    parser.add_argument("--storm-share", type=float, default=0.1)
    parser.add_argument("--lockstep", action="store_true",
                        help="a DDP job: every rank iterates and skips together, the storm is the whole job's "
                             "and ends with a checkpoint restore (--storm-share is not used)")
    parser.add_argument("--recovery", type=float, default=0.0,
                        help="with --lockstep: seconds after the restore, measured as phase 'recovery'")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="with --lockstep: seconds of healthy training after the recovery (phase 'hold')")
    parser.add_argument("--iteration-s", type=float, default=1.0)
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank stops without closing, --kill-after")
    parser.add_argument("--kill-after", type=float, default=0.0, help="seconds into the healthy phase")
    parser.add_argument("--levels-every", type=int, default=0, metavar="N",
                        help="one batch in N (at random) carries issue 40's rolling levels of "
                             "the loss and gradient norms (bench._rank_batch.with_levels); 0: none (default)")
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection per rank
    except (ImportError, ValueError, OSError):
        pass
    result = run_loop(_run(args))
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
