"""Per-iteration cost of skip detection: bare loop vs ampwatch vs Accelerate vs the forum recipe.

Four identical setups (same model, same data, two optimizers, ``GradScaler("cpu")`` + bfloat16 autocast)
live in one process; blocks of iterations rotate between them so machine drift hits all alike, and each
variant's cost is the median of its per-block ratios to the bare block of the same round.

- ``bare``: the loop, nothing else.
- ``ampwatch``: ``ampwatch.agent.watch`` attached, a real collector on loopback, default push interval;
  the loop also asks ``watch.stepped(opt)`` for both optimizers every iteration.
- ``accelerate``: Hugging Face Accelerate's own ``AcceleratedOptimizer`` (its wrapper, not a copy); its
  ``step()`` runs ``scaler.step`` and ``scaler.update`` and reads ``step_was_skipped`` (what
  ``Accelerator.optimizer_step_was_skipped`` returns).
- ``forum``: ``scaler.get_scale()`` before and after ``update()``; a drop means a skip.

Also: host-device syncs (``aten._local_scalar_dense``) per iteration on clean and on skipping iterations,
and whether each method's answer matches the truth in a skip storm, for foreach and fused AdamW; the
agent's whole host CPU per iteration on a tiny model, and its recorder's calls alone (best of 5); what recording
sample ids adds (``watch.batch()``, a followed loader: ``bench/_samples_cost.py``).

    python -m bench.overhead [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from ampwatch_support.syncs import SyncCounter
from bench import ddp_origin
from bench._loops import MODELS, ModelBuilder, compare, pct, rotate
from bench._samples_cost import sample_recording_us

__all__ = ["BF16_VARIANTS", "CLIP_VARIANTS", "VARIANTS", "Setup", "agent_host_cost_us", "agent_hot_path_us", "measure",
           "main"]

VARIANTS = ("bare", "ampwatch", "accelerate", "forum")
"""Compared on CPU. ``bench.gpu`` adds ``ampwatch_unasked``: the agent attached, ``stepped()`` never asked."""
BF16_VARIANTS = ("bf16", "bf16_ampwatch")
"""The same model in bfloat16 autocast without a GradScaler: the bare loop, and the agent watching it
(``watch(None, ...)``: every optimizer step checked for inf/NaN gradients)."""

CLIP_VARIANTS = ("bare_clip", "ampwatch_clip", "bf16_clip", "bf16_ampwatch_clip")
"""What real jobs do before each step, bare and watched (issue 40's spike watch; ``bench.instructions``): per optimizer
``scaler.unscale_(opt)`` (GradScaler loops) and ``clip_grad_norm_`` over its parameters (a max norm no gradient
reaches, so clipping changes nothing); the watched loops hand each norm over with ``watch.grad_norm(norm,
optimizer=opt)``, and the bf16 one its loss with ``watch.loss(loss)`` (with a scaler it goes through
``scaler.scale``). ``ampwatch_norm``, not listed here: the ``ampwatch`` loop watched with ``grad_norm=True`` (the
agent computes each norm)."""
MAX_NORM = 1e9
"""``clip_grad_norm_``'s max norm in the clip loops: far above any norm of these models, so nothing is clipped."""

COMPARED = ("mlp", "transformer")
"""The models every variant is timed on; ``tiny`` only measures the agent's own host cost."""


class Setup:
    """One model, two optimizers, one scaler and one way of telling skips.

    ``model``: a name in :data:`MODELS` or a builder taking the device. On CPU the loop autocasts to
    bfloat16, on a GPU to float16; the scaler is ``GradScaler(<device type>)`` either way.
    """

    def __init__(self, variant: str, model: str | ModelBuilder, fused: bool, collector: str | None | tuple,
                 device: str | torch.device = "cpu") -> None:
        torch.manual_seed(0)
        self.variant = variant
        self.device = torch.device(device)
        bf16 = variant in BF16_VARIANTS or variant.startswith("bf16_")
        self.amp_dtype = torch.bfloat16 if self.device.type == "cpu" or bf16 else torch.float16
        build = MODELS[model] if isinstance(model, str) else model
        self.model, groups, self.loss = build(self.device)
        kw = {"fused": True} if fused else {"foreach": True}
        self.opts = [torch.optim.AdamW(g, lr=1e-4, **kw) for g in groups]
        self.scaler = torch.amp.GradScaler(self.device.type)
        self.storm = False  # when set, the first optimizer's gradients are non-finite (it skips every step)
        first = groups[0][0]
        first.register_hook(lambda g: g * float("inf") if self.storm else g)
        self.skipped: list[bool] = [False, False]  # the method's answer for the last iteration, per optimizer
        self.groups = groups
        self.watch = None
        if bf16:
            self.scaler = None  # a bf16 job: no loss scaling, nothing skips
            if variant in ("bf16_ampwatch", "bf16_ampwatch_clip"):
                from ampwatch import agent
                self.watch = agent.watch(None, {"body": self.opts[0], "head": self.opts[1]}, model=self.model,
                                         collector=collector, run="bench-overhead-bf16")
        elif variant in ("ampwatch", "ampwatch_unasked", "ampwatch_clip", "ampwatch_norm"):
            from ampwatch import agent
            self.watch = agent.watch(self.scaler, {"body": self.opts[0], "head": self.opts[1]}, model=self.model,
                                     collector=collector,
                                     run=f"bench-overhead-{model if isinstance(model, str) else build.__name__}",
                                     **({"grad_norm": True} if variant == "ampwatch_norm" else {}))
        elif variant == "accelerate":
            from accelerate import Accelerator
            from accelerate.optimizer import AcceleratedOptimizer
            # AcceleratedOptimizer reads the process-wide state that this initialises
            Accelerator(cpu=self.device.type == "cpu")
            self.wrapped = [AcceleratedOptimizer(o, device_placement=False, scaler=self.scaler) for o in self.opts]
        # ampwatch_unasked: the bare loop, with the agent attached to the scaler and optimizers it drives
        loops = {"ampwatch_unasked": self._bare, "ampwatch_norm": self._ampwatch, "bf16": self._bf16,
                 "bf16_ampwatch": self._bf16, "bare_clip": self._clip, "ampwatch_clip": self._clip,
                 "bf16_clip": self._bf16_clip, "bf16_ampwatch_clip": self._bf16_clip}
        self.iterate = loops.get(variant) or getattr(self, "_" + variant)

    def _forward_backward(self) -> None:
        for opt in self.opts:
            opt.zero_grad()
        with torch.autocast(self.device.type, dtype=self.amp_dtype):
            loss = self.loss()
        self.scaler.scale(loss).backward()

    def _bare(self, n: int) -> None:
        for _ in range(n):
            self._forward_backward()
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()

    def _bf16(self, n: int) -> None:
        for _ in range(n):
            for opt in self.opts:
                opt.zero_grad()
            with torch.autocast(self.device.type, dtype=self.amp_dtype):
                loss = self.loss()
            loss.backward()
            for opt in self.opts:
                opt.step()

    def _clip(self, n: int) -> None:
        """``bare_clip``, ``ampwatch_clip``: unscale, clip and step each optimizer; watched, hand each norm over."""
        for _ in range(n):
            self._forward_backward()
            for opt, params in zip(self.opts, self.groups, strict=True):
                self.scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                if self.watch is not None:
                    self.watch.grad_norm(norm, optimizer=opt)
                self.scaler.step(opt)
            self.scaler.update()
            if self.watch is not None:
                self.skipped = [self.watch.stepped(opt) is False for opt in self.opts]

    def _bf16_clip(self, n: int) -> None:
        """``bf16_clip``, ``bf16_ampwatch_clip``: clip, step each optimizer; watched, hand the loss and norms over."""
        for _ in range(n):
            for opt in self.opts:
                opt.zero_grad()
            with torch.autocast(self.device.type, dtype=self.amp_dtype):
                loss = self.loss()
            if self.watch is not None:
                self.watch.loss(loss)
            loss.backward()
            for opt, params in zip(self.opts, self.groups, strict=True):
                norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                if self.watch is not None:
                    self.watch.grad_norm(norm, optimizer=opt)
                opt.step()

    def _ampwatch(self, n: int) -> None:
        for _ in range(n):
            self._forward_backward()
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()
            self.skipped = [self.watch.stepped(opt) is False for opt in self.opts]

    def _accelerate(self, n: int) -> None:
        for _ in range(n):
            self._forward_backward()
            for opt in self.wrapped:
                opt.step()  # scaler.step + scaler.update inside, once per optimizer
            self.skipped = [opt.step_was_skipped for opt in self.wrapped]

    def _forum(self, n: int) -> None:
        for _ in range(n):
            self._forward_backward()
            before = self.scaler.get_scale()
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before  # one answer for the iteration, not per optimizer
            self.skipped = [skipped, skipped]

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def _syncs(setup: Setup, n: int) -> float:
    with SyncCounter() as counter:
        setup.iterate(n)
    return counter.syncs / n


def _updates_per_iter(setup: Setup, n: int) -> float:
    scaler, calls = setup.scaler, [0]
    had_own = "update" in vars(scaler)
    inner = scaler.update

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)
    scaler.update = counting
    try:
        setup.iterate(n)
    finally:
        if had_own:
            scaler.update = inner
        else:
            del scaler.update
    return calls[0] / n


def _answers(setup: Setup, n: int) -> dict:
    """Check the method's answers against the truth on ``n`` storm and ``n`` clean iterations."""
    out = {"checked_iterations": n, "storm_flagged": 0, "storm_per_optimizer_right": 0, "clean_false_alarms": 0}
    setup.storm = True
    try:
        for _ in range(n):
            setup.iterate(1)
            out["storm_flagged"] += any(setup.skipped)  # the iteration is seen to have skipped
            out["storm_per_optimizer_right"] += setup.skipped == [True, False]  # truth: first skips, second steps
    finally:
        setup.storm = False
    for _ in range(n):
        setup.iterate(1)
        out["clean_false_alarms"] += any(setup.skipped)
    return out


def measure(model: str, fused: bool, rounds: int, block: int, collector: str | None) -> dict:
    """Time every variant on ``model`` in rotating blocks; count syncs; check answers in a skip storm."""
    setups = {v: Setup(v, model, fused, collector) for v in VARIANTS}
    try:
        for s in setups.values():
            s.iterate(10)  # warm-up (allocator, autocast caches, the agent's first batch)
        # CPU time of the process (the agent's sender thread included) is the primary measure: on a shared
        # machine, wall time also counts the moments another job held the core.
        times, walls = rotate(setups, rounds, block)
        out = {"model": model, "optimizer": "AdamW(fused=True)" if fused else "AdamW(foreach=True)",
               "rounds": rounds, "block": block, "variants": compare(times, walls)}
        for v in VARIANTS:
            entry = out["variants"][v]
            entry["syncs_per_clean_iter"] = _syncs(setups[v], 10)
            setups[v].storm = True
            entry["syncs_per_storm_iter"] = _syncs(setups[v], 10)
            setups[v].storm = False
            if v != "bare":
                entry.update(_answers(setups[v], 20))
        for v in VARIANTS:  # Accelerate updates the scaler inside every wrapped step: once per optimizer
            out["variants"][v]["updates_per_iter"] = _updates_per_iter(setups[v], 5)
        return out
    finally:
        for s in setups.values():
            s.close()


def agent_host_cost_us(rounds: int, block: int, collector: str | None) -> dict:
    """The agent's own host CPU per iteration: watched minus bare on a 4-wide MLP, where compute is tiny."""
    bare, watched = Setup("bare", "tiny", False, collector), Setup("ampwatch", "tiny", False, collector)
    try:
        bare.iterate(20)
        watched.iterate(20)
        diffs, bare_t = [], []
        for i in range(rounds):
            pair = []
            for s in ((bare, watched) if i % 2 == 0 else (watched, bare)):
                start = time.process_time()
                s.iterate(block)
                pair.append(((time.process_time() - start) / block, s is bare))
            b = next(t for t, is_bare in pair if is_bare)
            w = next(t for t, is_bare in pair if not is_bare)
            diffs.append(w - b)
            bare_t.append(b)
        return {"agent_host_us_per_iter": round(statistics.median(diffs) * 1e6, 1),
                "agent_host_us_p25": round(pct(diffs, .25) * 1e6, 1),
                "agent_host_us_p75": round(pct(diffs, .75) * 1e6, 1),
                "tiny_bare_cpu_us_per_iter": round(statistics.median(bare_t) * 1e6, 1)}
    finally:
        bare.close()
        watched.close()


def agent_hot_path_us(repeats: int = 5, n: int = 5000) -> float:
    """Time the recorder's own calls per iteration (two optimizers) on a real, attached recorder; best of repeats."""
    # Noise on a busy machine hides a few microseconds in a whole iteration; the calls alone it cannot hide.
    setup = Setup("ampwatch", "tiny", False, collector=())
    try:
        setup.iterate(2)
        recorder = setup.watch._recorder
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                for record in recorder.records:  # what the step wrapper and pre-hook do on a clean step
                    recorder.before_step(record)
                    recorder.on_optimizer_step(record)
                    recorder.after_step(record)
                recorder.after_update(False)  # what the update wrapper does
            best = min(best, (time.perf_counter() - start) / n)
        return round(best * 1e6, 2)
    finally:
        setup.close()


@contextlib.contextmanager
def _collector() -> Iterator[str]:
    from bench._servers import collector
    with collector() as srv:
        yield srv.url


def run(quick: bool) -> dict:
    """Run the whole overhead section; return its results."""
    torch.set_num_threads(1)  # less scheduler noise on a shared machine; every variant alike
    rounds, block = (8, 10) if quick else (40, 25)
    with _collector() as url:
        results = {"rounds": rounds, "block": block, "collector": "real, loopback, push interval 1 s",
                   "measurements": [measure(m, False, rounds, block, url) for m in COMPARED]}
        results["storm_fused"] = measure("mlp", True, max(4, rounds // 4), block, url)
        results["host_cost"] = agent_host_cost_us(rounds * 2, block * 4, url)
    results["host_cost"]["hot_path_us_per_iter"] = agent_hot_path_us()  # the recorder's calls alone, best of 5
    # watch.batch() per iteration and a followed loader per batch, each beside its baseline in this process
    results["host_cost"]["samples"] = sample_recording_us(*((5, 500, 50) if quick else (15, 2000, 200)))
    results["ddp_origin"] = ddp_origin.run(quick)  # watch(..., ddp=model): the origin hook on a 2-rank DDP loop
    return results


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
