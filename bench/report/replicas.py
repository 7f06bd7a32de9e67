"""Section 9b: a 16,384-rank job on one collector and on 2 replicas (``bench.replicas``), side by side.

Issue 41's targets are checked on each 2-replica side, together and per replica; the table beside them reads
every side with section 9's rows (``bench.report.fleet.ROWS``) and adds who used the machine's 2 cores. The
last paragraph says what the figures say of the contract's ``BLOCK_RANKS``: whether one replica holding one
block met the targets.
"""

from __future__ import annotations

from bench.report._format import fmt
from bench.report.fleet import HEALTHY_P99_MS, ROWS, VISIBLE_WITHIN_S

__all__ = ["TITLE", "section", "summary_rows", "targets"]

TITLE = "9b. A 16,384-rank job on 2 replicas"

_NAMES = {"one": "one collector", "replicas": "2 replicas", "alone": "replica 0 alone, its share",
          "one_lockstep": "one collector, lockstep", "replicas_lockstep": "2 replicas, lockstep",
          "alone_lockstep": "replica 0 alone, lockstep"}


def _all_within(figures: dict, missing: int) -> tuple[str, bool]:
    seen = figures["within_2s"]
    return f"{fmt(seen)} of {fmt(figures['n'] + missing)}", seen == figures["n"] + missing and figures["n"] > 0


def _held(replica: dict) -> str:
    """The ranks a replica held: its blocks' ranges (a run's blocks are dealt out in turn, so not one range)."""
    if "rank_ranges" in replica:
        return f"ranks {replica['rank_ranges']}"
    return f"{fmt(replica['ranks'])} ranks in {fmt(replica['first_rank'])}-{fmt(replica['last_rank'])}"


def targets(side: dict) -> list[tuple[str, str, bool]]:
    """Issue 41's targets on one side, together and for each replica: ``(target, measured, met)``."""
    out = []
    storm = side["storm"]
    parts = [] if len(side.get("replicas", [])) == 1 else [  # replica 0 alone: its figures are the side's
        ("together", side["healthy"]["latency"], storm["first_skip_to_metrics"],
         storm["first_skips_not_visible_by_end"], storm["rung16_to_builtin_alert"], storm["streak_alerts_missing"])]
    parts += [(f"replica {r['index']} ({_held(r)})", r["healthy_latency"],
               r["first_skip_to_metrics"], r["first_skips_not_visible_by_end"], r["rung16_to_builtin_alert"],
               r["streak_alerts_missing"]) for r in side.get("replicas", [])]
    for who, healthy, seen, unseen, alert, no_alert in parts:
        p99 = healthy["p99_ms"]
        out.append((f"{who}: healthy ingest p99 < {fmt(HEALTHY_P99_MS, 0)} ms", f"{fmt(p99)} ms",
                    p99 is not None and p99 < HEALTHY_P99_MS))
        out.append((f"{who}: every streak's first skip in `/metrics` within {fmt(VISIBLE_WITHIN_S, 0)} s",
                    *_all_within(seen, unseen)))
        worst = alert.get("max_s")
        out.append((f"{who}: built-in streak alert within {fmt(VISIBLE_WITHIN_S, 0)} s of the 16th skip",
                    f"p99 {fmt(alert.get('p99_s'))} s, max {fmt(worst)} s, {fmt(no_alert)} missing",
                    worst is not None and worst <= VISIBLE_WITHIN_S and no_alert == 0))
    return out


def _cores(side: dict, phase: str) -> str:
    use = side["usage"][phase]
    return (" + ".join(fmt(c, 2) for c in use["collectors"]) + f" / {fmt(use['simulation'], 2)} / "
            f"{fmt(use['others'], 2)} of {use['cores']}")


_EXTRA = (
    ("collectors (ranks each) pinned to cores; the simulation's cores",
     lambda s: f"{s['collectors']} ({fmt(s['ranks_per_collector'])}) "
               + (", ".join(str(r["pinned_to"]) for r in s["replicas"]) if s.get("replicas") else "[0]")
               + f"; {s.get('simulation_pinned_to') or 'any'}"),
    ("heartbeat s (the agent's default for the ranks per collector)", lambda s: fmt(s["heartbeat_s"])),
    ("cores used, healthy: collectors / simulation / others", lambda s: _cores(s, "healthy")),
    ("cores used, storm: collectors / simulation / others", lambda s: _cores(s, "storm")),
    ("per replica: healthy ingest p99 ms",
     lambda s: " / ".join(fmt(r["healthy_latency"]["p99_ms"]) for r in s.get("replicas", [])) or "-"),
    ("per replica: 16th skip -> built-in alert max s",
     lambda s: " / ".join(fmt(r["rung16_to_builtin_alert"]["max_s"]) for r in s.get("replicas", [])) or "-"),
    ("per replica: ranks in its `/metrics` placed elsewhere",
     lambda s: " / ".join(fmt(r["foreign_ranks_in_metrics"]) for r in s.get("replicas", [])) or "-"),
)


def _block_size(res: dict) -> list[str]:
    """What the figures say of ``BLOCK_RANKS``: did each replica, holding its blocks, meet the targets?"""
    block, sides = res["settings"]["block_ranks"], res["sides"]
    held = max((s["ranks_per_collector"] for s in sides.values() if s.get("replicas")), default=block)
    verdicts = []
    for name in ("replicas", "alone", "replicas_lockstep", "alone_lockstep"):
        if name in sides:
            per_replica = [t for t in targets(sides[name]) if t[0].startswith("replica")]
            verdicts.append(f"{_NAMES[name]}: {sum(ok for *_, ok in per_replica)} of {len(per_replica)} "
                            "per-replica targets met")
    if not verdicts:
        return []
    blocks = f"one block of {fmt(block)} ranks" if held <= block else \
        f"{fmt(held // block)} blocks of {fmt(block)} ranks ({fmt(held)} ranks)"
    return [f"Block size: each replica held {blocks} of this job ({'; '.join(verdicts)}). "
            "`BLOCK_RANKS` is the size one replica holds within the targets: where a replica misses one here, "
            "a smaller block (more replicas per job) is what the figures ask for, unless the misses come from "
            "cores the simulation or other jobs took (the *cores used* rows)."]


def section(res: dict) -> list[str]:
    """The section's lines from the run's ``replicas`` result."""
    sides = res["sides"]
    names = list(sides)
    lines = ["Issue 41's targets with 2 replicas:", "", "| side | target | measured | |", "|---|---|---|---|"]
    for name in names:
        if sides[name].get("replicas"):
            lines += [f"| {_NAMES.get(name, name)} | {target} | {figure} | {'met' if ok else '**not met**'} |"
                      for target, figure, ok in targets(sides[name])]
    lines += ["", "| | " + " | ".join(_NAMES.get(n, n) for n in names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cell(sides[n]) for n in names) + " |" for label, cell in (*ROWS, *_EXTRA)]
    s = res["settings"]
    lines += ["", f"A simulated job of {fmt(s['ranks'])} ranks, the agent's own schedule, real HTTP on loopback, "
              f"`/metrics` of every collector scraped every {fmt(s['scrape_every_s'])} s; each side on fresh "
              "collectors of this tree, each pinned to a core of its own (`sched_setaffinity`, every thread): the "
              "one collector on core 0, the 2 replicas on cores 0 and 1, each rank reporting to the replica "
              f"`ampwatch.contract.placement.collector_for` names (blocks of {fmt(s['block_ranks'])} ranks). The "
              "job simulation is one process, not pinned: it competes with the replicas for the machine's "
              f"{s['cpus']} cores, and so do other jobs on the machine (*others*: the machine's busy cores from "
              "`/proc/stat` less the collectors' and the simulation's). *Replica 0 alone* is the second figure: "
              "replica 0 with only its share of the ranks (its block; replica 1 idle), the simulation pinned to "
              "core 1, so that only other jobs compete for its core. `bench/replicas.py` says how each figure is "
              "taken; section 9's rows are read alike.", "", *_block_size(res), "",
              f"Load average at the end: {' / '.join(fmt(v, 2) for v in s['loadavg_end'])} (1 / 5 / 15 min).", ""]
    return lines


def summary_rows(res: dict) -> list[str]:
    """The summary's row: the 2-replica job's healthy ingest p99 beside one collector's, and the targets met."""
    sides = res["sides"]
    if "replicas" not in sides:
        return []
    two, one = sides["replicas"], sides.get("one")
    met = [ok for name in ("replicas", "replicas_lockstep") if name in sides for *_, ok in targets(sides[name])]
    return [f"| {fmt(res['settings']['ranks'])} ranks on 2 replicas: healthy ingest p99 | "
            f"{fmt(two['healthy']['latency']['p99_ms'])} ms | one collector "
            f"{fmt(one['healthy']['latency']['p99_ms']) if one else '-'} ms | issue 41's targets: "
            f"{sum(met)} of {len(met)} met |"]
