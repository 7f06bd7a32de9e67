"""Two ranks under DistributedDataParallel (NCCL on two GPUs, gloo on CPU), each checked against its own truth.

Rank 1 feeds an input past 65504 at one iteration: DDP's all-reduce carries the inf/NaN gradients to
rank 0, so every optimizer of both ranks skips there. Later rank 0 alone writes a NaN into one gradient
after backward (after the all-reduce): only that rank's optimizer skips and only its scale backs off. Each
rank runs the truth plan with the three ``mixed`` optimizers and compares the agent's counters and events
with its own bit-level ground truth; the parent compares the ranks with each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.gpu._amp import Amp, ThreePart, make_optimizers
from bench.gpu._checks import check, verdict
from bench.gpu._ranks import rank_process, spawn_ranks
from bench.gpu._truth import Plan, compare, drain_events, expected, run_plan

__all__ = ["run"]

WORLD = 2
ALL_SKIP_AT = 3  # rank 1's input overflows
RANK0_SKIP_AT = 5  # rank 0's sgd_fused gradient gets a NaN


def _plan(rank: int) -> Plan:
    return Plan(iterations=8, init_scale=2.0 ** 8,
                overflow_at=(ALL_SKIP_AT,) if rank == 1 else (),
                grad_faults={RANK0_SKIP_AT: [("c.bias", float("nan"), 1)]} if rank == 0 else {})


def _rank(rank: int, backend: str, out_dir: str, port: int) -> None:
    """One rank: run its plan under DDP with the agent attached; write what it saw to ``rank{rank}.json``."""
    from torch.nn.parallel import DistributedDataParallel

    from ampwatch import agent

    with rank_process(rank, WORLD, "cuda" if backend == "nccl" else "cpu", out_dir, port) as (result, device):
        amp = Amp(device)
        torch.manual_seed(0)  # the same initial weights on both ranks (DDP broadcasts rank 0's anyway)
        net = ThreePart().to(device)
        model = DistributedDataParallel(net, device_ids=[rank] if device.type == "cuda" else None)
        optimizers, notes = make_optimizers(net, "mixed", device)
        plan = _plan(rank)
        scaler = amp.scaler(init_scale=plan.init_scale, growth_interval=plan.growth_interval)
        with agent.watch(scaler, optimizers, model=net, collector=(), run="bench-gpu-ddp") as watch:
            run = run_plan(amp, net, model, optimizers, scaler, plan, watch=watch, seed=100 + rank)
        state = watch.snapshot()["state"]
        result.update(problems=compare(run, plan, state, drain_events(watch)), truth=run.truth, notes=notes,
                      expected={k: v for k, v in expected(run, plan).items() if k != "skips"},
                      agent=state)
        dist.barrier()


def run(amp: Amp, quick: bool, timeout: float = 180.0) -> list[dict]:
    """Run the two-rank job (two GPUs, or two CPU processes over gloo) and judge both ranks."""
    if amp.cuda and torch.cuda.device_count() < WORLD:
        return [check("ddp", "two-ranks", "skip", f"needs {WORLD} GPUs, this machine has "
                      f"{torch.cuda.device_count()}: the NCCL job did not run")]
    backend = "nccl" if amp.cuda else "gloo"
    ranks = spawn_ranks(_rank, (backend,), WORLD, timeout, prefix="ampwatch-gpu-ddp-")
    if isinstance(ranks, str):
        return [check("ddp", "two-ranks", "fail", f"{backend}: {ranks}")]
    problems = []
    for r in ranks:
        if "error" in r:
            problems.append(f"rank {r['rank']} crashed: {r['error'].strip().splitlines()[-1]}")
        else:
            problems += [f"rank {r['rank']}: {p}" for p in r["problems"]]
    if not problems:
        for r in ranks:  # the cross-rank facts the plan sets up
            all_skipped = not any(r["truth"][ALL_SKIP_AT].values())
            if not all_skipped:
                problems.append(f"rank {r['rank']}: rank 1's overflow at iteration {ALL_SKIP_AT} did not make every "
                                f"optimizer skip here (truth {r['truth'][ALL_SKIP_AT]})")
        rank0, rank1 = ranks
        if rank0["truth"][RANK0_SKIP_AT]["sgd_fused"] or not rank1["truth"][RANK0_SKIP_AT]["sgd_fused"]:
            problems.append(f"iteration {RANK0_SKIP_AT}: expected only rank 0's sgd_fused to skip, truth rank 0 "
                            f"{rank0['truth'][RANK0_SKIP_AT]}, rank 1 {rank1['truth'][RANK0_SKIP_AT]}")
    summary = "; ".join(f"rank {r['rank']}: backoffs {r['agent']['backoffs']}, scale {r['agent']['loss_scale']:g}, "
                        + ", ".join(f"{n} {c['steps']}/{c['skipped']}" for n, c in r["agent"]["optimizers"].items())
                        for r in ranks if "agent" in r)
    return [verdict("ddp", "two-ranks", problems,
                    f"{backend}, 2 ranks, DDP: an overflow on rank 1 skipped every optimizer on both ranks, a NaN "
                    f"after the all-reduce on rank 0 skipped only there; each rank's counters and events exact "
                    f"({summary})", ranks=ranks)]
