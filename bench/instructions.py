"""The agent's overhead in CPU instructions per training iteration: a count that machine load cannot blur.

Timing ratios on a shared 2-core machine spread by several percent from run to run, which hides a 1%
question. Valgrind's callgrind counts the instructions the process executes instead. Each variant runs in
its own process under callgrind; the counters are zeroed right before the measured iterations (the
process calls ``os.getppid()``, i.e. libc ``getppid``: ``--zero-before=getppid``) and dumped right after
(``os.getpgrp()``: ``--dump-before=getpgrp``), so imports, set-up and warm-up are left out; they also run
uninstrumented (``--instr-atstart=no``, switched on by ``callgrind_control`` once the child is set up).
The loops are ``bench.overhead.Setup``'s: the same model, data, two optimizers, ``GradScaler("cpu")`` and bfloat16
autocast; the watched loop also asks ``watch.stepped()`` for both optimizers every iteration. The bf16 rows: the
same loop without a GradScaler, bare and watched with ``watch(None, ...)`` (every optimizer step checked); the DDP
rows: one AdamW over a DistributedDataParallel model in a gloo group of one process (world size 1: DDP's reducer
still buckets and all-reduces), bare and watched with ``watch(None, ..., ddp=model)``. No collector:
the sender thread sleeps between pushes and is measured apart (its CPU time is a few milliseconds per minute).

The spike rows (issue 40, :data:`SPIKE_CASES`): the transformer loop with the loss and each optimizer's gradient
norm watched, beside the same loop bare; ``--spikes`` measures only them, ``--merge`` puts them into the committed
page without re-measuring the rest (about 10 minutes on a quiet 2-core machine, the whole section about 25).

    python -m bench.instructions [--iterations N] [--spikes [--merge docs/benchmarks.json]] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench._loops import Loop

__all__ = ["CASES", "SPIKE_CASES", "callgrind_instructions", "counting_ends", "counting_starts", "merge_spikes", "run"]

CASES = (("mlp", False, "bare", "ampwatch"), ("mlp", True, "bare", "ampwatch"),
         ("mlp", False, "bf16", "bf16_ampwatch"), ("mlp", True, "bf16", "bf16_ampwatch"),
         ("transformer", False, "bf16", "bf16_ampwatch"), ("transformer", True, "bf16", "bf16_ampwatch"),
         ("mlp", False, "ddp_bf16", "ddp_bf16_ampwatch"), ("transformer", False, "ddp_bf16", "ddp_bf16_ampwatch"))
"""(model, fused, bare variant, watched variant) measured; the tiny MLP is where a fixed per-iteration cost weighs
most, the transformer block a more realistic one. ``bare``/``ampwatch``: a GradScaler; ``bf16``/``bf16_ampwatch``:
none; ``ddp_bf16``/``ddp_bf16_ampwatch``: none, the model in DistributedDataParallel (a gloo group of this process
alone), watched with ``ddp=`` (``bench.ddp_origin.DdpBf16Setup``)."""
PROBE_CASES = (("transformer", False, "bf16_ampwatch"), ("transformer", True, "bf16_ampwatch"))
"""(model, fused, watched variant) whose forward probes (``began``, docs/agent.md#where-it-began) are also measured
armed: the same loop with the probes on for every measured iteration (``<variant>_armed``), beside its watched row.
A healthy run never arms them; this is what a window after a forward start costs per iteration."""
SPIKE_CASES = (("transformer", False, "bare_clip", "ampwatch_clip", True),
               ("transformer", True, "bare_clip", "ampwatch_clip", True),
               ("transformer", False, "bf16_clip", "bf16_ampwatch_clip", True),
               ("transformer", True, "bf16_clip", "bf16_ampwatch_clip", True),
               ("transformer", False, "bare", "ampwatch_norm", False),
               ("transformer", True, "bare", "ampwatch_norm", False))
"""(model, fused, bare variant, watched variant, judged) of issue 40's spike watch: the loss and each optimizer's
gradient norm watched (``bench.overhead.CLIP_VARIANTS``). The judged pairs do what real jobs do in both loops
(``scaler.unscale_`` where there is a scaler, ``clip_grad_norm_`` per optimizer), the watched one handing each norm
over (``watch.grad_norm``) and, without a scaler, its loss (``watch.loss``): the issue's target is within 1% of
bare. ``ampwatch_norm`` (``grad_norm=True``: the agent computes the norms the bare loop never computes) is
reported beside bare, not judged."""
WARMUP = 20


def _child(variant: str, model: str, fused: bool, iterations: int) -> None:
    setup: Loop
    armed = variant.endswith("_armed")
    variant = variant.removesuffix("_armed")
    if variant.startswith("ddp_"):
        from bench.ddp_origin import DdpBf16Setup, one_process_group

        one_process_group()
        setup = DdpBf16Setup(model, watched=variant.endswith("_ampwatch"), fused=fused)
    else:
        from bench.overhead import Setup

        setup = Setup(variant, model, fused, None)
    if armed:  # the forward probes on for the whole loop, as in a window after a forward start
        probes = setup.watch._recorder.began.probes  # type: ignore[attr-defined] # a watched variant
        probes.iterations = 1 << 30
        probes.arm(0)
    setup.iterate(WARMUP)
    counting_starts()
    setup.iterate(iterations)
    counting_ends()
    os._exit(0)  # what is left (closing, tearing down) would only run instrumented, many times slower


_READY = "BENCH_CALLGRIND_READY"  # a file the child writes once set up; it then waits for the same name + ".go"


def counting_starts() -> None:
    """In a child of :func:`callgrind_instructions`: say set-up is done, wait to be instrumented, count.

    Until here the child ran without callgrind's instrumentation (``--instr-atstart=no``, several times
    faster: importing torch under full instrumentation takes many minutes on a loaded machine).
    """
    ready = os.environ.get(_READY)
    if ready:
        with open(ready, "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(ready + ".go"):
            time.sleep(0.01)
    os.getppid()  # callgrind zeroes its counters here


def counting_ends() -> None:
    """In a child run by :func:`callgrind_instructions`: stop counting (callgrind dumps its counters here)."""
    os.getpgrp()


def callgrind_instructions(module_args: list[str], out: str, env: dict | None = None) -> int:
    """Run ``python -m <module_args>`` under callgrind; return the instructions between its two markers.

    The child calls :func:`counting_starts` where counting starts and :func:`counting_ends` where it ends;
    instrumentation is switched on (``callgrind_control -i on``) only when it says it is ready. ``env`` adds
    to this process's environment (``AMPWATCH_*`` left out, one compute thread). Minutes per call.
    """
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_")}
    child_env["OMP_NUM_THREADS"] = "1"  # one compute thread: the same work in the same order every run
    child_env.update(env or {})
    ready = child_env[_READY] = out + ".ready"
    for stale in [ready, ready + ".go", *glob.glob(out + ".*[0-9]")]:  # an earlier run's, in a kept folder (--keep)
        if os.path.exists(stale):
            os.remove(stale)
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               "--zero-before=getppid", "--dump-before=getpgrp", sys.executable, "-m", *module_args]
    with open(out + ".log", "wb") as log, subprocess.Popen(
            command, env=child_env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdout=log, stderr=subprocess.STDOUT) as child:
        try:
            deadline = time.monotonic() + 1800
            while not os.path.exists(ready) and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if os.path.exists(ready):
                subprocess.run(["callgrind_control", "-i", "on", str(child.pid)], check=True, capture_output=True,
                               timeout=600)
                with open(ready + ".go", "w"):
                    pass
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if child.poll() is None:
                child.kill()
    if child.returncode:
        with open(out + ".log", errors="replace") as log:
            raise RuntimeError(f"{module_args} under callgrind exited {child.returncode}: {log.read()[-2000:]}")
    dumps = sorted(glob.glob(out + ".*[0-9]"))  # the dump taken before getpgrp: only the measured iterations
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump for {module_args} ({out}.*): was getpgrp ever called?")
    with open(dumps[0]) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {dumps[0]}")


def _count(variant: str, model: str, fused: bool, iterations: int, workdir: str) -> int:
    """Return the instructions of ``iterations`` measured iterations of one variant."""
    out = os.path.join(workdir, f"{variant}-{model}-{'fused' if fused else 'foreach'}.cg")
    return callgrind_instructions(["bench.instructions", "--child", variant, model, str(int(fused)),
                                   str(iterations)], out)


def _optimizer(fused: bool) -> str:
    return "AdamW(fused=True)" if fused else "AdamW(foreach=True)"


def _row(model: str, fused: bool, bare_variant: str, iterations: int, bare: int, watched: int) -> dict:
    return {"model": model, "optimizer": _optimizer(fused),
            "precision": "bf16, no scaler" if bare_variant.startswith(("bf16", "ddp_bf16")) else "GradScaler",
            "ddp": bare_variant.startswith("ddp_"),
            "iterations": iterations, "bare_per_iter": round(bare / iterations),
            "watched_per_iter": round(watched / iterations),
            "agent_per_iter": round((watched - bare) / iterations),
            "ratio": round(watched / bare, 4)}


def _spike_rows(iterations: int, workdir: str, pool: ThreadPoolExecutor) -> list[dict]:
    """The spike watch's pairs (:data:`SPIKE_CASES`), bare and watched in parallel."""
    rows = []
    for model, fused, bare_variant, watched_variant, judged in SPIKE_CASES:
        bare, watched = pool.map(lambda v, model=model, fused=fused: _count(v, model, fused, iterations, workdir),
                                 (bare_variant, watched_variant))
        row = _row(model, fused, bare_variant, iterations, bare, watched)
        rows.append({**row, "bare": bare_variant, "watched": watched_variant, "judged": judged,
                     "grad_norm": "grad_norm=True" if watched_variant == "ampwatch_norm" else "watch.grad_norm"})
    return rows


def run(iterations: int = 200, spikes_only: bool = False, keep: str | None = None) -> dict:
    """Count instructions per iteration, bare vs watched, for each case (two processes at a time).

    ``spikes_only``: only :data:`SPIKE_CASES` (about a third of the time). ``keep``: a folder to keep callgrind's
    output files in (``callgrind_annotate`` reads where the instructions went), instead of a temporary one.
    """
    if shutil.which("valgrind") is None:
        raise RuntimeError("valgrind is not installed (Debian package valgrind)")
    rows = []
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        if keep:
            os.makedirs(keep, exist_ok=True)
        workdir = keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="ampwatch-callgrind-"))
        if spikes_only:
            return {"spikes": _spike_rows(iterations, workdir, pool), "warmup": WARMUP}
        for model, fused, bare_variant, watched_variant in CASES:
            bare, watched = pool.map(lambda v, model=model, fused=fused: _count(v, model, fused, iterations, workdir),
                                     (bare_variant, watched_variant))
            rows.append(_row(model, fused, bare_variant, iterations, bare, watched))
        watched_of = {(r["model"], r["optimizer"], r["precision"], r["ddp"]): r["watched_per_iter"] for r in rows}
        probes = []
        for model, fused, variant in PROBE_CASES:
            armed = _count(variant + "_armed", model, fused, iterations, workdir)
            optimizer = _optimizer(fused)
            precision = "bf16, no scaler" if variant.startswith("bf16") else "GradScaler"
            watched = watched_of[(model, optimizer, precision, False)]
            probes.append({"model": model, "optimizer": optimizer, "precision": precision, "iterations": iterations,
                           "watched_per_iter": watched, "armed_per_iter": round(armed / iterations),
                           "probes_per_iter": round(armed / iterations) - watched,
                           "ratio": round(armed / iterations / watched, 4)})
        spikes = _spike_rows(iterations, workdir, pool)
    return {"rows": rows, "probes": probes, "spikes": spikes, "warmup": WARMUP}


def merge_spikes(measured: dict, path: str, command: str) -> None:
    """Put ``measured``'s spike rows into the instructions section of the run in ``path`` (``docs/benchmarks.json``),
    stamped with ``command``, the date and the load, and leave the rest of it as it was."""
    with open(path) as f:
        document = json.load(f)
    section = document.setdefault("instructions", {})
    section["spikes"] = measured["spikes"]
    section["spikes_measured"] = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg": round(os.getloadavg()[0], 2), "warmup": measured["warmup"]}
    with open(path, "w") as f:
        json.dump(document, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=200, help="measured iterations per variant")
    parser.add_argument("--spikes", action="store_true", help="only the spike watch's pairs (SPIKE_CASES)")
    parser.add_argument("--keep", metavar="DIR", help="keep callgrind's output files in DIR (for callgrind_annotate)")
    parser.add_argument("--merge", metavar="JSON", help="with --spikes: put the rows into JSON's instructions section "
                                                        "(docs/benchmarks.json) and render its page again")
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "MODEL", "FUSED", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, model, fused, n = args.child
        _child(variant, model, fused == "1", int(n))
        return 0
    if args.merge and not args.spikes:
        parser.error("--merge takes only the spike rows: use it with --spikes (python -m bench --only instructions "
                     "--merge re-measures the whole section)")
    result = run(args.iterations, spikes_only=args.spikes, keep=args.keep)
    print(json.dumps(result, indent=1))
    if args.merge:
        merge_spikes(result, args.merge, "python -m bench.instructions " + " ".join(
            argv if argv is not None else sys.argv[1:]))
        # the page's own render, in a child: bench.__main__ imports this module
        return subprocess.run([sys.executable, "-m", "bench", "--render", os.path.abspath(args.merge)], check=False,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
