"""What ``make bench`` runs, in the page's order: each benchmark's module, what it measures and how long it takes.

``python -m bench --list`` prints it (with the seconds each section took in the last full run, where
``docs/benchmarks.json`` recorded them), then the hand-run experiments under ``bench/experiments/``, each
with its docstring's first line. ``bench/__main__.py`` runs the sections named here, so the list cannot
drift from what runs.
"""

from __future__ import annotations

import ast
import json
import os
from typing import NamedTuple

__all__ = ["BENCHMARKS", "EXPERIMENTS", "GPU", "Benchmark", "experiments", "listing"]

_BENCH = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.join(_BENCH, "experiments")


class Benchmark(NamedTuple):
    """One section of ``python -m bench``: its name (``--only NAME``), the module that measures it, what it
    measures, and about how long it takes in a full run and with ``--quick`` on a shared 2-core machine."""

    name: str
    module: str
    measures: str
    full: str
    quick: str
    in_quick: bool = True
    parts: tuple[str, ...] = ()
    """Other modules this section runs (each also runnable alone with ``python -m``)."""


BENCHMARKS = (
    Benchmark("overhead", "bench.overhead",
              "training-iteration CPU time with the agent vs a bare loop, Accelerate and the get_scale recipe; "
              "host-device syncs; right answers in a skip storm; the DDP origin hook (bench.ddp_origin)",
              "about 2 min", "about 45 s", parts=("bench.ddp_origin",)),
    Benchmark("instructions", "bench.instructions",
              "the agent's overhead in CPU instructions per iteration, counted exactly under valgrind's callgrind; "
              "the forward probes of began, armed, on the transformer rows; the loss and gradient norm watched "
              "(issue 40's spike pairs, alone: python -m bench.instructions --spikes)",
              "about 25 min", "about 2 min (only with --only instructions)", in_quick=False),
    Benchmark("inspection", "bench.inspection",
              "cost of naming the offending parameters of a skip on models with many tensors, vs GradScaler's "
              "own inf check, and skip storms on such models", "about 2.5 min", "about 1 min"),
    Benchmark("ingest", "bench.ingest",
              "collector ingest throughput and latency at 64-4,096 ranks vs the Prometheus Pushgateway, "
              "same load; saturation rate", "about 3 min", "about 30 s"),
    Benchmark("scrape", "bench.scrape",
              "/metrics time and size at N ranks, plain and gzipped, vs the Pushgateway; memory per rank",
              "about 1 min", "about 15 s"),
    Benchmark("footprint", "bench.footprint",
              "collector database growth per rank-hour at a 1 s push interval, bytes per stored event",
              "about 1.5 min", "about 20 s"),
    Benchmark("healthy", "bench.healthy",
              "a healthy run's wire bytes per rank-hour and collector CPU per rank-second at the default heartbeat, "
              "today's batches beside issue 40's (loss and gradient-norm levels), all at once on fresh collectors",
              "about 2.5 min", "about 45 s"),
    Benchmark("tail", "bench.tail",
              "where the ingest tail at 1,024 ranks goes: GC pauses, event-loop lag, commit time, alert tick; "
              "default vs tuned collector", "about 1 min", "about 20 s"),
    Benchmark("replicas", "bench.replicas",
              "a 16,384-rank job (even spread and lockstep) on one collector and on 2 replicas, each pinned to a core "
              "of its own, ranks placed by the contract's rule, and one replica alone with its share: ingest p99, "
              "first skips in /metrics, streak alerts per replica and together, the cores the collectors, the job "
              "simulation and other jobs used",
              "about 20 min", "about 3 min (2,048 ranks in 2 blocks, even spread; only with --only replicas)",
              in_quick=False),
)
"""``make bench`` (``python -m bench``) runs these in this order; ``make bench-gpu`` runs ``bench.gpu`` apart."""

GPU = Benchmark("gpu", "bench.gpu",
                "on a GPU: the agent's counters against bit-level ground truth, host-device syncs, overhead, "
                "inspection, two DDP ranks (--device cpu --quick is a CPU smoke run)", "under 5 min", "about 1 min")

def experiments() -> list[tuple[str, str]]:
    """``(module, first line of its docstring)`` of each hand-run benchmark: every public module under
    ``bench/experiments/``."""
    names = [f"bench.experiments.{name[:-3]}" for name in sorted(os.listdir(EXPERIMENTS))
             if name.endswith(".py") and not name.startswith("_")]
    found = []
    for module in names:
        with open(os.path.join(os.path.dirname(_BENCH), *module.split(".")) + ".py") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        found.append((module, doc.split("\n")[0]))
    return found


def _last_run(path: str) -> dict[str, float]:
    """Seconds per section of the run stored at ``path``, where it recorded them (runs since ``section_s``)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("section_s", {})


def listing(last_run_json: str) -> str:
    """The text ``python -m bench --list`` prints."""
    took = _last_run(last_run_json)
    lines = ["make bench (python -m bench) runs, in this order (times on a quiet 2-core machine; a loaded one takes "
             "two or three times longer):", ""]
    for b in (*BENCHMARKS, GPU):
        if b is GPU:
            lines += ["make bench-gpu (python -m bench.gpu) runs on a machine with a GPU:", ""]
        last = f"; last full run {took[b.name]:.0f} s" if b.name in took else ""
        lines += [f"  {b.name:<13} python -m {b.module}", f"  {'':<13} {b.measures}",
                  f"  {'':<13} full: {b.full}{last}; --quick: {b.quick}", ""]
    lines += ["Run by hand (not in make bench; python -m MODULE --help; bench/README.md):", ""]
    lines += [f"  {module}\n  {'':<13} {what}" for module, what in experiments()]
    return "\n".join(lines)
