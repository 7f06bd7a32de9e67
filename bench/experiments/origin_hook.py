"""What naming the origin rank costs per iteration: this tree beside an earlier revision of the agent, in one run.

Each measurement runs in a process of its own holding a one-process gloo DDP group (world size 1: DDP still
buckets the gradients and all-reduces them, and the agent's work does not depend on the world size; no
second process blurs the count) and a loop of ``bench.ddp_origin`` (AdamW, one GradScaler, bfloat16
autocast) on two of its models: ``mlp`` (6 parameters, one bucket) and ``transformer`` (14 parameters,
one bucket). This tree notes each parameter's own gradient with a tensor hook (one call per parameter),
earlier revisions with a comm hook (one call per bucket, in place of DDP's built-in C++ all-reduce).
Variants: ``plain`` (DDP's built-in all-reduce, the agent watching without ``ddp=``), ``python_hook``
(DDP's own ``allreduce_hook`` as a Python comm hook, nothing of ampwatch), ``origin`` (``watch(...,
ddp=model)`` of this tree) and ``origin_before`` (the same, with ``agent/src`` of ``--before REF``,
extracted by ``git archive``, first on the child's path).

1. Instructions per iteration, counted by valgrind's callgrind (exact; ``bench.instructions``' markers:
   set-up, imports and a warm-up left out; valgrind processes two at a time). What ``ddp=model`` costs:
   ``origin`` minus ``plain``, everything included (autograd's and DDP's calls of the hook, the hook, the
   notes' zeroing; for the comm hook also DDP running a Python hook instead of its C++ all-reduce).
2. The agent's own CPU time per iteration (``bench.ddp_origin.HookClock``: the thread CPU time of its hook
   calls and of its ``end_iteration``; for the comm hook, whose calls run the all-reduce, minus that of
   ``python_hook``'s calls of ``allreduce_hook`` in the same child), as a share of ``plain``'s process CPU
   time per iteration, all from the same child (rotating blocks); beside it the whole iterations' CPU time
   of ``origin`` and ``python_hook`` against ``plain`` (noisier). Noisier than the count on a shared machine.

    python -m bench.experiments.origin_hook [--before REF] [--iterations N] [--rounds R] [--store]

``--store`` keeps the result in ``bench/experiments/results/origin_hook_before_after.json`` (``python -m bench --render
docs/benchmarks.json`` then shows it as section 8). About 20-40 minutes on the shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench._before_after import ROOT, source_of, store
from bench.instructions import callgrind_instructions, counting_ends, counting_starts

__all__ = ["run", "main"]

MODELS = ("mlp", "transformer")
WARMUP = 20
STORED = os.path.join(ROOT, "bench", "experiments", "results", "origin_hook_before_after.json")


def _group() -> None:
    from bench.ddp_origin import one_process_group

    one_process_group()


def _count_child(variant: str, model: str, iterations: int) -> None:
    from bench.ddp_origin import DdpSetup

    _group()
    setup = DdpSetup(model, origin=variant.startswith("origin"), python_hook=variant == "python_hook", clock=False)
    setup.iterate(WARMUP)
    counting_starts()
    setup.iterate(iterations)
    counting_ends()
    os._exit(0)  # what is left (closing, tearing down) would only run instrumented, many times slower


def _time_child(model: str, rounds: int, block: int) -> dict:
    from ampwatch import agent
    from bench._loops import rotate
    from bench.ddp_origin import DdpSetup, own_per_iteration

    _group()
    setups = {"plain": DdpSetup(model, origin=False), "python_hook": DdpSetup(model, origin=False, python_hook=True),
              "origin": DdpSetup(model, origin=True)}
    try:
        for s in setups.values():
            s.iterate(WARMUP)
        for name in ("python_hook", "origin"):
            setups[name].clock.reset()
        cpu, _ = rotate(setups, rounds, block)
        timed = {name: setups[name].clock.per_iteration_us(rounds * block) for name in ("python_hook", "origin")}
        own = own_per_iteration(timed["origin"], timed["python_hook"])
        cpu_us = {name: statistics.median(times) * 1e6 for name, times in cpu.items()}
        plain_us = cpu_us["plain"]
        return {"agent": agent.__file__, "plain_cpu_us_per_iter": round(plain_us, 1),
                "python_hook_cpu_us_per_iter": round(cpu_us["python_hook"], 1),
                "origin_cpu_us_per_iter": round(cpu_us["origin"], 1),
                "origin_iter_ratio_to_plain": round(statistics.median(
                    o / p for o, p in zip(cpu["origin"], cpu["plain"], strict=True)), 4),
                "python_hook_iter_ratio_to_plain": round(statistics.median(
                    h / p for h, p in zip(cpu["python_hook"], cpu["plain"], strict=True)), 4),
                "hook_calls": timed,
                "hook_own_us_per_iter": own["own_us_per_iter"],
                "hook_own_us_per_iter_median_call": own["own_us_per_iter_median_call"],
                "timer_us_per_call_taken_off": timed["origin"]["timer_us_per_call_taken_off"],
                "calls_per_iter": timed["origin"]["calls_per_iter"],
                "hook_own_share_of_plain_iter": round(own["own_us_per_iter"] / plain_us, 5)}
    finally:
        for s in setups.values():
            s.close()


def _env(agent_src: str | None) -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [agent_src, ROOT]))}


def _timed(agent_src: str | None, model: str, rounds: int, block: int) -> dict:
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_")}, OMP_NUM_THREADS="1",
               **_env(agent_src))
    done = subprocess.run([sys.executable, "-m", "bench.experiments.origin_hook", "--child-time", model, str(rounds),
                           str(block)],
                          env=env, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(before: str | None, iterations: int = 50, rounds: int = 20, block: int = 50) -> dict:
    """Count instructions of each variant on each model, then time the agent's own work (before and after,
    alternating)."""
    with tempfile.TemporaryDirectory(prefix="ampwatch-origin-hook-") as workdir:
        old = source_of(before, workdir, "agent/src") if before else None
        sources = {"plain": None, "python_hook": None, "origin": None}
        if old:
            sources["origin_before"] = old
        jobs = [(model, name) for model in MODELS for name in sources]

        def count(job: tuple[str, str]) -> int:
            model, name = job
            return callgrind_instructions(["bench.experiments.origin_hook", "--child-count", name, model,
                                           str(iterations)],
                                          os.path.join(workdir, f"{model}-{name}.cg"), _env(sources[name]))
        with ThreadPoolExecutor(2) as pool:
            counts = dict(zip(jobs, pool.map(count, jobs), strict=True))
        instructions = {}
        for model in MODELS:
            per_iter = {name: round(counts[model, name] / iterations) for name in sources}
            instructions[model] = {
                "per_iter": per_iter,
                "ratio_to_plain": {name: round(n / per_iter["plain"], 4) for name, n in per_iter.items()},
                "over_plain": {name: per_iter[name] - per_iter["plain"] for name in per_iter if name != "plain"}}
        timing: dict[str, dict[str, list[dict]]] = {}
        for model in MODELS:
            timing[model] = {"after": [], **({"before": []} if old else {})}
            for _ in range(3):  # alternate the two revisions, three times each: the same load on both
                for side in timing[model]:
                    timing[model][side].append(_timed(old if side == "before" else None, model, rounds, block))
    return {"models": list(MODELS), "world_size": 1, "backend": "gloo", "before": before,
            "instructions": {"iterations": iterations, "warmup": WARMUP, "models": instructions},
            "timing": {"rounds": rounds, "block": block, "runs": timing,
                       "median": {model: {side: median_run(runs) for side, runs in sides.items()}
                                  for model, sides in timing.items()}}}


def median_run(runs: list[dict]) -> dict:
    """The run whose share of the plain iteration is the median (its figures kept together)."""
    ordered = sorted(runs, key=lambda r: r["hook_own_share_of_plain_iter"])
    middle = ordered[len(ordered) // 2]
    calls = middle["hook_calls"]
    return dict({k: middle[k] for k in ("hook_own_us_per_iter", "hook_own_share_of_plain_iter", "plain_cpu_us_per_iter",
                                        "origin_iter_ratio_to_plain", "python_hook_iter_ratio_to_plain")},
                calls_per_iter=middle["calls_per_iter"],
                origin_calls_us_per_iter=calls["origin"]["call_us_per_iter"],
                origin_end_iteration_us_per_iter=calls["origin"]["end_iteration_us_per_iter"],
                python_hook_calls_us_per_iter=calls["python_hook"]["call_us_per_iter"])


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON (``--store``: also keep them in the JSON file)."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.origin_hook", description=__doc__.split("\n")[0])
    parser.add_argument("--before", metavar="REF", help="the earlier revision whose agent/src is measured beside")
    parser.add_argument("--iterations", type=int, default=50, help="iterations counted under callgrind")
    parser.add_argument("--rounds", type=int, default=20, help="rotating rounds of 50 iterations, timed")
    parser.add_argument("--store", action="store_true", help=f"keep the result in {os.path.relpath(STORED, ROOT)}")
    parser.add_argument("--child-count", nargs=3, metavar=("VARIANT", "MODEL", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--child-time", nargs=3, metavar=("MODEL", "ROUNDS", "BLOCK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_count:
        _count_child(args.child_count[0], args.child_count[1], int(args.child_count[2]))
        return 0
    if args.child_time:
        model, rounds, block = args.child_time
        print(json.dumps(_time_child(model, int(rounds), int(block))))
        return 0
    result = run(args.before, args.iterations, args.rounds)
    if args.store:
        store(STORED, "origin_hook", result, sys.argv if argv is None else ["", *argv])
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
