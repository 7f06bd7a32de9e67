"""What naming the origin rank costs: a 2-process gloo DDP loop with and without ``watch(..., ddp=model)``.

Each rank holds three identical DDP models (same weights, same data, each with its own optimizer and
GradScaler), all watched by the agent without a collector. ``plain``: DDP's built-in C++ all-reduce.
``python_hook``: DDP's own ``allreduce_hook`` registered as a Python comm hook, nothing of ampwatch
(what any Python comm hook costs, and what the agent's earlier comm hook replaced the built-in with).
``origin``: ``ddp=model``: a tensor hook per parameter notes its own gradient, DDP's built-in all-reduce
runs as in ``plain``. Blocks of iterations rotate between them (``bench._loops.rotate``) in the same order
on both ranks; the cost is the median of per-round ratios of rank 0's process CPU time to ``plain`` (noisy:
it includes waiting on the other rank). Steadier: the agent's own work (:class:`HookClock`: the thread CPU
time of its hook calls and of its end of iteration) as a share of the plain iteration. Also: host-device
syncs (``aten._local_scalar_dense``) per clean iteration.

    python -m bench.ddp_origin [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.syncs import SyncCounter
from bench._loops import MODELS, compare, rotate

__all__ = ["DdpBf16Setup", "DdpSetup", "one_process_group", "run", "main"]

WORLD_SIZE = 2
COMPARED = ("mlp", "transformer")


class HookClock:
    """Time, per iteration, the agent's hook calls and its end of iteration (thread CPU time).

    Two designs are timed alike, so that a run can put this tree beside an earlier revision:
    :meth:`on_local`, this tree's tensor hooks (one call per parameter, beside DDP's own reduction, which
    stays as in ``plain``), and :meth:`on_origin`, the comm hook of revisions before it (one call per
    bucket, in place of DDP's built-in all-reduce: its own cost is its calls minus those of ``allreduce_hook``
    as a Python hook, :meth:`around`). ``end_iteration`` is timed too (it zeroes the notes, on the training
    thread). Counts the calling thread's CPU time (``time.thread_time``), not the wall clock: on a machine
    shared with other jobs a call's wall time also counts the time another job held the core. One timer
    call's own cost, measured at start, is taken off each timed call; what calls a hook (autograd's dispatch
    into Python, DDP's) is outside the timed call, and counted only by the instructions of
    ``bench.experiments.origin_hook``.
    """

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.ends: list[float] = []
        self.timer_s = _timer_cost()
        self.replaces_reduction = False  # True for a comm hook: its calls include the all-reduce it runs

    def around(self, hook):  # type: ignore[no-untyped-def]
        """Return the comm hook ``hook`` timed, to register on a model (unannotated, as DDP wants)."""
        timed = self._timed(hook)

        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks a hook's parameter names
            return timed(state, bucket)
        return timed_hook

    def _timed(self, hook):  # type: ignore[no-untyped-def]
        calls, timer_s, clock = self.calls, self.timer_s, time.thread_time

        def timed(*args):  # type: ignore[no-untyped-def]
            start = clock()
            try:
                return hook(*args)
            finally:
                calls.append(clock() - start - timer_s)
        return timed

    def on_watch(self, ddp: DistributedDataParallel, watch) -> HookClock:  # type: ignore[no-untyped-def]
        """Time what ``watch(..., ddp=ddp)`` put on the model, whichever revision of the agent made it."""
        local = getattr(watch._recorder, "origin", None)
        if hasattr(local, "_handles"):
            return self.on_local(local)
        return self.on_origin(ddp)

    def on_local(self, local) -> HookClock:  # type: ignore[no-untyped-def]
        """Put the agent's tensor hooks on again, each timed, and time its ``end_iteration`` (benchmarks only)."""
        for handle in local._handles:
            handle.remove()
        local._handles.clear()
        untimed = local._hook
        local._hook = lambda slot: self._timed(untimed(slot))
        local.attach()
        local.bench_clock = self
        _time_method(type(local), "end_iteration", "ends")
        return self

    def on_origin(self, ddp: DistributedDataParallel) -> HookClock:
        """Time the earlier revisions' comm hook registered on ``ddp`` (its whole call) and its flags' end."""
        hook = ddp._comm_hooks[0][0]
        hook.bench_clock = hook.flags.bench_clock = self
        self.replaces_reduction = True
        _time_method(type(hook), "__call__", "calls")
        _time_method(type(hook.flags), "end_iteration", "ends")
        return self

    def reset(self) -> None:
        self.calls.clear()
        self.ends.clear()

    def per_iteration_us(self, iterations: int) -> dict:
        """The hook's CPU time per iteration (mean, and median call x calls per iteration), and the end's."""
        calls = len(self.calls) / iterations
        return {"calls_per_iter": calls, "replaces_reduction": self.replaces_reduction,
                "call_us_per_iter": round(sum(self.calls) / iterations * 1e6, 2),
                "call_us_per_iter_median_call": round(statistics.median(self.calls) * calls * 1e6, 2),
                "end_iteration_us_per_iter": round(sum(self.ends) / iterations * 1e6, 2),
                "timer_us_per_call_taken_off": round(self.timer_s * 1e6, 3)}


def own_per_iteration(origin: dict, python_hook: dict) -> dict:
    """The agent's own CPU time per iteration: its calls and end of iteration, minus ``python_hook``'s calls
    where its hook replaced DDP's all-reduce (the earlier comm hook, whose calls include that all-reduce)."""
    replaced = origin.get("replaces_reduction", True)
    return {"own_us_per_iter": round(origin["call_us_per_iter"] + origin["end_iteration_us_per_iter"]
                                     - (python_hook["call_us_per_iter"] if replaced else 0.0), 2),
            "own_us_per_iter_median_call": round(origin["call_us_per_iter_median_call"]
                                                 + origin["end_iteration_us_per_iter"]
                                                 - (python_hook["call_us_per_iter_median_call"] if replaced
                                                    else 0.0), 2)}


def _time_method(cls: type, name: str, into: str) -> None:
    untimed = getattr(cls, name)
    if getattr(untimed, "bench_timed", False):
        return
    clock = time.thread_time

    def record(this, start: float) -> None:  # type: ignore[no-untyped-def]
        bench = getattr(this, "bench_clock", None)  # None: an instance no clock was put on
        if bench is not None:
            getattr(bench, into).append(clock() - start - bench.timer_s)

    if name == "__call__":
        def timed(this, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks a hook's parameter names
            start = clock()
            try:
                return untimed(this, state, bucket)
            finally:
                record(this, start)
    else:
        def timed(this, *args, **kwargs):  # type: ignore[no-untyped-def]
            start = clock()
            try:
                return untimed(this, *args, **kwargs)
            finally:
                record(this, start)
    timed.bench_timed = True  # type: ignore[attr-defined]
    setattr(cls, name, timed)


def _timer_cost(n: int = 2000) -> float:
    """The CPU time one ``time.thread_time`` call adds to a timed interval (median of ``n`` back-to-back pairs)."""
    costs = []
    for _ in range(n):
        start = time.thread_time()
        costs.append(time.thread_time() - start)
    return statistics.median(costs)


class DdpSetup:
    """One DDP model, one optimizer, one GradScaler, watched by the agent (with the origin hook or not)."""

    def __init__(self, model: str, origin: bool, python_hook: bool = False, clock: bool = True) -> None:
        from ampwatch import agent

        torch.manual_seed(0)
        net = _build(model)
        self.ddp = DistributedDataParallel(net)
        self.clock = HookClock() if clock and (origin or python_hook) else None
        if python_hook:  # DDP's all-reduce as a Python comm hook, nothing of ampwatch in it
            self.ddp.register_comm_hook(None, self.clock.around(allreduce_hook) if self.clock else allreduce_hook)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3, foreach=True)
        self.scaler = torch.amp.GradScaler("cpu")
        self.x = _input(model)
        extra = {"ddp": self.ddp} if origin else {"model": net}
        self.watch = agent.watch(self.scaler, {"net": self.opt}, collector=(), run=f"bench-ddp-{model}", **extra)
        if origin and self.clock:
            self.clock.on_watch(self.ddp, self.watch)

    def iterate(self, n: int) -> None:
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.ddp(self.x).float().pow(2).mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()

    def close(self) -> None:
        self.watch.close()


class DdpBf16Setup:
    """One DDP model and one AdamW in bfloat16 autocast without a GradScaler: bare, or watched by the agent.

    ``watched``: ``agent.watch(None, {"net": opt}, model=net, ddp=ddp)`` (every step's gradients checked for
    inf/NaN, and each parameter's own gradient noted by a tensor hook before DDP's all-reduce); no collector.
    """

    def __init__(self, model: str, watched: bool, fused: bool = False) -> None:
        torch.manual_seed(0)
        net = _build(model)
        self.ddp = DistributedDataParallel(net)
        kw = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3, **kw)
        self.x = _input(model)
        self.watch = None
        if watched:
            from ampwatch import agent
            self.watch = agent.watch(None, {"net": self.opt}, model=net, ddp=self.ddp, collector=(),
                                     run=f"bench-ddp-bf16-{model}")

    def iterate(self, n: int) -> None:
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.ddp(self.x).float().pow(2).mean()
            loss.backward()
            self.opt.step()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def one_process_group() -> None:
    """Start a gloo process group of this process alone (world size 1: DDP still buckets and all-reduces)."""
    torch.set_num_threads(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _build(model: str) -> nn.Module:
    # bench._loops' models, as one module DDP can wrap (its transformer is a ModuleDict of block and head).
    if model == "transformer":
        block = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
        return nn.Sequential(block, nn.Linear(64, 8))
    return MODELS[model](torch.device("cpu"))[0]


def _input(model: str) -> torch.Tensor:
    return torch.randn(8, 16, 64) if model == "transformer" else torch.randn(32, 64)


def _measure(model: str, rounds: int, block: int) -> dict:
    setups = {"plain": DdpSetup(model, False), "python_hook": DdpSetup(model, False, python_hook=True),
              "origin": DdpSetup(model, True)}
    try:
        for s in setups.values():
            s.iterate(10)  # warm-up (DDP's bucket rebuild, autocast caches)
        clocks = {name: setups[name].clock for name in ("origin", "python_hook")}
        for clock in clocks.values():
            clock.reset()
        cpu, wall = rotate(setups, rounds, block)
        result = {"model": model, "variants": compare(cpu, wall, base="plain")}
        iterations = rounds * block
        # The agent's own CPU time, timed around its hook calls and its end of iteration: steadier than a
        # difference of two noisy loop times.
        timed = {name: clock.per_iteration_us(iterations) for name, clock in clocks.items()}
        own = own_per_iteration(timed["origin"], timed["python_hook"])
        plain_s = result["variants"]["plain"]["cpu_us_per_iter"] / 1e6
        result.update(note_us_per_iter=own["own_us_per_iter"],
                      note_us_per_iter_median_call=own["own_us_per_iter_median_call"],
                      calls_per_iter=timed["origin"]["calls_per_iter"], hook_calls=timed,
                      note_share_of_plain_iter=round(own["own_us_per_iter"] / 1e6 / plain_s, 5))
        for name, s in setups.items():
            with SyncCounter() as counter:
                s.iterate(block)
            result["variants"][name]["syncs_per_clean_iter"] = counter.syncs / block
        return result
    finally:
        for s in setups.values():
            s.close()


def _rank(rank: int, port: int, out: str, rounds: int, block: int) -> None:
    os.environ.pop("AMPWATCH_URL", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = [_measure(model, rounds, block) for model in COMPARED]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        dist.barrier()  # neither rank tears gloo down while the other still talks
    finally:
        dist.destroy_process_group()


def run(quick: bool) -> dict:
    """Spawn the two ranks, time both variants on each model; return rank 0's results."""
    rounds, block = (8, 20) if quick else (40, 50)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank, args=(port, out, rounds, block), nprocs=WORLD_SIZE, join=True)
        with open(out) as f:
            measurements = json.load(f)
    return {"rounds": rounds, "block": block, "world_size": WORLD_SIZE, "backend": "gloo",
            "measurements": measurements}


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.ddp_origin", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="under a minute")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
