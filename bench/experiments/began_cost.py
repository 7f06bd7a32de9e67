"""What ``began`` costs a healthy iteration: this tree's agent beside an earlier revision's, counted in instructions.

``began`` (docs/agent.md, "Where it began") notes every loss that goes through ``scaler.scale()`` (a wrapper
call and a ``detach()``) and hands the iteration's notes on at ``update()`` (or each step without a scaler);
nothing else runs on a healthy iteration. This counts it exactly: ``bench.instructions``' loops (the same
model, data, optimizers and markers as ``make bench``'s section 1b, one compute thread), each in a process of its
own under valgrind's callgrind, with ``agent/src`` of ``--before REF`` (extracted by ``git archive``, first on the
child's path) and with this tree's; the bare loops once, for scale. Rows: the mlp under a GradScaler (where a
fixed per-iteration cost weighs most, and where ``scaler.scale`` is wrapped), and the mlp and the transformer
block in bf16 without a scaler (the loop passes no ``watch.loss``).

    python -m bench.experiments.began_cost [--before REF] [--iterations N] [--store]

``--store`` keeps the result in ``bench/experiments/results/began_cost.json``. About 10-15 minutes on the shared
2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench._before_after import ROOT, source_of, store
from bench.instructions import callgrind_instructions

__all__ = ["ROWS", "main", "run"]

ROWS = (("mlp", False, "bare", "ampwatch"), ("mlp", False, "bf16", "bf16_ampwatch"),
        ("transformer", False, "bf16", "bf16_ampwatch"))
"""(model, fused, bare variant, watched variant) of ``bench.instructions.CASES`` counted before and after."""
BEFORE = "270066c"  # the base of issue 39's began: the agent before it
STORED = os.path.join(ROOT, "bench", "experiments", "results", "began_cost.json")


def _count(variant: str, model: str, fused: bool, iterations: int, agent_src: str | None, workdir: str,
           side: str) -> int:
    out = os.path.join(workdir, f"{side}-{variant}-{model}-{int(fused)}.cg")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [agent_src, ROOT]))}
    return callgrind_instructions(["bench.instructions", "--child", variant, model, str(int(fused)),
                                   str(iterations)], out, env=env)


def run(before: str = BEFORE, iterations: int = 200) -> dict:
    """Count each row's bare loop once and its watched loop with the agent before and after (two at a time)."""
    with tempfile.TemporaryDirectory(prefix="ampwatch-began-") as workdir, ThreadPoolExecutor(2) as pool:
        agent_before = source_of(before, workdir, "agent/src")
        jobs = {}
        for model, fused, bare, watched in ROWS:
            key = (model, fused, bare)
            jobs[(*key, "bare")] = pool.submit(_count, bare, model, fused, iterations, None, workdir, "bare")
            jobs[(*key, "before")] = pool.submit(_count, watched, model, fused, iterations, agent_before, workdir,
                                                 "before")
            jobs[(*key, "after")] = pool.submit(_count, watched, model, fused, iterations, None, workdir, "after")
        rows = []
        for model, fused, bare, _ in ROWS:
            counts = {side: jobs[(model, fused, bare, side)].result() / iterations
                      for side in ("bare", "before", "after")}
            rows.append({"model": model, "optimizer": "AdamW(fused=True)" if fused else "AdamW(foreach=True)",
                         "precision": "GradScaler" if bare == "bare" else "bf16, no scaler",
                         "bare_per_iter": round(counts["bare"]), "before_per_iter": round(counts["before"]),
                         "after_per_iter": round(counts["after"]),
                         "began_per_iter": round(counts["after"] - counts["before"]),
                         "began_share_of_bare": round((counts["after"] - counts["before"]) / counts["bare"], 5)})
    return {"before": before, "iterations": iterations, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.began_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit whose agent to compare with (%(default)s)")
    parser.add_argument("--iterations", type=int, default=200, help="measured iterations per loop")
    parser.add_argument("--store", action="store_true", help=f"keep the result in {os.path.relpath(STORED, ROOT)}")
    args = parser.parse_args(argv)
    result = run(args.before, args.iterations)
    print(json.dumps(result, indent=1))
    if args.store:
        store(STORED, "began_cost", result, sys.argv, module="experiments.began_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
