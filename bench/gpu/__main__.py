"""Check ampwatch on a GPU: truth, syncs, overhead, inspection, two ranks, bf16, FSDP, spikes (``make bench-gpu``).

    PYTHONPATH=agent/src:contract/src:support/src python -m bench.gpu [--device cuda|cpu] [--quick]
        [--out-dir DIR] [--only SECTION]

Needs torch and the source of the agent, its contract and the sync counter only. Prints the environment and
one line per check, writes ``DIR/gpu.json`` and ``DIR/gpu.md`` (the "GPU" section of docs/benchmarks.md), and
exits 1 when any check fails (a truth or sync mismatch) or errors, 2 when the device is missing. Under 5 minutes
on one GPU.
``--device cpu`` runs the same checks against a CPU scaler (CI's smoke run): it proves nothing about CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ("truth", "syncs", "overhead", "inspection", "ddp", "bf16", "fsdp", "began", "spikes", "sync-trace")
"""In running order; ``sync-trace`` switches on torch's GPU trace hooks for good, so it comes last."""


def _command(output: list[str]) -> str:
    try:
        return subprocess.run(output, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(amp) -> dict:
    """Describe the machine, torch and the devices."""
    import torch

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": amp.device.type, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda or "none (CPU build of torch)", "cpu": cpu, "cores": os.cpu_count(),
           "git_commit": _command(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]) or "unknown"}
    if amp.cuda:
        env["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_gib": round(p.total_memory / 2 ** 30, 1),
                                "ampwatch_device": _reported_device(i)})
        env["driver"] = (_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                         .splitlines() or ["unknown (no nvidia-smi)"])[0]
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            nccl = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001 - informative only
            env["nccl"] = "unavailable"
    return env


def _reported_device(index: int) -> dict | str:
    """What the agent sends as this GPU's ``device`` (type, index, UUID, PCI bus id), or why it could not say."""
    import torch

    try:
        from ampwatch.agent._device_info import device_info

        return dict(device_info(torch.device("cuda", index)) or {})
    except Exception as error:  # noqa: BLE001 - informative: the run goes on
        return f"unreadable: {error}"


def _run_section(name: str, amp, quick: bool) -> list[dict]:
    from bench.gpu import began, bf16, ddp, fsdp, inspection, overhead, spikes, syncs, truth

    return {"truth": truth.run, "syncs": syncs.run, "overhead": overhead.run, "inspection": inspection.run,
            "ddp": ddp.run, "bf16": bf16.run, "fsdp": fsdp.run, "began": began.run, "spikes": spikes.run,
            "sync-trace": syncs.trace}[name](amp, quick)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print a line per check, write the JSON and the Markdown section."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="default: cuda; cpu runs the CPU smoke version, which proves nothing about CUDA")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and repeats (the CI smoke run)")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "artifacts", "gpu"),
                        help="where gpu.json and gpu.md go (default: artifacts/gpu)")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    args = parser.parse_args(argv)

    import torch

    from bench.gpu._amp import Amp
    from bench.gpu._checks import FAILING, guarded, line
    from bench.gpu.report import section

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"bench.gpu: no CUDA device is visible to torch {torch.__version__} (built with CUDA "
              f"{torch.version.cuda or 'none: a CPU-only build'}). Run it on a machine with a GPU, or pass "
              "--device cpu for the CPU smoke run (which proves nothing about CUDA).", file=sys.stderr)
        return 2
    dropped = sorted(k for k in os.environ if k.startswith("AMPWATCH_"))
    for k in dropped:  # e.g. AMPWATCH_DISABLED would turn every watch into a do-nothing one
        del os.environ[k]
    amp = Amp(torch.device(device))
    started = time.perf_counter()
    env = environment(amp)
    if not amp.cuda:
        print("bench.gpu: CPU RUN. This exercises the script and the agent's CPU path; it proves nothing "
              "about CUDA.", flush=True)
    print("bench.gpu: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if dropped:
        print(f"bench.gpu: ignoring {', '.join(dropped)} (nothing is sent; every watch uses collector=())")
    checks = []
    for name in args.only or SECTIONS:
        print(f"bench.gpu: {name} ...", flush=True)
        t = time.perf_counter()
        found = guarded(name, "section", lambda name=name: _run_section(name, amp, args.quick))
        for c in found:
            print(line(c), flush=True)
        checks += found
        print(f"bench.gpu: {name} done in {time.perf_counter() - t:.1f} s", flush=True)
    results = {"command": "python -m bench.gpu"
                          + "".join(" " + a for a in (argv if argv is not None else sys.argv[1:])),
               "device": device, "quick": args.quick, "environment": env, "checks": checks,
               "duration_s": round(time.perf_counter() - started, 1)}
    failing = [c for c in checks if c["status"] in FAILING]
    results["passed"] = not failing
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out_dir, "gpu.md"), "w") as f:
        f.write("\n".join(section(results)))
    tally = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "error", "skip", "info")}
    print(f"bench.gpu: {', '.join(f'{n} {s}' for s, n in tally.items())} in {results['duration_s']:.0f} s; "
          f"wrote {args.out_dir}/gpu.json and gpu.md" + ("" if amp.cuda else " (CPU run: proves nothing about CUDA)"))
    for c in failing:
        print("bench.gpu: FAILED " + line(c), file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
