"""What watching a compiled optimizer step costs: PyTorch's compiled-optimizer recipe, watched and not, per backend.

The recipe compiles a function that calls ``opt.step()`` (here AdamW with a tensor learning rate, the
recipe's way to avoid recompiles). Watched (``watch(None, ...)``, a bf16 job), the agent's step pre-hook
runs outside the compiled graphs (``ampwatch.agent._compiled``: a graph break before the step's own
graphs) and checks every step's gradients. Two identical jobs per backend (eager, aot_eager, inductor) live
in one process, the compiled step of each compiled for it; blocks of iterations rotate between them
(``bench._loops.rotate``), and each figure is the median of per-round ratios, watched over unwatched:

- ``step``: the compiled step alone (the call of the compiled function), CPU time;
- ``iteration``: the whole iteration (forward and backward under bf16 autocast, then the step), CPU time.

The eager step (not compiled) of the same job, watched and not, is measured beside them for reference.

    python -m bench.experiments.compiled_step [--model mlp] [--rounds N] [--block N] [--out FILE]

About 15 seconds on a 2-core machine (inductor compiles C++ once per job; faster once its cache holds them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch._dynamo

from bench._before_after import store
from bench._loops import MODELS, compare, pct, rotate

__all__ = ["BACKENDS", "main", "run"]

BACKENDS = ("eager", "aot_eager", "inductor")


class Job:
    """One model, one AdamW over all its parameters, a bf16 loop; ``backend`` None: the step is not compiled."""

    def __init__(self, model: str, backend: str | None, watched: bool) -> None:
        from ampwatch import agent

        torch.manual_seed(0)
        self.model, groups, self.loss = MODELS[model](torch.device("cpu"))
        self.opt = torch.optim.AdamW([p for g in groups for p in g], lr=torch.tensor(1e-4))
        self.watch = agent.watch(None, {"net": self.opt}, model=self.model, collector=(),
                                 run="bench-compiled-step") if watched else None
        opt = self.opt
        self.step = torch.compile(lambda: opt.step(), backend=backend) if backend is not None else opt.step
        self.step_times: list[float] = []  # CPU seconds of the step alone, per iteration of the last block

    def iterate(self, n: int) -> None:
        self.step_times = []
        for _ in range(n):
            self.opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.loss()
            loss.backward()
            start = time.process_time()
            self.step()
            self.step_times.append(time.process_time() - start)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def _measure(model: str, backend: str | None, rounds: int, block: int) -> dict:
    jobs = {"bare": Job(model, backend, False), "watched": Job(model, backend, True)}
    try:
        for job in jobs.values():
            job.iterate(10)  # compiles, then warms up
        steps: dict[str, list[float]] = {name: [] for name in jobs}

        class _Timed:  # records each block's step-only time beside rotate's whole-iteration time
            def __init__(self, name: str) -> None:
                self.name = name

            def iterate(self, n: int) -> None:
                jobs[self.name].iterate(n)
                steps[self.name].append(statistics.fmean(jobs[self.name].step_times))

        cpu, wall = rotate({name: _Timed(name) for name in jobs}, rounds, block)
        step_ratios = [w / b for w, b in zip(steps["watched"], steps["bare"], strict=True)]
        state = jobs["watched"].watch.snapshot()["state"]
        return {"backend": backend or "not compiled",
                "step_us": {name: round(statistics.median(t) * 1e6, 1) for name, t in steps.items()},
                "step_ratio": round(statistics.median(step_ratios), 4),
                "step_ratio_p25": round(pct(step_ratios, .25), 4), "step_ratio_p75": round(pct(step_ratios, .75), 4),
                "iteration": compare(cpu, wall)["watched"],
                "checked_steps": state["optimizers"]["net"]["steps"],
                "agent_errors": state["delivery"]["agent_errors"]}
    finally:
        for job in jobs.values():
            job.close()


def run(model: str = "mlp", rounds: int = 30, block: int = 20) -> dict:
    """Measure every backend, then the eager step; return the results."""
    torch.set_num_threads(1)  # less scheduler noise on a shared machine; both jobs alike
    torch._dynamo.config.recompile_limit = 64  # every job's step compiled for it, however many jobs
    results = []
    for backend in (*BACKENDS, None):
        torch._dynamo.reset()
        results.append(_measure(model, backend, rounds, block))
    return {"model": model, "rounds": rounds, "block": block, "optimizer": "AdamW(lr=tensor)", "threads": 1,
            "backends": results}


def main(argv: list[str] | None = None) -> int:
    """Run, print a line per backend and, with ``--out``, store the result."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.compiled_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--out", help="store the result in this JSON file (bench/experiments/results/...)")
    args = parser.parse_args(argv)
    result = run(args.model, args.rounds, args.block)
    for row in result["backends"]:
        print(f"{row['backend']:>12}: step {row['step_us']['bare']:8.1f} -> {row['step_us']['watched']:8.1f} us, "
              f"x{row['step_ratio']:.3f} [{row['step_ratio_p25']:.3f}-{row['step_ratio_p75']:.3f}]; iteration "
              f"x{row['iteration']['ratio']:.3f} [{row['iteration']['ratio_p25']:.3f}-"
              f"{row['iteration']['ratio_p75']:.3f}]; {row['checked_steps']} steps checked, "
              f"{row['agent_errors']} agent errors")
    if args.out:
        store(args.out, "compiled_step", result, sys.argv, "experiments.compiled_step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
