"""The model on paper for 100,000 GPUs: replicas, requests per second, series, rule cost, what each engine holds.

Nothing is run: every figure follows from the contract's constants (``ampwatch.contract.placement.BLOCK_RANKS``,
``ampwatch.contract.metrics``, the agent's ``default_heartbeat`` and ``NEWS_SPREAD``, the generated rule file)
and from figures measured on this machine and stored in the repository (one collector's CPU per healthy update
at 16,384 ranks, section 9 of docs/benchmarks.md; the node relay's requests and CPU per update beside one request
per rank, ``bench.experiments.relay``; Prometheus's CPU per series for the generated rules at 1,024 ranks,
``bench.experiments.rule_eval``). docs/collector.md ("100,000 GPUs") shows this output; a test checks they agree.

    python -m bench.experiments.model_100k              # the Markdown table
    python -m bench.experiments.model_100k --gpus 50000 --optimizers 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from ampwatch.agent._schedule import NEWS_SPREAD, default_heartbeat
from ampwatch.contract import metrics
from ampwatch.contract.placement import BLOCK_RANKS
from ampwatch.contract.protocol import STREAK_LADDER
from bench._rank_batch import RANKS_PER_NODE

__all__ = ["RESULTS", "RULES", "inputs", "model", "series_per_rank", "table", "main"]

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(_ROOT, "bench", "experiments", "results")
RULES = os.path.join(_ROOT, "dashboards", "generated", "ampwatch-rules.yaml")
SCRAPE_S = 15.0  # Prometheus's and vmagent's usual scrape and evaluation interval
_NAME = re.compile(r"\bampwatch_[a-z_]+\b")


def series_per_rank(optimizers: int) -> dict[str, int]:
    """The series one rank puts in ``/metrics`` by the contract: those always there (per rank, and per optimizer:
    the skip streaks once per rung of ``STREAK_LADDER``), and those only after a skip or on a suspect device."""
    always = sometimes = 0
    for m in metrics.METRICS:
        if "rank" not in m.labels:
            continue
        own = set(m.labels) - {"run", "rank", "optimizer"}
        each = optimizers if "optimizer" in m.labels else 1
        if own == {"min_length"}:
            always += each * len(STREAK_LADDER)
        elif own and m is not metrics.RANK_INFO:  # the latest offending parameter, a suspect device
            sometimes += each
        else:
            always += each
    return {"always": always, "after_a_skip": sometimes}


def _rules(gpus: int, optimizers: int) -> dict:
    """The generated rule file: how many recording and alerting rules, the per-rank metrics their expressions read,
    and the series the recording rules write (by their level: ``run_rank_optimizer:``, ``run_rank:``, ``run:``), at
    most and in a healthy job (a rule whose expression compares keeps only the ranks it finds: none when healthy)."""
    text = open(RULES).read()
    names = {m.name.removesuffix("_total"): m for m in metrics.METRICS if "rank" in m.labels}
    read = {names[n.removesuffix("_total")] for n in _NAME.findall(text) if n.removesuffix("_total") in names}
    per_level = {"run_rank_optimizer": gpus * optimizers, "run_rank": gpus, "run": 1}
    written = healthy = 0
    for rule in re.split(r"^\s*- (?=record:|alert:)", text, flags=re.M)[1:]:
        if rule.startswith("record:"):
            level = rule.split()[1].split(":")[0]
            written += per_level[level]
            compares = re.search(r"[<>]|==|!=|unless|offset", rule.split("expr:", 1)[1])
            healthy += 0 if compares and level != "run" else per_level[level]
    return {"record": len(re.findall(r"^\s*- record:", text, re.M)), "alert": len(re.findall(r"^\s*- alert:", text,
                                                                                             re.M)),
            "reads": read, "written": written, "written_healthy": healthy}


def inputs() -> dict:
    """The measured figures the model scales, each from the stored result that holds it."""
    with open(os.path.join(RESULTS, "fleet_delivery.json")) as f:
        one = json.load(f)["fleet_16384"]["after"]["healthy"]
    with open(os.path.join(RESULTS, "relay.json")) as f:
        relay = max(json.load(f)["relay"]["levels"], key=lambda level: level["ranks"])
    with open(os.path.join(RESULTS, "rule_eval_storm.json")) as f:
        rules = json.load(f)["rule_eval_during"]
    return {"update_cpu_ms": 1000 * one["collector_cpu_cores"] / one["requests_per_s"],
            "relay_requests_ratio": relay["requests_ratio"], "relay_cpu_ratio": relay["cpu_per_update_ratio"],
            "rule_cpu_us_per_series": 1e6 * rules["after"]["cpu_s_per_interval"] / rules["series"]}


def model(gpus: int = 100_000, optimizers: int = 1, block_ranks: int = BLOCK_RANKS) -> dict:
    """Every figure of the table, for one job of ``gpus`` ranks (one per GPU, 8 per node)."""
    m, rules = inputs(), _rules(gpus, optimizers)
    blocks = math.ceil(gpus / block_ranks)
    held = min(gpus, block_ranks)
    heartbeat = default_heartbeat(held)
    updates = gpus / heartbeat
    per_rank = series_per_rank(optimizers)
    series = gpus * per_rank["always"]
    read = sum(gpus * (optimizers if "optimizer" in r.labels else 1) * (len(STREAK_LADDER) if "min_length" in r.labels
                                                                        else 1) for r in rules["reads"])
    return {"gpus": gpus, "optimizers": optimizers, "nodes": math.ceil(gpus / RANKS_PER_NODE), "blocks": blocks,
            "block_ranks": block_ranks, "held": held, "heartbeat_s": heartbeat, "updates_per_s": updates,
            "per_replica_updates_per_s": held / heartbeat, "storm_updates_per_s": held / NEWS_SPREAD,
            "requests_per_s": {"per-rank": updates, "relay": updates * m["relay_requests_ratio"],
                               "relay_ideal": updates / RANKS_PER_NODE},
            "replica_cores": {"per-rank": held / heartbeat * m["update_cpu_ms"] / 1000,
                              "relay": held / heartbeat * m["update_cpu_ms"] * m["relay_cpu_ratio"] / 1000},
            "series_per_rank": per_rank, "series": series, "samples_per_s": series / SCRAPE_S,
            "series_per_replica": held * per_rank["always"], "rules": rules, "series_read": read,
            "rule_cores": series * m["rule_cpu_us_per_series"] / 1e6 / SCRAPE_S, "measured": m}


def _n(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:,.2f}"


def table(gpus: int = 100_000, optimizers: int = 1) -> list[str]:
    """The Markdown table docs/collector.md shows: a row per figure, without and with the node relay."""
    r = model(gpus, optimizers)
    m, rules, per_rank = r["measured"], r["rules"], r["series_per_rank"]
    def both(cell: float | str) -> str:  # a figure the relay does not change
        text = cell if isinstance(cell, str) else _n(cell)
        return f"{text} | {text}"

    rows = [
        (f"collector replicas for one job: blocks of `BLOCK_RANKS` ({_n(r['block_ranks'])}), one per replica",
         both(r["blocks"])),
        ("ranks per replica; its heartbeat (`default_heartbeat`), s",
         both(f"{_n(r['held'])}; {r['heartbeat_s']:.1f}")),
        ("rank updates per s, healthy: the job / one replica",
         both(f"{_n(r['updates_per_s'])} / {_n(r['per_replica_updates_per_s'])}")),
        ("HTTP requests per s, healthy, the job (the relay: its measured share; 1 in 8 at best)",
         f"{_n(r['requests_per_s']['per-rank'])} | {_n(r['requests_per_s']['relay'])} (at best "
         f"{_n(r['requests_per_s']['relay_ideal'])})"),
        ("a whole-job storm: rank updates per s one replica takes (its ranks' news within `NEWS_SPREAD`)",
         both(r["storm_updates_per_s"])),
        ("collector: CPU per replica, healthy, cores (measured CPU per update x updates)",
         f"{r['replica_cores']['per-rank']:.2f} | {r['replica_cores']['relay']:.2f}"),
        (f"series per rank in `/metrics`, {optimizers} optimizer{'s' if optimizers > 1 else ''} by the contract "
         "(+ only after a skip or on a suspect device)",
         both(f"{_n(per_rank['always'])} (+{per_rank['after_a_skip']})")),
        ("collector: series each replica exposes", both(r["series_per_replica"])),
        (f"scraper (Prometheus in agent mode, vmagent): {r['blocks']} targets; series it scrapes and remote-writes; "
         f"samples per s (a {SCRAPE_S:.0f} s scrape)", both(f"{_n(r['series'])}; {_n(r['samples_per_s'])}")),
        ("central store (VictoriaMetrics, Mimir): active series, the scraped ones + the recording rules' (healthy; at "
         "most)", both(f"{_n(r['series'] + rules['written_healthy'])} ({_n(r['series'] + rules['written'])})")),
        ("rule evaluator (vmalert, Prometheus): rules, recording + alerting, one file for both",
         both(f"{rules['record'] + rules['alert']} ({rules['record']} + {rules['alert']})")),
        (f"rule evaluator: per-rank series its queries read each evaluation; CPU, cores (every {SCRAPE_S:.0f} s, "
         "scaled from Prometheus's measured cost per series)",
         both(f"{_n(r['series_read'])}; {r['rule_cores']:.1f}")),
    ]
    head = [f"| {_n(gpus)} GPUs, one job, {RANKS_PER_NODE} ranks a node ({_n(r['nodes'])} nodes) | one request per "
            "rank | node relay (`AMPWATCH_RELAY=1`) |", "|---|---|---|"]
    measured = (f"Measured inputs: {m['update_cpu_ms']:.2f} ms of collector CPU per healthy update (one collector, "
                f"16,384 ranks, scrapes and the alert pass included); the relay's {m['relay_requests_ratio']:.3f} "
                f"requests and {m['relay_cpu_ratio']:.3f} CPU per update of one request per rank; "
                f"{m['rule_cpu_us_per_series']:.1f} µs of Prometheus CPU per series per evaluation of the rules "
                "(1,024 ranks, 2 optimizers).")
    return [*head, *(f"| {label} | {cells} |" for label, cells in rows), "", measured]


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.model_100k", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=100_000)
    parser.add_argument("--optimizers", type=int, default=1)
    args = parser.parse_args(argv)
    print("\n".join(table(args.gpus, args.optimizers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
