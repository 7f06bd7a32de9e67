"""Two real ranks over gloo: which rank's own gradients started a skip, in the recipes that hide it.

Run as ``python -m ampwatch_support.origin_worker OUT_DIR PORT``; each rank writes ``OUT_DIR/rank{r}.json`` with,
per scenario, every skip's (or poisoned step's) origin as the watched run reported it, the iterations and
ranks the inf was planted at (the truth), and the digests of the weights after every iteration of the
watched run and of its unwatched twin (the same job, the same data, never watched). Used by
agent/tests/test_origin_across_ranks.py, which owns the time limit, the cleanup and the judging.

Scenarios (each builds its DDP model from one seed on every rank, as a real job does):

- ``unfrozen``: DDP built with every parameter trainable (``find_unused_parameters=True``, as freezing one
  needs); ``extra`` frozen before ``watch()`` and unfrozen at the very iteration whose inf is in its own
  gradient on rank 0; later an inf in it on rank 1; ``head.bias`` frozen from before ``watch()`` to the end.
  ``unfrozen_unscaled``: the same without a scaler.
- ``frozen_later``: every parameter trainable at ``watch()``; ``extra`` frozen later (an inf in the body's
  input on rank 1 meanwhile), then unfrozen again (an inf in its own gradient on rank 0).
- ``micro_sync`` / ``micro_no_sync``: several backwards per step, more than any iteration before, with the
  inf in the first micro-batch (rank 0 in the first iteration, rank 1 in a later one).
- ``many``: 20 parameters all holding the inf on rank 0, named by the watch's ``named_parameters``.
- ``late_hook``: the job's own tensor hooks that make a gradient inf, one registered before ``watch()``
  (rank 1, iteration 1), one after it (rank 0, iteration 3), then the watch closed and a new one made after
  both hooks (rank 0, iteration 5).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampwatch_support.ddp_harness import rank_results

WORLD_SIZE = 2
INF = float("inf")


class Branches(nn.Module):
    """``head(relu(body(x))) + extra(z)``: under a linear loss an inf in ``z`` reaches ``extra.weight``'s gradient
    alone, and an inf in ``x`` never reaches ``extra``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.extra = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x))) + self.extra(z)


def _digest(params) -> str:
    return hashlib.sha256(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                   for p in params)).hexdigest()


def _inputs(rank: int, iteration: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    seed = torch.Generator().manual_seed(1000 * rank + 10 * iteration + micro)
    return torch.randn(3, 6, generator=seed), torch.randn(3, 5, generator=seed)


def _origins(watch) -> list[list]:
    """``[iteration, origin, origin_params, origin_params_total]`` of every skip and poisoned step recorded."""
    return [[e["iteration"], e.get("origin"), e.get("origin_params"), e.get("origin_params_total")]
            for e in watch._recorder.events.drain() if e["kind"] in ("skip", "poisoned_step")]


def _step(model, opt, scaler, loss) -> None:
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def unfrozen(rank: int, watched: bool, scaled: bool = True) -> dict:
    """Frozen at watch(), unfrozen later: at iteration 3 (rank 0's inf in extra's own gradient), 5 (rank 1's)."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = Branches()
    model = DistributedDataParallel(net, find_unused_parameters=True)  # built while extra is trainable
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    net.extra.requires_grad_(False)
    net.head.bias.requires_grad_(False)  # frozen to the end: the watch's forward pre-hook stays until close()
    watch = agent.watch(scaler, opt, collector=(), run="origin", ddp=model) if watched else None
    planted = {3: 0, 5: 1} if scaled else {3: 0}  # without a scaler the inf stays in the weights: one
    digests, pre_hooks = [], [len(model._forward_pre_hooks)]
    for i in range(max(planted) + 1):
        if i == 3:
            net.extra.requires_grad_(True)  # the fine-tuning schedule unfreezes it, before this forward
        x, z = _inputs(rank, i)
        if planted.get(i) == rank:
            z[0, 0] = INF
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, z).float().sum()  # linear: z's inf reaches extra.weight's gradient only
        _step(model, opt, scaler, loss)
        digests.append(_digest(net.parameters()))
    result = _result(watch, planted, digests)
    result["pre_hooks"] = [*pre_hooks, len(model._forward_pre_hooks)]  # at watch(), after close()
    result["hooks_left"] = sum(len(p._backward_hooks or {}) for p in net.parameters())
    return result


def frozen_later(rank: int, watched: bool) -> dict:
    """Trainable at watch(), frozen at iteration 2 (rank 1's inf in the body at 3), unfrozen at 4 (rank 0's at 5)."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = Branches()
    model = DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    watch = agent.watch(scaler, opt, collector=(), run="origin", ddp=model) if watched else None
    planted = {3: 1, 5: 0}
    digests = []
    for i in range(7):
        if i in (2, 4):
            net.extra.requires_grad_(i == 4)
        x, z = _inputs(rank, i)
        if planted.get(i) == rank:
            (x if i == 3 else z)[0, 0] = INF
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, z).float().sum()
        _step(model, opt, scaler, loss)
        digests.append(_digest(net.parameters()))
    return _result(watch, planted, digests)


def micro_batches(rank: int, watched: bool, no_sync: bool) -> dict:
    """Iteration 0: 2 backwards (rank 0's inf in the first); 2: 4 backwards (rank 1's inf in the first); each more
    than any iteration before, so the notes' rows grow while the inf's row is already written."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = Branches()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    watch = agent.watch(scaler, opt, collector=(), run="origin", ddp=model) if watched else None
    planted = {0: 0, 2: 1}
    micros = {0: 2, 1: 1, 2: 4, 3: 1}
    digests = []
    for i, count in micros.items():
        opt.zero_grad(set_to_none=True)
        for m in range(count):
            x, z = _inputs(rank, i, m)
            if planted.get(i) == rank and m == 0:
                x[0, 0] = INF
            sync = model.no_sync() if no_sync and m < count - 1 else contextlib.nullcontext()
            with sync:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x, z).float().pow(2).mean()
                scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        digests.append(_digest(net.parameters()))
    return _result(watch, planted, digests)


def many(rank: int, watched: bool) -> dict:
    """Ten layers (20 parameters), each holding the inf on rank 0 at iteration 1; named ``encoder.<name>``."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(6, 6) for _ in range(10)])
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    given = [(f"encoder.{name}", param) for name, param in net.named_parameters()]
    watch = (agent.watch(scaler, opt, collector=(), run="origin", ddp=model, named_parameters=given)
             if watched else None)
    planted = {1: 0}
    digests = []
    for i in range(3):
        x, _ = _inputs(rank, i)
        if planted.get(i) == rank:
            x[:, 0] = INF  # every row: each layer's weight and bias gradient holds it
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        _step(model, opt, scaler, loss)
        if i in planted:  # the truth: how many reduced gradients hold it (rank 1's own were all finite)
            nonfinite = sum(not bool(torch.isfinite(p.grad).all()) for p in net.parameters())
        digests.append(_digest(net.parameters()))
    result = _result(watch, planted, digests)
    result["given"], result["nonfinite_grads"] = [name for name, _ in given], nonfinite
    return result


def late_hook(rank: int, watched: bool) -> dict:
    """The job's own hooks that make a gradient inf: head.bias's (before watch(): rank 1 at 1), body.bias's (after
    it: rank 0 at 3); at 4 the watch is closed and made again, after both (rank 0 at 5)."""
    from ampwatch import agent

    torch.manual_seed(0)
    net = Branches()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    fires = {"head.bias": {1: 1}, "body.bias": {3: 0, 5: 0}}  # the hook's parameter: {iteration: rank}
    iteration = 0

    def poison(name: str):
        def hook(grad):
            return grad.clone().fill_(INF) if fires[name].get(iteration) == rank else None
        return hook

    net.head.bias.register_hook(poison("head.bias"))
    watch = agent.watch(scaler, opt, collector=(), run="origin", ddp=model) if watched else None
    net.body.bias.register_hook(poison("body.bias"))
    origins: list = []
    digests = []
    for iteration in range(7):
        if iteration == 4 and watch is not None:  # a new watch, made after both hooks, counts from 0 again
            origins += _origins(watch)
            watch.close()
            watch = agent.watch(scaler, opt, collector=(), run="origin", ddp=model)
        x, z = _inputs(rank, iteration)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, z).float().pow(2).mean()
        _step(model, opt, scaler, loss)
        digests.append(_digest(net.parameters()))
    result = _result(watch, {i: r for hooked in fires.values() for i, r in hooked.items()}, digests)
    if watched:
        result["origins"] = origins + [[i + 4, *rest] for i, *rest in result["origins"]]
    return result


def _result(watch, planted: dict[int, int], digests: list[str]) -> dict:
    result = {"planted": planted, "digests": digests}
    if watch is not None:
        result["origins"] = _origins(watch)
        watch.close()
        result["errors"] = watch.snapshot()["state"]["delivery"]["agent_errors"]
    return result


SCENARIOS = {
    "unfrozen": unfrozen,
    "unfrozen_unscaled": lambda rank, watched: unfrozen(rank, watched, scaled=False),
    "frozen_later": frozen_later,
    "micro_sync": lambda rank, watched: micro_batches(rank, watched, no_sync=False),
    "micro_no_sync": lambda rank, watched: micro_batches(rank, watched, no_sync=True),
    "many": many,
    "late_hook": late_hook,
}


def main(rank: int, out_dir: str, port: int) -> None:
    torch.set_num_threads(1)
    with rank_results(rank, WORLD_SIZE, out_dir, port) as results:
        for name, scenario in SCENARIOS.items():
            results[name] = {"watched": scenario(rank, True), "twin": scenario(rank, False)}


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD_SIZE, join=True)
