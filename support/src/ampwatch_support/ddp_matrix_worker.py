"""Real DDP over gloo: every configuration trained watched (``ddp=model``) and unwatched, compared bit for bit.

Run as ``python -m ampwatch_support.ddp_matrix_worker OUT_DIR PORT``: one process group
for the whole matrix. Each configuration builds its DDP model twice from the same seed, trains it on the
same data, first watched then as the twin without ampwatch, and records each run's weights (a digest of
their bits, after the iteration where the watched run closes its watch, and at the end) and, watched,
the origin of every skip before the close. ``OUT_DIR/rank{r}.json`` holds ``{configuration: result}``;
agent/tests/test_ddp_bit_identity.py owns the time limit, the cleanup and the judging.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.ddp_harness import rank_results

WORLD_SIZES = (2, 3, 4)  # one process per rank of the largest; the others run over a group of the first ranks
COMPILED_AT = 2  # torch.compile's configurations run at this world size only (compiling is what costs)
ITERATIONS = 6
CLOSE_AT = 4  # the watched run closes its watch before this iteration and trains on
SHORT_BY = 1  # under join(), the last rank runs out of inputs this many iterations early (after CLOSE_AT)
HOOKS = ("none", "allreduce", "fp16_compress", "bf16_compress", "powersgd")
JOINS = ("none", "initial", "active")  # join(divide_by_initial_world_size=True / False)


UNSUPPORTED = {
    "PowerSGD with find_unused_parameters or static_graph": "the reducer all-reduces its map of used parameters "
    "while PowerSGD's chained all-reduces run: on gloo the two orders differ between ranks and the job aborts "
    "(a collective mismatch), with or without ampwatch",
    "join() with static_graph and find_unused_parameters together": "a rank that has joined and the others "
    "all-reduce different things: the job aborts on gloo (a collective mismatch), with or without ampwatch",
}
"""Configurations torch itself cannot train here: left out of the matrix, with why."""


def plants(world_size: int, index: int) -> dict[int, int]:
    """Iteration -> the rank whose input holds an inf: two different ranks, varying with the configuration."""
    first = index % world_size
    return {1: first, 3: (first + 1) % world_size}


def eager_configurations() -> list[str]:
    names = [f"view={v:d} static={s:d} unused={u:d} join={j} hook={h}"
             for v, s, u, j, h in itertools.product((0, 1), (0, 1), (0, 1), JOINS, HOOKS)
             if not (h == "powersgd" and (u or s)) and not (j != "none" and u and s)]  # UNSUPPORTED
    return names + ["accumulate=sync", "accumulate=no_sync"]


def parse(name: str) -> dict[str, str]:
    return dict(part.split("=") for part in name.split())


class Net(nn.Module):
    """Two layers; with ``spare`` a third that never takes a gradient (for find_unused_parameters / static_graph)."""

    def __init__(self, spare: bool) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _digest(params) -> str:
    return hashlib.sha256(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                   for p in params)).hexdigest()


def _register_hook(model: DistributedDataParallel, hook: str, group) -> None:
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook == "bf16_compress":
        # registered by name DDP wants CUDA or XPU; called from a hook of one's own, gloo runs it
        model.register_comm_hook(group, _bf16_compress)
    elif hook != "none":
        model.register_comm_hook(group, getattr(default_hooks, f"{hook}_hook"))


def _bf16_compress(state, bucket):
    return default_hooks.bf16_compress_hook(state, bucket)


def train(rank: int, world_size: int, group, name: str, index: int, *, watched: bool, compiled: str = "") -> dict:
    """Train configuration ``name`` once over ``group`` (None: the world); return its digests and, watched, the
    origins of its skips."""
    from ampwatch import agent

    options = parse(name)
    spare = options.get("unused") == "1" or options.get("static") == "1"
    torch.manual_seed(0)
    net = Net(spare)
    model = DistributedDataParallel(net, process_group=group, init_sync=False,  # the same seed on every rank
                                    gradient_as_bucket_view=options.get("view") == "1",
                                    static_graph=options.get("static") == "1",
                                    find_unused_parameters=options.get("unused") == "1")
    _register_hook(model, options.get("hook", "none"), group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    # grad_norm=True: the spike watch's own pass over the gradients runs too, and must change nothing either.
    w = agent.watch(scaler, opt, collector=(), run="matrix", ddp=model, grad_norm=True) if watched else None
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    join = options.get("join", "none")
    iterations = ITERATIONS - (SHORT_BY if join != "none" and rank == world_size - 1 else 0)
    planted = plants(world_size, index)
    micro = 2 if "accumulate" in options else 1
    result: dict = {"iterations": iterations, "planted": planted}
    joined = model.join(divide_by_initial_world_size=join == "initial") if join != "none" else contextlib.nullcontext()
    with joined:
        for i in range(iterations):
            if i == CLOSE_AT:
                result["at_close"] = _digest(net.parameters())
                if w is not None:
                    result["skips"] = [(e["iteration"], e.get("origin"), e.get("origin_params"))
                                       for e in w._recorder.events.drain() if e["kind"] == "skip"]
                    result["errors"] = w.snapshot()["state"]["delivery"]["agent_errors"]
                    w.close()
                    result["hooks_left"] = sum(len(p._backward_hooks or {}) for p in net.parameters())
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1000 * rank + 10 * i + m))
                if planted.get(i) == rank and m == 0:  # accumulation: the first micro-batch only
                    x[0, 0] = float("inf")
                sync = contextlib.nullcontext()
                if options.get("accumulate") == "no_sync" and m < micro - 1:
                    sync = model.no_sync()
                with sync:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = forward(x).float().pow(2).mean()
                    with _compiled_autograd(compiled):
                        scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    result["final"] = _digest(net.parameters())
    return result


def _compiled_autograd(compiled: str):
    if compiled != "python_reducer":
        return contextlib.nullcontext()
    return torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager"))


def main(rank: int, out_dir: str, port: int) -> None:
    torch.set_num_threads(1)
    with rank_results(rank, max(WORLD_SIZES), out_dir, port) as results:
        for world_size in WORLD_SIZES:  # each over a process group of its own: the first world_size ranks
            group = None if world_size == max(WORLD_SIZES) else dist.new_group(list(range(world_size)))
            if rank < world_size:
                results[world_size] = _matrix(rank, world_size, group, compiled=world_size == COMPILED_AT)
            dist.barrier()


def _matrix(rank: int, world_size: int, group, compiled: bool) -> dict:
    results = {}
    for index, name in enumerate(eager_configurations()):
        results[name] = {"watched": train(rank, world_size, group, name, index, watched=True),
                         "twin": train(rank, world_size, group, name, index, watched=False)}
    if compiled:
        import torch._dynamo as dynamo

        for index, mode in enumerate(("ddp_optimizer", "python_reducer")):
            dynamo.config.optimize_ddp = mode
            name = f"compiled={mode}"
            results[name] = {"watched": train(rank, world_size, group, name, index, watched=True, compiled=mode),
                             "twin": train(rank, world_size, group, name, index, watched=False, compiled=mode)}
        dynamo.config.optimize_ddp = True
    return results


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=max(WORLD_SIZES), join=True)
