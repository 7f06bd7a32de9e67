"""A watched AMP job that checkpoints every K iterations and can kill itself: one incarnation of a resumed run.

Run it once fresh with ``--kill-after M`` (it SIGKILLs itself once the collector has seen iteration M),
then again with ``--resume``: it builds new objects, watches them, loads the last checkpoint (so the scale
jumps outside ``update()``: a restore) and trains to ``--iterations``. Each incarnation appends its ground
truth to ``--truth`` as JSON lines: per iteration, which optimizers changed their parameters (bit
patterns) and the scaler's scale before and after ``update()``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request

import torch
from torch import nn

from ampwatch import agent

OVERFLOW = {2, 3, 9, 14, 15, 16, 22}  # global iterations whose gradients get an inf
ONLY_A = {5, 19}  # global iterations where only optimizer "a"'s gradients get an inf


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opts = {"a": torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9),
            "b": torch.optim.AdamW(model[2].parameters(), lr=0.01)}
    scheds = {n: torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.8) for n, o in opts.items()}
    return model, opts, scheds, torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)


def bits(params):
    return [p.detach().view(torch.int32).clone() for p in params]


def seen_iteration(collector: str, run: str) -> int:
    """The iteration the collector holds for this process's rank (-1 before its first batch)."""
    try:
        with urllib.request.urlopen(f"{collector}/v1/runs/{run}", timeout=5) as answer:
            ranks = json.load(answer)["ranks"]
    except OSError:
        return -1
    return max((r["iteration"] for r in ranks if r["pid"] == os.getpid()), default=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--collector", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--truth", required=True)
    parser.add_argument("--iterations", type=int, default=26)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every K iterations")
    parser.add_argument("--kill-after", type=int, help="SIGKILL this process once iteration M reached the collector")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    model, opts, scheds, scaler = build()
    watch = agent.watch(scaler, opts, model=model, schedulers=scheds, collector=args.collector, run=args.run,
                        push_interval=0.2)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        scaler.load_state_dict(checkpoint["scaler"])  # after watch(): a restore, never a backoff or growth
        for name in opts:
            opts[name].load_state_dict(checkpoint["opt"][name])
            scheds[name].load_state_dict(checkpoint["sched"][name])
        start = checkpoint["iteration"]
    truth = open(args.truth, "a")
    truth.write(json.dumps({"incarnation_start": start, "scale": scaler.get_scale()}) + "\n")
    done_here = 0
    for it in range(start, args.iterations):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(it))
        for opt in opts.values():
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if it in OVERFLOW or it in ONLY_A:
            model[0].weight.grad.view(-1)[0] = float("inf")
        if it in OVERFLOW:
            model[2].bias.grad.view(-1)[0] = float("nan")
        stepped = {}
        for name, opt in opts.items():
            params = [p for g in opt.param_groups for p in g["params"]]
            before = bits(params)
            scaler.step(opt)
            stepped[name] = any(not torch.equal(b, p.detach().view(torch.int32))
                                for b, p in zip(before, params, strict=True))
        scale_before = scaler.get_scale()
        scaler.update()
        for sched in scheds.values():
            sched.step()  # unconditionally: the common bug ampwatch counts
        truth.write(json.dumps({"iteration": it, "stepped": stepped, "before": scale_before,
                                "after": scaler.get_scale()}) + "\n")
        truth.flush()
        done_here += 1
        if (it + 1) % args.every == 0:
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict(), "iteration": it + 1,
                        "opt": {n: o.state_dict() for n, o in opts.items()},
                        "sched": {n: s.state_dict() for n, s in scheds.items()}}, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        if args.kill_after is not None and it + 1 == args.kill_after:
            truth.close()
            deadline = time.monotonic() + 60
            while seen_iteration(args.collector, args.run) < done_here and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit flush: a crash
    truth.close()
    watch.close()


if __name__ == "__main__":
    main()
