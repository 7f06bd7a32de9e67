"""Cost of inspecting skips on models with many parameter tensors (issue 11, item 5).

Part 1, one inspected skip, for three shapes of float32 gradients (10,000 x 16, 10,000 x 4,096 and
100 x 1,048,576 elements), with one offending gradient and with every gradient offending (an overflow
that backward spread), all in one process, one compute thread, rotating order:

- ``gradscaler``: ``GradScaler._unscale_grads_`` with an inverse scale of 1, what ``scaler.unscale_()``
  (or ``scaler.step``) runs to find inf/NaN: group the gradients by device and dtype, then one
  ``_amp_foreach_non_finite_check_and_unscale_`` per group. ``gradscaler_kernel``: that kernel alone.
- ``names``: the agent's scan naming the skipping optimizer's gradients (``scan_optimizers``), what an
  inspected skip costs. ``weights``: its check of the weights at a streak start (stage 1 only when they
  are clean); a streak start does both.
- ``before_names``, ``before_streak_start``: the scan the agent had before (copied below, unchanged),
  gradients only, and gradients with weights as it ran at a streak start.

Part 2, skip storms: a 10,000-tensor model whose skips alternate with steps, watched (real collector on
loopback) against unwatched; per-iteration CPU time of the process, median of per-round ratios.

    python -m bench.inspection [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ampwatch.agent._params import MAX_NAMED_PARAMS, NonfiniteReport, ParameterNames, scan_optimizers
from bench._loops import pct

__all__ = ["SHAPES", "STORMS", "skip_cost", "storm", "run", "main"]

SHAPES = ((10_000, 16), (10_000, 4_096), (100, 1 << 20))
"""(tensors, elements per tensor): the shapes issue 11 measured."""

STORMS = ("mlp", "mlp-2opt", "tiny-tensors")
"""Skip-storm models: see :class:`_Storm`."""


# ----- the 'before' baseline: the agent's scan until this change, copied unchanged -------------------
# (agent/src/ampwatch/agent/_device.py nonfinite_counts and _params.py scan_optimizers at a5cacc5).
# Kept here only to measure against; the agent does not use it.

def _before_plain(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce()._values() if grad.is_sparse else grad


def _before_nonfinite_counts(tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int]]:
    counts: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None and t.numel() and (t.is_floating_point() or t.is_complex()):
            by_device.setdefault(t.device, []).append(i)
    with torch.no_grad():
        for indices in by_device.values():
            parts = []
            for i in indices:
                t = _before_plain(tensors[i].detach())
                parts.append(torch.stack([torch.isinf(t).sum(), torch.isnan(t).sum()]))
            rows = torch.stack(parts).cpu().tolist()
            for i, (n_inf, n_nan) in zip(indices, rows, strict=True):
                counts[i] = (int(n_inf), int(n_nan))
    return counts


def _before_report(named: list[tuple[str, tuple[int, int]]]) -> NonfiniteReport:
    bad = [(name, n_inf, n_nan) for name, (n_inf, n_nan) in named if n_inf or n_nan]
    return NonfiniteReport(
        params=[{"name": n, "inf": i, "nan": m} for n, i, m in bad[:MAX_NAMED_PARAMS]], total=len(bad))


def before_scan(optimizers: Sequence[torch.optim.Optimizer], names: ParameterNames, *,
                grads: bool = True, weights: bool = False) -> list[tuple[NonfiniteReport | None,
                                                                          NonfiniteReport | None]]:
    """The agent's scan before this change (baseline only)."""
    labels: list[str] = []
    tensors: list[torch.Tensor | None] = []
    spans: list[tuple[int, int]] = []
    for optimizer in optimizers:
        start = len(labels)
        for g, group in enumerate(optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                labels.append(names.name(param, g, j))
                tensors.append(param.grad if grads else None)
                tensors.append(param if weights else None)
        spans.append((start, len(labels)))
    counts = _before_nonfinite_counts(tensors)
    grad_counts, weight_counts = counts[0::2], counts[1::2]
    result = []
    for start, end in spans:
        span = list(range(start, end))
        result.append((
            _before_report([(labels[i], grad_counts[i]) for i in span]) if grads else None,
            _before_report([(labels[i], weight_counts[i]) for i in span]) if weights else None,
        ))
    return result

# ----- part 1: one inspected skip --------------------------------------------------------------------


def _gradients(n: int, numel: int) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(numel)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(numel)
    return params, torch.optim.SGD(params, lr=0.1)


def skip_cost(n: int, numel: int, rounds: int, before: bool = True) -> dict:
    """Time one inspected skip over ``n`` gradients of ``numel`` elements against GradScaler's own check."""
    params, opt = _gradients(n, numel)
    scaler = torch.amp.GradScaler("cpu")
    names = ParameterNames((f"layer{i}.weight", p) for i, p in enumerate(params))
    inv_scale, found_inf = torch.ones(()), torch.zeros(1)
    grads = [p.grad for p in params]
    variants: dict[str, Callable[[], object]] = {
        "gradscaler": lambda: scaler._unscale_grads_(opt, inv_scale, found_inf, False),
        "gradscaler_kernel": lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale),
        "names": lambda: scan_optimizers([(opt, "grads")], names),
        "weights": lambda: scan_optimizers([(opt, "weights")], names),
    }
    if before:
        variants["before_names"] = lambda: before_scan([opt], names)
        variants["before_streak_start"] = lambda: before_scan([opt], names, weights=True)
    out: dict = {"tensors": n, "elements": numel, "rounds": rounds, "scenarios": {}}
    for scenario in ("one", "all"):
        offending = [0] if scenario == "one" else range(n)
        for i in offending:
            params[i].grad[i % numel] = float("inf")
        (report,) = scan_optimizers([(opt, "grads")], names)
        assert report.total == len(offending), report.total  # the scan finds what was planted
        if before:
            assert before_scan([opt], names)[0][0].total == report.total
        times: dict[str, list[float]] = {v: [] for v in variants}
        for fn in variants.values():
            fn()  # warm-up
        for r in range(rounds):
            order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
            for name in order:
                start = time.process_time()
                variants[name]()
                times[name].append(time.process_time() - start)
        base = times["gradscaler"]
        rows = {}
        for name, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            rows[name] = {"ms": round(statistics.median(ts) * 1e3, 2), "ratio": round(statistics.median(ratios), 2),
                          "ratio_p25": round(pct(ratios, .25), 2), "ratio_p75": round(pct(ratios, .75), 2)}
        out["scenarios"][scenario] = {"offending": len(offending), "variants": rows}
        for i in offending:
            params[i].grad[i % numel] = 0.0
    return out

# ----- part 2: skip storms ---------------------------------------------------------------------------


class _Storm:
    """A model of ``tensors`` parameter tensors, its optimizers and scaler; every other iteration skips.

    ``mlp``: ``tensors / 2`` Linear(32, 32) layers with tanh, one AdamW; ``mlp-2opt``: the same split
    between two AdamW, the first skipping, the second stepping every iteration (so every skip also has
    the stepped optimizer checked); ``tiny-tensors``: 16-element tensors and next to no compute, the
    agent's worst case.
    """

    def __init__(self, kind: str, watched: bool, collector: str | None, tensors: int = 10_000) -> None:
        torch.manual_seed(0)
        self.kind = kind
        if kind == "tiny-tensors":
            self.model = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.1) for _ in range(tensors))
            x = torch.randn(16)
            self.loss = lambda: (torch.stack(list(self.model)) * x).pow(2).mean()
        else:
            self.model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(tensors // 2)))
            x = torch.randn(8, 32)

            def loss() -> torch.Tensor:
                h = x
                for layer in self.model:
                    h = torch.tanh(layer(h))
                return h.pow(2).mean()
            self.loss = loss
        params = list(self.model.parameters())
        groups = [params[:len(params) // 2], params[len(params) // 2:]] if kind == "mlp-2opt" else [params]
        self.opts = [torch.optim.AdamW(g, lr=1e-4, foreach=True) for g in groups]
        # A backoff on each skip and a growth on each step: the scale stays put through the storm.
        self.scaler = torch.amp.GradScaler("cpu", growth_interval=1)
        self.first = groups[0][0]
        self.i = 0
        self.watch = None
        self.seen = {"skips": 0, "named_skips": 0}
        if watched:
            from ampwatch import agent
            self.watch = agent.watch(self.scaler, {f"part{k}": o for k, o in enumerate(self.opts)},
                                     model=self.model, collector=collector, run=f"bench-storm-{kind}")
            # Count skip events as they are recorded (the sender thread takes them away for delivery).
            events = self.watch._recorder.events
            append = events.append

            def counting_append(event: dict) -> dict:
                if event["kind"] == "skip":
                    self.seen["skips"] += 1
                    self.seen["named_skips"] += bool(event["inspected"])
                return append(event)
            events.append = counting_append

    def iterate(self, n: int) -> None:
        for _ in range(n):
            for opt in self.opts:
                opt.zero_grad()
            # float32 compute: bfloat16 autocast would make each tiny CPU matmul slower, not the agent's work
            self.scaler.scale(self.loss()).backward()
            if self.i % 2 == 0:
                self.first.grad.view(-1)[0] = float("inf")  # the first optimizer skips; a second one steps
            for opt in self.opts:
                self.scaler.step(opt)
            self.scaler.update()
            self.i += 1

    def close(self) -> dict:
        if self.watch is None:
            return {}
        counters = self.watch.snapshot()["state"]
        self.watch.close()
        return {"iterations": self.i, **self.seen,
                "poisoned_steps": sum(o["poisoned_steps"] for o in counters["optimizers"].values()),
                "agent_errors": counters["delivery"]["agent_errors"]}


def storm(kind: str, rounds: int, block: int, collector: str | None, tensors: int = 10_000) -> dict:
    """Time a skip storm on ``kind`` watched and unwatched, in alternating blocks of ``block`` iterations."""
    bare, watched = _Storm(kind, False, None, tensors), _Storm(kind, True, collector, tensors)
    try:
        for s in (bare, watched):
            s.iterate(2)  # warm-up
        cpu: dict[bool, list[float]] = {False: [], True: []}
        wall: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for s in ((bare, watched) if r % 2 == 0 else (watched, bare)):
                c, w = time.process_time(), time.perf_counter()
                s.iterate(block)
                cpu[s is watched].append((time.process_time() - c) / block)
                wall[s is watched].append((time.perf_counter() - w) / block)
        ratios = [w / b for w, b in zip(cpu[True], cpu[False], strict=True)]
        wall_ratios = [w / b for w, b in zip(wall[True], wall[False], strict=True)]
        out = {"model": kind, "tensors": sum(1 for _ in bare.model.parameters()), "optimizers": len(bare.opts),
               "rounds": rounds, "block": block,
               "bare_ms_per_iter": round(statistics.median(cpu[False]) * 1e3, 1),
               "watched_ms_per_iter": round(statistics.median(cpu[True]) * 1e3, 1),
               "ratio": round(statistics.median(ratios), 3), "ratio_p25": round(pct(ratios, .25), 3),
               "ratio_p75": round(pct(ratios, .75), 3), "wall_ratio": round(statistics.median(wall_ratios), 3)}
    finally:
        bare.close()
        agent_view = watched.close()
    out.update(agent_view)
    return out


@contextlib.contextmanager
def _collector() -> Iterator[str]:
    from bench._servers import collector
    with collector() as srv:
        yield srv.url


def run(quick: bool) -> dict:
    """Run both parts; return their results."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one compute thread for every variant alike
    try:
        results: dict = {"skip_cost": [skip_cost(n, numel, 2 if quick else 7) for n, numel in SHAPES]}
        with _collector() as url:
            results["storms"] = [storm(kind, 2 if quick else 6, 2 if quick else 6, url) for kind in STORMS]
        results["issue_before"] = {"storm_ratio": 2.55, "note": "quoted from issue 11, whose model had 10,000 "
                                   "tensors and skips alternating with steps; not re-measured here"}
        return results
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    """Run and print the results as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.inspection", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.quick), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
