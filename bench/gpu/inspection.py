"""Inspection: what an inspected skip over 10,000 parameter tensors costs, next to GradScaler's own inf check.

One SGD (foreach) owns 10,000 tensors of 64 floats; gradients are copied in (no forward/backward: only
the scaler and the agent are timed), three of them poisoned. Timed, device synchronised before and after:
a clean ``step`` + ``update``; a skipping one bare (GradScaler's own check: unscale, inf check, its sync);
and the same skip watched by a fresh agent, whose first skip of a streak is always inspected. Syncs are
counted over the skip bare and watched (expected: the inspection adds two bounded copies, a flag per
tensor, then the counts of the named). The skip event
must name exactly the three poisoned tensors.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from bench.gpu._amp import Amp
from bench.gpu._checks import check, verdict
from bench.gpu._syncs import count_syncs, sync_method
from bench.gpu._truth import drain_events

__all__ = ["run"]


class ManyTensors:
    """``n`` parameter tensors under one optimizer, with gradients set by copy and some poisoned."""

    def __init__(self, amp: Amp, n: int) -> None:
        self.amp = amp
        gen = torch.Generator().manual_seed(0)
        self.params = [nn.Parameter(torch.randn(64, generator=gen).to(amp.device)) for _ in range(n)]
        self.names = [(f"blocks.{i}.weight", p) for i, p in enumerate(self.params)]
        self.grads = [torch.randn(64, generator=gen).to(amp.device) for _ in range(n)]
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g.clone()
        self.poison = {17: float("inf"), n // 2: float("nan"), n - 1: float("inf")}
        self.optimizer = torch.optim.SGD(self.params, lr=1e-3, foreach=True)
        self.scaler = self.fresh_scaler()

    def fresh_scaler(self) -> torch.amp.GradScaler:
        """A new scaler at 2**8 whose scale tensor exists (as after the first ``scale(loss)``)."""
        scaler = self.amp.scaler(init_scale=2.0 ** 8)
        scaler.scale(torch.ones((), device=self.amp.device))
        return scaler

    def iteration(self, poisoned: bool, after_step=lambda: None) -> None:
        """Set gradients (poisoned or not), then ``scaler.step`` and ``scaler.update``."""
        torch._foreach_copy_([p.grad for p in self.params], self.grads)
        if poisoned:
            for i, value in self.poison.items():
                self.params[i].grad.view(-1)[0] = value
        self.scaler.step(self.optimizer)
        after_step()
        self.scaler.update()

    def timed(self, poisoned: bool) -> float:
        """Seconds one iteration takes, device work included."""
        self.amp.sync()
        start = time.perf_counter()
        self.iteration(poisoned)
        self.amp.sync()
        return time.perf_counter() - start

    def expected_params(self) -> list[dict]:
        return [{"name": f"blocks.{i}.weight", "inf": int(v == float("inf")), "nan": int(v != v)}
                for i, v in sorted(self.poison.items())]


def run(amp: Amp, quick: bool) -> list[dict]:
    """Time and count an inspected skip against the bare skip; check the names it reports."""
    from ampwatch import agent

    n = 10_000 if amp.cuda or not quick else 2_000
    repeats = 3 if quick else 9
    many = ManyTensors(amp, n)
    many.iteration(False)  # warm-up: foreach kernels, the optimizer's first step
    clean = [many.timed(False) for _ in range(repeats)]
    bare_skip = []
    for _ in range(repeats):
        many.scaler = many.fresh_scaler()
        bare_skip.append(many.timed(True))
    many.scaler = many.fresh_scaler()
    bare_syncs = count_syncs(amp.cuda, lambda: many.iteration(True))
    watched_skip, watched_syncs, problems, inspected = [], [], [], 0
    for r in range(repeats + 1):  # the last repeat counts syncs instead of timing
        many.scaler = many.fresh_scaler()
        watch = agent.watch(many.scaler, {"blocks": many.optimizer}, named_parameters=many.names, collector=(),
                            run="bench-gpu-inspection")
        try:
            many.iteration(False)  # the agent's first iteration (its first scale read) is not the one timed
            if r < repeats:
                watched_skip.append(many.timed(True))
            else:
                watched_syncs.append(count_syncs(amp.cuda, lambda: many.iteration(True)))
        finally:
            watch.close()
        skips = [e for e in drain_events(watch) if e["kind"] == "skip"]
        if len(skips) != 1:
            problems.append(f"repeat {r}: {len(skips)} skip events, truth 1")
            continue
        event = skips[0]
        if not event.get("inspected"):
            continue
        inspected += 1
        if event["params"] != many.expected_params() or event["params_total"] != len(many.poison):
            problems.append(f"repeat {r}: agent named {event['params']} (total {event['params_total']}), "
                            f"truth {many.expected_params()}")
    if inspected != repeats + 1:
        problems.append(f"only {inspected} of {repeats + 1} first skips were inspected")
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in
          (("clean_step_ms", clean), ("bare_skip_ms", bare_skip), ("watched_skip_ms", watched_skip))}
    extra = watched_syncs[0] - bare_syncs
    names = verdict("inspection", "names-at-scale", problems,
                    f"{n:,} tensors, 3 poisoned: every inspected skip named exactly those 3, with counts")
    cost = check("inspection", "cost", "info",
                 f"{n:,} tensors, median of {repeats}: clean step+update {ms['clean_step_ms']} ms; skip bare "
                 f"(GradScaler's own inf check) {ms['bare_skip_ms']} ms; skip watched and inspected "
                 f"{ms['watched_skip_ms']} ms (+{ms['watched_skip_ms'] - ms['bare_skip_ms']:.3f} ms); syncs over "
                 f"the skip: bare {bare_syncs}, watched {watched_syncs[0]} ({extra:+d}; expected +2: a bounded copy "
                 f"of one flag per tensor, then the counts of the first 16 flagged"
                 f"{'' if amp.cuda else '; on CPU neither is a sync'}; {sync_method(amp.cuda)})",
                 tensors=n, repeats=repeats, bare_syncs=bare_syncs, watched_syncs=watched_syncs[0], **ms)
    return [names, cost]
