"""Run the benchmarks: ``python -m bench [--quick] [--only SECTION ...] [--merge]`` (``make bench``).

``python -m bench --list`` says what each section measures and how long it takes (``bench/_catalogue.py``).

Full run: about 55 minutes on a 2-core machine (25 of them under valgrind, 20 for the 2 replicas); writes
``docs/benchmarks.md`` and ``docs/benchmarks.json``.
``--quick`` (about two minutes) writes ``artifacts/bench-quick.md`` and ``.json`` unless ``--out`` is given.
``--only SECTION --merge`` re-measures one section into an earlier run's page, e.g. after changing the agent's scan:
``python -m bench --only inspection --merge`` (the page says which sections were re-measured, and when).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata

from bench import footprint, healthy, ingest, inspection, instructions, overhead, replicas, report, scrape, tail
from bench._catalogue import BENCHMARKS, listing
from bench.report._hand_written import carry_over

SECTIONS = tuple(b.name for b in BENCHMARKS)
FULL_ONLY = tuple(b.name for b in BENCHMARKS if not b.in_quick)  # left out of --quick unless asked for with --only
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NOTES = [
    "- Everything runs on this machine over loopback: a real collector (`python -m ampwatch.server`), the "
    "Debian `prometheus-pushgateway` as people run it (in memory, no persistence file), and the load "
    "generator `bench/_loadgen.py` in a process of its own (uvloop, bodies from templates; it reports its "
    "own CPU and how late its sends were, so a slow generator would show).",
    "- Same information per update: the collector gets a protocol v1 batch (two optimizers' steps, skips, "
    "streaks, scale, backoffs, growths, iteration, a skip and a backoff event every 50th batch); the "
    "Pushgateway gets the same counters as a text-format group per rank (`PUT /metrics/job/<run>/rank/<rank>`). "
    "The collector also validates, deduplicates and commits every batch to SQLite (synchronous=FULL) before "
    "answering; the Pushgateway keeps it in memory only.",
    "- Server CPU and memory: utime+stime from `/proc/<pid>/stat` over the load, VmRSS/VmHWM from "
    "`/proc/<pid>/status`.",
    "- Agent overhead: CPU time of the training process, not wall time, is the primary measure, since "
    "on a shared machine the wall clock also counts time another job held the core; wall ratios are shown "
    "too. Host-device syncs are counted as `aten._local_scalar_dense` calls (each is a sync on a GPU; on "
    "CPU they are cheap but counted alike). Accelerate: its own `AcceleratedOptimizer` wrapper (accelerate "
    "installed in the venv by `make bench`), given the CPU GradScaler; its `step()` runs `scaler.step` and "
    "`scaler.update()` per optimizer, so two optimizers update the scale twice per iteration.",
    "- Skip storm: the first optimizer's gradients are made non-finite every iteration (a hook multiplies "
    "them by inf); the truth is then 'first optimizer skipped, second stepped'.",
    "- The models are deliberately tiny (iterations of a few milliseconds on CPU) so that the agent's fixed "
    "host cost per iteration shows; in absolute terms it is tens of microseconds per iteration, which is "
    "under 1% of any iteration longer than a few milliseconds (GPU training steps are usually far longer).",
    "- One collector needs roughly 0.3-0.6 ms of CPU per update (column *server CPU us/update*), so on this "
    "shared 2-core machine it sustains about 2,000-2,500 updates/s: 4,096 ranks at a 1 s interval are past "
    "that (ranks skip slots; nothing is lost since counters are cumulative). The agent's default delivery "
    "(news at once, a heartbeat every 15 s, `AMPWATCH_PUSH_INTERVAL`) offers one update per rank per 15 s "
    "instead: 16,384 ranks are about 1,100 updates/s (section *fleet*).",
    "- Saturation runs keep 32 requests in flight; the collector answers only after its group commit's fsync, "
    "so its back-to-back rate is bounded by commit latency as much as by CPU.",
]


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "accelerate", "fastapi", "uvicorn", "pydantic", "prometheus-client", "uvloop",
                 "httptools"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    import sqlite3
    import subprocess
    out["sqlite"] = sqlite3.sqlite_version
    try:
        answer = subprocess.run([scrape._servers.PUSHGATEWAY, "--version"], capture_output=True, text=True,
                                timeout=10)
        first = (answer.stdout + answer.stderr).splitlines() or ["?"]  # it prints its version on stderr
        out["pushgateway"] = first[0].split("version ")[-1].split(" ")[0]
    except OSError:
        out["pushgateway"] = "not installed"
    return out


def _environment() -> dict:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
            "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2 ** 20, 1), "kernel": platform.release(),
            "loadavg_start": round(os.getloadavg()[0], 2), "versions": _versions()}


def _section(name: str, quick: bool) -> object:
    if name == "overhead":
        return overhead.run(quick)
    if name == "ingest":
        if quick:
            return ingest.run((64, 1024), 3, saturate_levels=(1024,), saturate_seconds=3)
        return ingest.run()
    if name == "scrape":
        return scrape.run((1, 1024), 3) if quick else scrape.run()
    if name == "footprint":
        return footprint.run(64, 3, 8, skip_every=2) if quick else footprint.run()
    if name == "healthy":
        return healthy.run(1024, 2, 1) if quick else healthy.run()
    if name == "instructions":
        return instructions.run(50 if quick else 200)
    if name == "inspection":
        return inspection.run(quick)
    if name == "replicas":
        return replicas.run(2048, quick, 1024, lockstep=False, alone=False) if quick else replicas.run()
    return [tail.profile(1024, 4 if quick else 10, tuned) for tuned in (False, True)]


def _write_page(path: str, page: str) -> None:
    """Write ``page`` at ``path``, keeping the hand-written blocks of the page there (``bench/README.md``)."""
    earlier = None
    if os.path.exists(path):
        with open(path) as f:
            earlier = f.read()
    page = carry_over(page, earlier)
    with open(path, "w") as f:
        f.write(page)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, then write the JSON results and the Markdown page."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="say what each benchmark measures and how long it takes")
    parser.add_argument("--quick", action="store_true", help="about two minutes; short runs, wide spread")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    parser.add_argument("--render", metavar="JSON", help="only re-render the page of an earlier run's JSON")
    parser.add_argument("--out", metavar="PREFIX",
                        help="write PREFIX.md and PREFIX.json (default docs/benchmarks, or artifacts/bench-quick)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other sections of PREFIX.json (an earlier run) and replace only those run now")
    args = parser.parse_args(argv)
    if args.list:
        print(listing(os.path.join(ROOT, "docs", "benchmarks.json")))
        return 0
    prefix = args.out or os.path.join(ROOT, "artifacts/bench-quick" if args.quick else "docs/benchmarks")
    earlier_run = None
    if args.merge:
        if not args.only:
            parser.error("--merge needs --only SECTION: it replaces those sections of an earlier run")
        if not os.path.exists(prefix + ".json"):
            parser.error(f"--merge: {prefix}.json does not exist; run the whole benchmark first")
        with open(prefix + ".json") as f:
            earlier_run = json.load(f)
    if args.render:
        with open(args.render) as f:
            earlier = json.load(f)
        earlier["notes"] = NOTES
        _write_page(os.path.splitext(args.render)[0] + ".md", report.render(earlier, os.path.basename(args.render)))
        return 0
    started = time.perf_counter()
    results: dict = {"command": "python -m bench" + " ".join([""] + (argv if argv is not None else sys.argv[1:])),
                     "quick": args.quick, "environment": _environment(), "notes": NOTES}
    chosen = args.only or [name for name in SECTIONS if not (args.quick and name in FULL_ONLY)]
    for name in chosen:
        print(f"bench: {name} ...", flush=True)
        t = time.perf_counter()
        try:
            results[name] = _section(name, args.quick)
        except Exception as exc:  # one failed section must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)
        print(f"bench: {name} done in {time.perf_counter() - t:.0f} s", flush=True)
    results["environment"]["loadavg_end"] = round(os.getloadavg()[0], 2)
    results["duration_s"] = round(time.perf_counter() - started, 1)
    if earlier_run is not None:  # the page stays the earlier run's, with these sections re-measured
        env = results["environment"]
        stamp = {"command": results["command"], "date": env["date"], "duration_s": results["duration_s"],
                 "loadavg_start": env["loadavg_start"], "loadavg_end": env["loadavg_end"], "versions": env["versions"]}
        for name in chosen:
            earlier_run[name] = results[name]
            earlier_run.setdefault("remeasured", {})[name] = stamp
        earlier_run["notes"] = NOTES
        results = earlier_run
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(results, f, indent=1)
    page = report.render(results, os.path.basename(prefix) + ".json")
    _write_page(prefix + ".md", page)
    print(page.split("## 1.")[0])
    print(f"bench: wrote {prefix}.md and {prefix}.json in {time.perf_counter() - started:.0f} s")
    failed = [name for name in chosen if isinstance(results.get(name), dict) and "error" in results[name]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
