"""A 16,384-rank job (2,048 nodes x 8 ranks) on one collector: state every second vs news now, state every heartbeat.

Both sides in one run, each on a fresh collector (this tree's, default settings but for
``--max-ranks-per-run`` when its default refuses the job) with a simulated job in another process
(``bench/experiments/_fleet_ranks.py``: the agent's own schedule, real HTTP on loopback). Timeline per side:
every rank starts within a second and sends its first batch (*warm*), trains healthily (*healthy*: ingest latency,
collector CPU and memory, bytes on the wire), then 10% of the ranks run skip streaks (*storm*: from
each streak's first skip to its answer, which is when ``/metrics`` shows it, checked against real
scrapes every 15 s as Prometheus makes them; from a streak's 16th skip to ``AmpConsecutiveSkippedSteps``
firing in the built-in alerts). One rank is killed (no close) early in the healthy phase:
``AmpRankSilent`` must fire within ``silent_after_s`` + ``silent_for_s`` of its last
batch (+ 2 ticks of 1 s), with the silence scaled to 3 heartbeats + 1 so that the bench stays short
(:func:`silence`; the default is 8 heartbeats + 60 s).

    python -m bench.experiments.fleet                          # 16,384 ranks, before and after: about 6 minutes
    python -m bench.experiments.fleet --quick                  # 1,024 ranks, shorter phases: about 4 minutes
    python -m bench.experiments.fleet --only after --ranks 4096
    python -m bench.experiments.fleet --out bench/experiments/results/fleet_delivery.json
                                                               # also store it (key "fleet_16384")
    python -m bench.experiments.fleet --lockstep --before f833925  # a whole-job storm, f833925's collector beside
                                                                   # this tree's (key "fleet_16384_lockstep")
    python -m bench.experiments.fleet --render bench/experiments/results/fleet_delivery.json
                                                               # print the Markdown tables stored there

``--transport node-relay`` runs the *after* side through the node relay (one protocol v2 request
per node, ``bench/experiments/_fleet_ranks.py`` ``TRANSPORTS``). A rank's ingest latency is from handing its
batch over to its answer (with the relay, the hold for the node's other ranks included); the HTTP
request row times the requests themselves, whoever sent them.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from ampwatch.agent._schedule import RANKS_PER_SECOND, default_heartbeat
from ampwatch.contract.placement import BLOCK_RANKS
from ampwatch.contract.protocol import COLLECTOR_DEFAULTS, HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S
from bench import _servers
from bench._before_after import ROOT, source_of, store
from bench.experiments._fleet_figures import (
    VISIBLE_WITHIN_S,
    first_skip_delays,
    ms_summary,
    replica,
    seconds_summary,
    summary,
)
from bench.experiments._fleet_ranks import placement
from bench.report._format import measured_by
from bench.report.fleet import table

__all__ = ["SILENCE", "VISIBLE_WITHIN_S", "first_skip_delays", "ms_summary", "scrape", "seconds_summary", "side",
           "silence", "sleep_until", "run", "main", "warm_seconds"]

KEY = "fleet"
SCRAPE_EVERY_S = 15.0  # as Prometheus does by default
def silence(heartbeat: float) -> dict[str, int]:
    """Bench-only silence thresholds: short enough to see AmpRankSilent fire within the run, still 3
    heartbeats (the longest wait between a healthy rank's batches is 1.5), so that a healthy rank
    whose heartbeats come late shows up as a false alert. The default is 8 heartbeats + 60 s."""
    return {"silent_after_s": int(3 * heartbeat), "silent_for_s": int(heartbeat)}


SILENCE = silence(HEARTBEAT_INTERVAL_S)

PHASES = {"full": {"before": (20, 30), "after": (45, 45)}, "quick": {"before": (20, 30), "after": (30, 30)}}
"""Seconds of (healthy, storm) per side; before them, *warm* lets every rank make its first contact. The
healthy phase of the *after* side is 3 (quick: 2) heartbeats, so every rank sends the same number."""


def warm_seconds(ranks: int, side: str = "after") -> float:
    """Seconds until every rank has sent its first batch: the agent spreads a big job's first batches."""
    if side == "before":
        return 2.0  # the ranks start within a second and send at once
    return min((ranks - 1) / RANKS_PER_SECOND, 4 * default_heartbeat(ranks)) + 3.0


_SKIPPED = re.compile(r'^ampwatch_optimizer_skipped_steps_total\{([^}]*)\} (\S+)', re.M)
_RANK = re.compile(r'rank="(\d+)"')


def _get(url: str, timeout: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        data = answer.read()
        return gzip.decompress(data) if answer.headers.get("Content-Encoding") == "gzip" else data


def scrape(url: str) -> dict:
    """Scrape /metrics as Prometheus does; return its times and every rank's ``gen`` skipped count."""
    started = time.time()
    try:
        text = _get(url + "/metrics", timeout=SCRAPE_EVERY_S).decode()
    except OSError as error:  # an overwhelmed collector: Prometheus would mark the target down
        return {"start": started, "end": time.time(), "counts": {}, "bytes": 0, "error": str(error)}
    ended = time.time()
    counts = {}
    for labels, value in _SKIPPED.findall(text):
        if 'optimizer="gen"' in labels and (m := _RANK.search(labels)):
            counts[m.group(1)] = float(value)
    return {"start": started, "end": ended, "counts": counts, "bytes": len(text)}


def _alerts(url: str) -> list[dict] | None:
    """Return the built-in alerts firing now, or None when the collector does not answer within 30 s."""
    try:
        return json.loads(_get(url + "/v1/alerts", timeout=30.0))["firing"]
    except OSError:
        return None


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def side(delivery: str, ranks: int, phases: tuple[float, float], transport: str,
         heartbeat: float | None = None, lockstep: bool = False, server: str | None = None,
         replicas: int = 1, pin: bool = False, block_ranks: int = BLOCK_RANKS, iteration_s: float = 1.0,
         only: int | None = None) -> dict:
    """Run one side on ``replicas`` fresh collectors (``server``: the ``server/src`` they run, default this tree's;
    ``pin``: each on a core of its own); return its figures, each replica's in ``replicas`` when there are several.

    ``only``: run only the ranks the placement puts on replica ``only`` (its share of the job, measured on its
    own; pinned, the simulation runs on the other cores)."""
    (healthy, storm), warm = phases, warm_seconds(ranks, delivery)
    limit = COLLECTOR_DEFAULTS["max_ranks_per_run"]
    args = ["--max-ranks-per-run", str(ranks)] if ranks > limit else []
    ports = [_servers.free_port() for _ in range(replicas)]
    if replicas > 1:  # each replica knows its peers and the block size, as the agents do
        args += ["--peers", ",".join(f"http://127.0.0.1:{port}" for port in ports), "--block-ranks", str(block_ranks)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        thresholds = os.path.join(tmp, "thresholds.json")
        quiet = silence(heartbeat or HEARTBEAT_INTERVAL_S)
        with open(thresholds, "w") as f:
            json.dump(quiet, f)
        args += ["--alert-thresholds", thresholds]
        srvs = [stack.enter_context(_servers.collector(tuple(args), env={"PYTHONPATH": server} if server else None,
                                                       port=port)) for port in ports]
        cores = [_servers.pin_to_cores(srv.proc.pid, {i % (os.cpu_count() or 1)}) if pin else None
                 for i, srv in enumerate(srvs)]
        rss0 = sum(srv.stats.memory_kib()["VmRSS"] for srv in srvs)
        out = os.path.join(tmp, "ranks.json")
        place = placement("fleet", ranks, ports, block_ranks)  # the simulation's run is "fleet"
        mine = [rank for rank, port in enumerate(place) if only is None or port == ports[only]]
        kill_rank = mine[len(mine) // 2 + 3]  # a rank in no storm (the simulation keeps it out)
        sim = subprocess.Popen([sys.executable, "-m", "bench.experiments._fleet_ranks",
                                *(a for port in ports for a in ("--port", str(port))),
                                "--block-ranks", str(block_ranks),
                                *(["--only-port", str(ports[only])] if only is not None else []),
                                "--ranks", str(ranks), "--delivery", delivery, "--transport", transport,
                                "--warm", str(warm), "--healthy", str(healthy), "--storm", str(storm),
                                "--kill-rank", str(kill_rank), "--kill-after", "5", "--out", out,
                                "--iteration-s", str(iteration_s),
                                *(["--heartbeat", str(heartbeat)] if heartbeat else []),
                                *(["--lockstep"] if lockstep else [])],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        sim_cores = (_servers.pin_to_cores(sim.pid, set(range(os.cpu_count() or 1)) - {only % (os.cpu_count() or 1)})
                     if pin and only is not None and (os.cpu_count() or 1) > 1 else None)
        usage = _servers.Usage([srv.stats for srv in srvs], _servers.ProcessStats(sim.pid))
        timeline = json.loads(sim.stdout.readline())
        sleep_until(timeline["warm_end"])
        usage.mark("healthy")
        scrapes: list[dict] = []
        moments = [(timeline["warm_end"] + k * SCRAPE_EVERY_S, "scrape")
                   for k in range(int((timeline["end"] - timeline["warm_end"]) / SCRAPE_EVERY_S) + 1)]
        for at, what in sorted(moments + [(timeline["storm_at"], "sample")]):
            if at >= timeline["end"]:
                break
            sleep_until(at)
            if what == "sample":
                usage.mark("storm")
                rss_healthy = [srv.stats.memory_kib()["VmRSS"] for srv in srvs]
            else:
                scrapes.append(_scrape_all([srv.url for srv in srvs]))
        sleep_until(timeline["end"])
        usage.mark("end")
        sim.wait(timeout=120)
        if sim.returncode != 0:
            raise RuntimeError(f"the simulated job failed (exit {sim.returncode})")
        with open(out) as f:
            job = json.load(f)
        holder = ports.index(place[kill_rank])
        killed = job["killed"]
        silent_at = _silent_fired_at(srvs[holder].url, str(killed["rank"]), job["killed_last_ack"],
                                     _alerts(srvs[holder].url), quiet)
        firing_by = [_alerts(srv.url) for srv in srvs]
        peaks = [srv.stats.memory_kib() for srv in srvs]
    firing = (None if all(f is None for f in firing_by)
              else [dict(a, replica=i) for i, f in enumerate(firing_by) for a in f or ()])
    cpu = {name: sum(usage.collectors[mark]) for name, mark in (("healthy", "healthy"), ("healthy_end", "storm"),
                                                                  ("end", "end"))}
    peak = {"VmHWM": sum(p["VmHWM"] for p in peaks)}
    result = summary(delivery, len(mine), timeline, job, scrapes, firing, silent_at, cpu, rss0, sum(rss_healthy), peak,
                     raised_limit=ranks > limit, quiet=quiet, replica_of=[ports.index(port) for port in place])
    result["job_ranks"], result["simulation_pinned_to"] = ranks, sim_cores
    result["usage"] = {"healthy": usage.between("healthy", "storm"), "storm": usage.between("storm", "end")}
    if replicas > 1:
        result["collector_urls"] = [srv.url for srv in srvs]
        result["replicas"] = [replica(job, timeline, i, scrapes, firing_by[i], usage, rss_healthy[i], cores[i])
                              for i in range(replicas) if only in (None, i)]
    return result


def _scrape_all(urls: list[str]) -> dict:
    """Scrape every replica in turn, as one Prometheus does: the union of their ranks, from the first start to the
    last end (each replica's own scrape kept in ``each``)."""
    each = [scrape(url) for url in urls]
    merged: dict = {"start": min(s["start"] for s in each), "end": max(s["end"] for s in each),
                    "counts": {rank: count for s in each for rank, count in s["counts"].items()},
                    "bytes": sum(s["bytes"] for s in each), "each": each}
    errors = [s["error"] for s in each if "error" in s]
    if errors:
        merged["error"] = "; ".join(errors)
    return merged if len(urls) > 1 else each[0]


def _silent_fired_at(url: str, rank: str, last_ack: float | None, firing: list[dict] | None,
                     quiet: dict[str, int]) -> float | None:
    """Wait (bounded) for AmpRankSilent on the killed ``rank``; return when it started firing."""
    deadline = (last_ack or time.time()) + quiet["silent_after_s"] + quiet["silent_for_s"] + 10
    while True:
        for alert in firing or ():
            if alert["name"] == "AmpRankSilent" and alert["labels"].get("rank") == rank:
                return alert["starts_at"]
        if time.time() > deadline:
            return None
        time.sleep(1.0)
        firing = _alerts(url)


def run(ranks: int, sides: tuple[str, ...], quick: bool, transport: str = "per-rank",
        heartbeat: float | None = None, lockstep: bool = False, before: str | None = None) -> dict:
    """Run each side in turn; return ``{side: figures}`` with the run's settings.

    ``before``: a commit whose collector runs the *after* delivery first, as side ``previous`` (its
    ``server/src`` from ``git archive``); ``lockstep``: a DDP job whose whole storm is every rank's.
    """
    plan = dict(PHASES["quick" if quick else "full"])
    heartbeat = heartbeat or default_heartbeat(ranks)  # the agent's default for a job of this size
    # The after side's healthy phase stays a whole number of heartbeats (3; quick: 2).
    plan["after"] = plan["previous"] = (plan["after"][0] // HEARTBEAT_INTERVAL_S * heartbeat, plan["after"][1])
    result: dict = {}
    for name in sides:
        with tempfile.TemporaryDirectory() as tmp:
            server = source_of(before, tmp) if name == "previous" else None
            delivery = "before" if name == "before" else "after"
            result[name] = side(delivery, ranks, plan[name], transport if name != "before" else "per-rank",
                                heartbeat if name != "before" else None, lockstep, server)
        if name == "previous":
            result[name]["label"] = f"at {before} (the same job)"
    result["settings"] = {"heartbeat_s": heartbeat, "scrape_every_s": SCRAPE_EVERY_S,
                          "iteration_s": 1.0, "storm_share": 1.0 if lockstep else 0.1, "lockstep": lockstep,
                          "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the fleet comparison, print a table, and store the result with ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="simulated ranks (default 16,384; --quick 1,024)")
    parser.add_argument("--quick", action="store_true", help="1,024 ranks and shorter phases")
    parser.add_argument("--only", choices=("before", "after"), help="run one side only")
    parser.add_argument("--transport", default="per-rank", help="how the after side's batches travel "
                                                                "(bench/experiments/_fleet_ranks.py TRANSPORTS)")
    parser.add_argument("--heartbeat", type=float, help=f"the after side's push interval (default: the agent's "
                                                        f"for the job's size, {HEARTBEAT_INTERVAL_S} s up to "
                                                        f"{MAX_HEARTBEAT_INTERVAL_S} s; 16,384 ranks: "
                                                        f"{default_heartbeat(16384):.1f} s)")
    parser.add_argument("--lockstep", action="store_true", help="a DDP job: every rank iterates and skips together "
                                                                    "(a whole-job storm, each rank's news in the "
                                                                    "same second)")
    parser.add_argument("--before", metavar="REF", help="instead of the delivery before issue 18, compare with "
                                                        "the collector of commit REF under the same job")
    parser.add_argument("--out", help=f"also store the result under '{KEY}_RANKS' in this JSON file")
    parser.add_argument("--render", metavar="JSON", help="print the Markdown table of a stored result and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            for key, result in json.load(f).items():
                if key.startswith(KEY):
                    print(f"{key} ({measured_by(result)}):\n")
                    print("\n".join(table(result)) + "\n")
        return 0
    ranks = args.ranks or (1024 if args.quick else 16384)
    first = "previous" if args.before else "before"
    sides = ((first if args.only == "before" else "after"),) if args.only else (first, "after")
    result = run(ranks, sides, args.quick, args.transport, args.heartbeat, args.lockstep, args.before)
    print("\n".join(table(result)))
    print(json.dumps(result, indent=1))
    if args.out:
        key = (f"{KEY}_{ranks}" + ("_lockstep" if args.lockstep else "")
               + (f"_heartbeat_{args.heartbeat:g}" if args.heartbeat else "")
               + ("" if args.transport == "per-rank" else "_" + args.transport.replace("-", "_")))
        store(args.out, key, result, sys.argv, module="fleet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
