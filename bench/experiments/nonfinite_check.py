"""What checking a step's gradients for inf/NaN costs on CPU, in instructions: the agent's check beside batched ways.

Without a GradScaler the agent checks the gradients of every optimizer step (``check_nonfinite`` in
``ampwatch.agent._poison``). It used to sum each gradient on CPU and add the sums on the host: one
operator call per gradient, which section 1b counted at 2.2-2.6% of the mlp's bf16 iteration, where the
issue asked for 1.5%; this experiment found GradScaler's own kernel cheaper, and the agent now uses it.
It counts, per iteration of the models of ``bench._loops`` (the gradients of both optimizers' parameter
groups, from one real backward), what each way of asking "does any of these hold an inf or a NaN?" costs,
each in a process of its own under callgrind (``bench.instructions``' markers: imports, set-up and a
warm-up of 20 left out):

- ``agent``: the agent's own check (GradScaler's kernel, below, for these float32 gradients);
- ``amp_check``: ``torch._amp_foreach_non_finite_check_and_unscale_`` with an inverse scale of 1, what
  ``scaler.unscale_()`` runs: one call for all the gradients, stored back unchanged; its flag read;
- ``sum_each``: ``t.sum()`` per gradient and the floats added on the host (the agent's check before);
- ``sum_each_unread``: ``t.sum()`` per gradient, never read (the operator calls alone: a floor for any
  way that calls one operator per gradient);
- ``cat_sum``: every gradient flattened, ``torch.cat``, one ``sum``;
- ``foreach_norm``: ``torch._foreach_norm(grads, 1)``, stacked and summed (what a GPU does in one kernel);
- ``foreach_norm_inf``: ``torch._foreach_norm(grads, inf)``, stacked, ``isfinite().all()``;
- ``aten_sum``: ``torch.ops.aten.sum.default`` per gradient (the dispatcher without Python's argument parser);
- ``dot``: ``v.dot(v)`` per flattened gradient (BLAS, no reduction iterator).

    python -m bench.experiments.nonfinite_check [--checks N] [--ways WAY ...] [--out FILE]

About 4 minutes (two callgrind processes at a time).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from bench._before_after import ROOT, store
from bench.instructions import callgrind_instructions, counting_ends, counting_starts

__all__ = ["WAYS", "main", "run"]

MODELS = ("mlp", "transformer")
WAYS = ("agent", "amp_check", "sum_each", "sum_each_unread", "cat_sum", "foreach_norm", "foreach_norm_inf", "aten_sum",
        "dot")
WARMUP = 20


def _ways() -> dict[str, Callable[[list], bool]]:
    import torch

    from ampwatch.agent._poison import KernelFlag, check_nonfinite

    aten_sum = torch.ops.aten.sum.default

    def sum_each(grads: list) -> bool:
        total = 0.0
        for t in grads:
            total += t.sum().tolist()
        return not math.isfinite(total)

    def sum_each_unread(grads: list) -> bool:
        for t in grads:
            t.sum()
        return False

    def aten(grads: list) -> bool:
        total = 0.0
        for t in grads:
            total += aten_sum(t).tolist()
        return not math.isfinite(total)

    def dot(grads: list) -> bool:
        total = 0.0
        for t in grads:
            v = t.reshape(-1)
            total += v.dot(v).tolist()
        return not math.isfinite(total)

    found, one = torch.zeros(1), torch.ones(1)  # never set: these gradients are finite

    def amp_check(grads: list) -> bool:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return bool(found.tolist()[0])

    flag = KernelFlag()
    return {"agent": lambda grads: check_nonfinite(grads, flag).any(), "amp_check": amp_check, "sum_each": sum_each,
            "sum_each_unread": sum_each_unread,
            "cat_sum": lambda grads: not math.isfinite(torch.cat([t.reshape(-1) for t in grads]).sum().tolist()),
            "foreach_norm": lambda grads: not math.isfinite(torch.stack(torch._foreach_norm(grads, 1)).sum().tolist()),
            "foreach_norm_inf": lambda grads: not torch.stack(torch._foreach_norm(grads, math.inf)).isfinite().all()
            .tolist(),
            "aten_sum": aten, "dot": dot}


def _child(way: str, model: str, checks: int) -> None:
    import torch

    from bench._loops import MODELS as BUILDERS

    torch.manual_seed(0)
    _, groups, loss = BUILDERS[model](torch.device("cpu"))
    loss().backward()
    grads = [[p.grad for p in group] for group in groups]
    check = _ways()[way]
    for _ in range(WARMUP):
        for group in grads:
            assert not check(group)
    counting_starts()
    for _ in range(checks):
        for group in grads:
            check(group)
    counting_ends()
    os._exit(0)


def run(checks: int = 100, ways: tuple[str, ...] = WAYS) -> dict:
    """Count each way on each model; return instructions per iteration (every group checked once)."""
    jobs = [(model, way) for model in MODELS for way in ways]
    with tempfile.TemporaryDirectory(prefix="ampwatch-nonfinite-check-") as workdir:
        def count(job: tuple[str, str]) -> int:
            model, way = job
            return callgrind_instructions(["bench.experiments.nonfinite_check", "--child", way, model, str(checks)],
                                          os.path.join(workdir, f"{model}-{way}.cg"), {"PYTHONPATH": ROOT})
        with ThreadPoolExecutor(2) as pool:
            counts = dict(zip(jobs, pool.map(count, jobs), strict=True))
    import torch

    from bench._loops import MODELS as BUILDERS

    result: dict = {"checks": checks, "warmup": WARMUP, "models": {}}
    for model in MODELS:
        groups = BUILDERS[model](torch.device("cpu"))[1]
        gradients = sum(len(g) for g in groups)
        per_iter = {way: round(counts[model, way] / checks) for way in ways}
        result["models"][model] = {"gradients": gradients, "groups": len(groups), "per_iteration": per_iter,
                                   "per_gradient": {way: round(n / gradients) for way, n in per_iter.items()}}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.nonfinite_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--checks", type=int, default=100, help="iterations of checks counted under callgrind")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), metavar="WAY",
                        help=f"count only these ways (default: all of {', '.join(WAYS)})")
    parser.add_argument("--out", help="also store the result under 'nonfinite_check' in this JSON file")
    parser.add_argument("--child", nargs=3, metavar=("WAY", "MODEL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    result = run(args.checks, tuple(args.ways))
    print(f"{'way':<18}" + "".join(f"{m + ' per iteration':>26}{'per gradient':>14}" for m in MODELS))
    for way in result["models"]["mlp"]["per_iteration"]:
        print(f"{way:<18}" + "".join(f"{result['models'][m]['per_iteration'][way]:>26,}"
                                     f"{result['models'][m]['per_gradient'][way]:>14,}" for m in MODELS))
    if args.out:
        store(args.out, "nonfinite_check", result, sys.argv if argv is None else ["", *argv],
              module="experiments.nonfinite_check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
