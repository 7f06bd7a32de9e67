"""A 16,384-rank job on one collector and on 2 replicas, even spread and lockstep, side by side in one run.

Four sides, one after the other, each on fresh collectors (this tree's, pinned each to a core of its own with
``sched_setaffinity``, every thread) and a simulated job in a process of its own (``bench.experiments.fleet``'s
side: the agent's own schedule, real HTTP on loopback, ``/metrics`` of every collector scraped every 15 s,
one rank killed):

- ``one``: the job on one collector, on core 0;
- ``replicas``: the same job on 2 replicas, core 0 and core 1, each rank reporting to the collector that
  ``ampwatch.contract.placement.collector_for`` names (blocks of ``BLOCK_RANKS`` ranks: 16,384 ranks are 2
  blocks, one per replica);
- ``alone``: replica 0 measured on its own with its share of the ranks (its block; the other replica idle), the
  simulation pinned to the other core, so that neither competes for the replica's core but other jobs;
- ``one_lockstep``, ``replicas_lockstep`` and ``alone_lockstep``: the same with a DDP job whose whole storm is
  every rank's.

Each side's heartbeat is the agent's default for its ranks per collector (``default_heartbeat``: 30 s for
16,384 ranks on one, 16.4 s for 8,192). This machine has 2 cores: the job simulation is not pinned and competes
with the replicas for them, as do other jobs on the machine; every side reports the cores each collector, the
simulation and everything else used (``usage``), so a replica starved of its core shows. Issue 41's targets with
2 replicas: healthy ingest p99 < 100 ms, a streak's first skip in ``/metrics`` within 2 s for every rank, the
built-in streak alert within 2 s of the 16th skip, per replica and together.

    python -m bench.replicas                  # 16,384 ranks, 6 sides: about 20 minutes
    python -m bench.replicas --quick          # 2,048 ranks in blocks of 1,024, one and 2, even spread: about 3 min
    python -m bench --only replicas --merge   # measure it into docs/benchmarks.json and .md (section 9b)
    python -m bench.replicas --ranks 8192 --block-ranks 4096 --sides alone alone_lockstep \
        --out bench/experiments/results/replicas_block_size.json   # one replica alone with a smaller block
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ampwatch.agent._schedule import default_heartbeat
from ampwatch.contract.placement import BLOCK_RANKS, blocks
from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S
from bench._before_after import store
from bench.experiments import fleet

__all__ = ["SIDES", "per_collector", "run", "main"]

SIDES = (("one", 1, False, None), ("replicas", 2, False, None), ("alone", 2, False, 0),
         ("one_lockstep", 1, True, None), ("replicas_lockstep", 2, True, None), ("alone_lockstep", 2, True, 0))
"""Each side's name, its number of collectors, whether the job runs in lockstep, and the replica whose share of
the ranks alone runs (``alone``: replica 0 with its block, the simulation pinned to the other core)."""

PHASES = {"full": (3, 45.0), "quick": (2, 30.0)}
"""Healthy heartbeats and storm seconds of each side (as ``bench.experiments.fleet``'s *after* side)."""


def per_collector(ranks: int, replicas: int, block_ranks: int = BLOCK_RANKS) -> int:
    """The most ranks of the job one of ``replicas`` collectors holds, by the contract's placement."""
    urls = [f"http://127.0.0.1:{9457 + i}" for i in range(replicas)]
    held: dict[str, int] = {}
    for block in blocks("fleet", ranks, urls, block_ranks):
        held[block.collector] = held.get(block.collector, 0) + block.last_rank - block.first_rank + 1
    return max(held.values())


def run(ranks: int = 16_384, quick: bool = False, block_ranks: int = BLOCK_RANKS, lockstep: bool = True,
        alone: bool = True, heartbeat: float | None = None, healthy_s: float | None = None,
        storm_s: float | None = None, iteration_s: float = 1.0, sides: tuple[str, ...] | None = None) -> dict:
    """Run the sides (``lockstep``, ``alone``: those too; ``sides``: only these); return their figures and settings.

    ``heartbeat``, ``healthy_s``, ``storm_s`` and ``iteration_s`` shorten the run for a test; by default each side's
    heartbeat is the agent's for its ranks per collector and its healthy phase whole heartbeats.
    """
    beats, storm = PHASES["quick" if quick else "full"]
    result: dict = {"sides": {}}
    for name, replicas, in_lockstep, only in SIDES:
        if (sides is not None and name not in sides) or (sides is None and ((in_lockstep and not lockstep)
                                                                            or (only is not None and not alone))):
            continue
        held = per_collector(ranks, replicas, block_ranks)
        beat = heartbeat or default_heartbeat(held)
        side = fleet.side("after", ranks, (healthy_s or beats * beat, storm_s or storm), "per-rank", beat, in_lockstep,
                           replicas=replicas, pin=True, block_ranks=block_ranks, iteration_s=iteration_s, only=only)
        side.update(collectors=replicas, ranks_per_collector=held, heartbeat_s=round(beat, 2), lockstep=in_lockstep)
        result["sides"][name] = side
        print(f"bench.replicas: {name} done", file=sys.stderr, flush=True)
    result["settings"] = {"ranks": ranks, "block_ranks": block_ranks, "iteration_s": iteration_s,
                          "scrape_every_s": fleet.SCRAPE_EVERY_S, "storm_share": 0.1, "cpus": os.cpu_count(),
                          "default_heartbeat_s": HEARTBEAT_INTERVAL_S, "loadavg_end": list(os.getloadavg())}
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print its figures as JSON (``python -m bench --only replicas`` stores them)."""
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,048 ranks in blocks of 1,024, even spread only")
    parser.add_argument("--ranks", type=int, help="simulated ranks (default 16,384; --quick 2,048)")
    parser.add_argument("--block-ranks", type=int, help=f"default {BLOCK_RANKS:,} (--quick: half the ranks)")
    parser.add_argument("--no-lockstep", action="store_true", help="the even-spread sides only")
    parser.add_argument("--sides", nargs="+", choices=[name for name, *_ in SIDES], help="only these sides")
    parser.add_argument("--out", help="also store the result in this JSON file, under 'replicas_RANKS_block_BLOCK'")
    args = parser.parse_args(argv)
    ranks = args.ranks or (2048 if args.quick else 16_384)
    block = args.block_ranks or (ranks // 2 if args.quick else BLOCK_RANKS)
    result = run(ranks, args.quick, block, not (args.quick or args.no_lockstep), not args.quick,
                 sides=tuple(args.sides) if args.sides else None)
    print(json.dumps(result, indent=1))
    if args.out:
        store(args.out, f"replicas_{ranks}_block_{block}", result, sys.argv, module="replicas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
