"""Memory the agent adds to a training process: a sweep's unclosed watches, and a huge answer at AMPWATCH_URL.

Each side runs in fresh child processes (the earlier commit's ``agent/src`` first on ``sys.path`` for "before"):

- sweep: 20 trials (a 1M-parameter model, AdamW, StepLR, a GradScaler and a watch sending to a loopback
  collector, never closed), each dropped as a sweep drops it, Python's garbage collector left as a job has
  it; RSS growth over the trials and how many trials' models are still alive at the end, beside the same
  sweep unwatched;
- answer: the peak RSS one delivery adds when the far end answers it with a 400 MiB body.

    python -m bench.experiments.agent_memory [--before REF] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench._before_after import ROOT, print_and_store, source_of

__all__ = ["main", "run"]

BEFORE = "f833925"  # main before the agent stopped making reference cycles and reading whole answers

_CHILD = r"""
import gc, http.server, json, resource, sys, threading, weakref
import torch

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

class Ack(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    huge = 0
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b'{"applied": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(Ack.huge or len(body)))
        self.end_headers()
        sent, chunk = 0, b" " * 65536
        try:
            if not Ack.huge:
                self.wfile.write(body)
            while sent < Ack.huge:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the agent hung up
            pass
    def log_message(self, *a):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ack)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}"
from ampwatch import agent
from ampwatch.agent._http import IngestClient
mode = sys.argv[1]
if mode == "answer":
    Ack.huge = 400 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    IngestClient(url, None).post(b"{}", 120)
    print(json.dumps({"peak_rss_added_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
    sys.exit()

def trial(watched):
    model = torch.nn.Sequential(*[torch.nn.Linear(500, 500) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu")
    w = agent.watch(scaler, opt, model=model, schedulers=scheduler, collector=url, run="sweep",
                    push_interval=30.0) if watched else None
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 500)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
    return weakref.ref(model[0].weight)

trial(False)  # imports and first-use caches, on both sides alike
start = rss_mib()
refs = [trial(mode == "watched") for _ in range(20)]
print(json.dumps({"rss_growth_mib": rss_mib() - start, "models_alive": sum(r() is not None for r in refs),
                  "agent": agent.__file__}))
"""


def _child(mode: str, pythonpath: str | None) -> dict:
    env = dict(os.environ, AMPWATCH_CLOSE_TIMEOUT="5")
    for var in ("AMPWATCH_URL", "AMPWATCH_SPOOL_DIR", "AMPWATCH_DISABLED"):
        env.pop(var, None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _side(pythonpath: str | None) -> dict:
    return {"unwatched": _child("unwatched", pythonpath), "watched": _child("watched", pythonpath),
            "answer": _child("answer", pythonpath)}


def run(before: str = BEFORE) -> dict:
    """Measure ``before`` and this tree one after the other; return both sides."""
    with tempfile.TemporaryDirectory() as tmp:
        old = _side(source_of(before, tmp, "agent/src"))
    return {"before": dict(old, ref=before), "after": _side(None)}


def _line(side: str, row: dict) -> str:
    u, w, a = row["unwatched"], row["watched"], row["answer"]
    return (f"{side:6} sweep of 20 unclosed trials: RSS +{w['rss_growth_mib']:.0f} MiB watched "
            f"({w['models_alive']} models alive) vs +{u['rss_growth_mib']:.0f} MiB unwatched "
            f"({u['models_alive']} alive); a 400 MiB answer: peak RSS +{a['peak_rss_added_mib']:.1f} MiB")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier commit to measure beside this tree")
    parser.add_argument("--out", help="store the result in this JSON file")
    args = parser.parse_args(argv)
    return print_and_store(run(args.before), "agent_memory", args.out, _line)


if __name__ == "__main__":
    main()
