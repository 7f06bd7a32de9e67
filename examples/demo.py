"""ampwatch in one command: a collector, a real 2-rank CPU DDP job with a scripted overflow, live in the terminal.

What happens:
  1. a collector starts on 127.0.0.1 (SQLite in ./data/, built-in alerts with the
     seconds-long "demo" thresholds: --alert-thresholds demo);
  2. examples/ddp_train.py trains a small model on synthetic data on --ranks CPU
     processes (DDP over gloo, AMP with bfloat16 autocast and a GradScaler), the
     ampwatch agent attached; at iterations 80-87 rank 0's input is inf, so every
     rank skips its steps and backs the loss scale off, then recovers;
  3. this script polls the collector's JSON API (/v1/runs/..., /v1/alerts) and
     prints progress, skips, scale transitions and alerts firing and resolving;
  4. it prints where to look (status page, /metrics) and a summary, and keeps the
     collector running until Ctrl-C (with --once: exits once the job is done).

    make demo                      # or: .venv/bin/python examples/demo.py
    make demo ARGS="--ranks 4"     # more ranks
    make demo ARGS=--once          # exit when the job ends (what the tests run)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ampwatch.contract.thresholds import DEMO_THRESHOLDS

# A collector in a child process, started and stopped the way the tests do it; what the demo prints.
from ampwatch_support.collector_process import CollectorProcess
from ampwatch_support.demo_report import CollectorView
from ampwatch_support.ports import free_port

REPO = Path(__file__).resolve().parents[1]

TRAIN = REPO / "examples" / "ddp_train.py"
TROUBLE = range(80, 88)  # iterations with an inf input on rank 0
GROWTH_INTERVAL = 30  # clean iterations before the scale grows (PyTorch's default is 2000)
SETTLE_S = 40.0  # after the job, how long to wait for its alerts to resolve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="make demo ARGS=... | python examples/demo.py",
        description=__doc__.split("\n\n")[0] + " Needs nothing but this repository's .venv (make venv).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="CPU processes of the DDP job (gloo)")
    parser.add_argument("--iterations", type=int, default=200,
                        help=f"training iterations (>= 150; trouble at {TROUBLE.start}-{TROUBLE.stop - 1})")
    parser.add_argument("--pace", type=float, default=0.1,
                        help="seconds each rank sleeps after an iteration (0.1 to 1: the demo's alert windows are "
                             "sized for that)")
    parser.add_argument("--port", type=int, default=9457, help="collector port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--data", type=Path, default=REPO / "data",
                        help="folder of the collector's database (demo.db) and logs")
    parser.add_argument("--run", default=None, help="run id (default: demo-<date>-<time>)")
    parser.add_argument("--once", action="store_true",
                        help="exit when the job has ended and its alerts resolved, instead of keeping the "
                             "collector running until Ctrl-C")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.ranks > 64:
        parser.error(f"--ranks {args.ranks}: give 1 to 64 processes (each is a CPU process on this machine)")
    if args.iterations < 150:
        parser.error(f"--iterations {args.iterations}: give at least 150, so that recovery follows the "
                     f"trouble at iterations {TROUBLE.start}-{TROUBLE.stop - 1}")
    if not 0.1 <= args.pace <= 1.0:
        parser.error(f"--pace {args.pace}: give 0.1 to 1 s; the 'demo' alert thresholds are sized for iterations "
                     f"that far apart (faster, the scale's growths crowd the backoff window; slower, the backoffs "
                     f"no longer fall in it)")
    args.run = args.run or time.strftime("demo-%Y%m%d-%H%M%S")
    return args


def check_port(port: int) -> int:
    """Return ``port`` if the collector can listen on it (any free port for 0); exit saying what to do if not.

    Binds as uvicorn does, with SO_REUSEADDR: connections of an earlier demo that linger in TIME_WAIT
    for a minute do not stop the collector from listening, so they must not stop the demo either;
    a socket that listens there does.
    """
    if port == 0:
        return free_port()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sys.exit(f"demo: port {port} on 127.0.0.1 is in use (another collector, or an earlier demo still "
                     f"running?); stop it, or pick another port: make demo ARGS='--port 9460' (0: any free port)")
    return port


def _train_command(args: argparse.Namespace, collector: str) -> list[str]:
    return [sys.executable, str(TRAIN), "--ranks", str(args.ranks), "--iterations", str(args.iterations),
            "--inject-at", str(TROUBLE.start), "--inject-for", str(len(TROUBLE)),
            "--growth-interval", str(GROWTH_INTERVAL), "--collector", collector, "--run", args.run,
            "--push-interval", "0.5", "--sleep", str(args.pace)]


def _where_to_look(url: str, run: str) -> str:
    return (f"Where to look:\n"
            f"  status page   {url}/\n"
            f"  Prometheus    {url}/metrics\n"
            f"  alerts (JSON) {url}/v1/alerts\n"
            f"  this run      {url}/v1/runs/{run}   (events: {url}/v1/runs/{run}/events)")


def _after_once(db: Path, run: str) -> str:
    """What to do once ``--once`` has stopped the collector: its links would lead nowhere, its database keeps all."""
    return (f"The collector has stopped (--once), so the links above no longer answer. Everything it recorded is in "
            f"{db}; to look again:\n"
            f"  ampwatch-server --db {db}    then open http://127.0.0.1:9457/ (run {run})\n"
            f"  or run make demo without --once: the collector then keeps running until Ctrl-C")


def _watch(view: CollectorView, job: subprocess.Popen, once: bool) -> None:
    """Poll while the job runs, then until its alerts resolve (bounded)."""
    while job.poll() is None:
        view.poll()
        time.sleep(0.5)
    view.poll()
    deadline = time.monotonic() + SETTLE_S
    if view.alerts_firing():
        print(f"{view._elapsed()} job done; waiting up to {SETTLE_S:.0f} s for its alerts to resolve")
    while view.alerts_firing() and time.monotonic() < deadline:
        time.sleep(0.5)
        view.poll()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the exit status."""
    args = parse_args(argv)
    port = check_port(args.port)
    args.data.mkdir(parents=True, exist_ok=True)
    # SIGTERM (e.g. from a test's timeout) unwinds like Ctrl-C, so the job and the collector are stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    collector = CollectorProcess(str(args.data / "demo.db"), port=port, args=["--alert-thresholds", "demo"],
                                 log_path=str(args.data / "collector.log"))
    job = None
    try:
        print(f"demo: starting a collector on {collector.url} (database {args.data / 'demo.db'}, "
              f"built-in alerts with the 'demo' thresholds: seconds, not minutes)", flush=True)
        collector.start()
        print(_where_to_look(collector.url, args.run))
        print(f"demo: training run {args.run!r} on {args.ranks} CPU ranks (DDP over gloo, bfloat16 autocast, "
              f"GradScaler growth_interval={GROWTH_INTERVAL}), {args.iterations} iterations; job log: "
              f"{args.data / 'job.log'}", flush=True)
        with open(args.data / "job.log", "wb") as log:
            # Its own session, so that stopping it also stops the rank processes it spawned.
            job = subprocess.Popen(_train_command(args, collector.url), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1",
                                        # the demo's spike window: a job of 150 iterations fills it
                                        "AMPWATCH_SPIKE_WINDOW": str(DEMO_THRESHOLDS.spike_window_iterations)})
        view = CollectorView(collector.url, args.run, args.iterations, TROUBLE,
                             print_=lambda text: print(text, flush=True))
        _watch(view, job, args.once)
        if job.returncode != 0:
            print((args.data / "job.log").read_text(errors="replace")[-3000:], file=sys.stderr)
            print(f"demo: the training job failed with exit status {job.returncode}; its log is above and in "
                  f"{args.data / 'job.log'}", file=sys.stderr)
            return 1
        print()
        print(view.summary())
        print()
        if args.once:
            print(_after_once(args.data / "demo.db", args.run))
            return 0
        print(_where_to_look(collector.url, args.run))
        print(f"\nThe collector keeps running at {collector.url}: open the status page. Ctrl-C stops it.",
              flush=True)
        while True:
            time.sleep(1)
            view.poll()  # alerts that still resolve are printed as they do
    except KeyboardInterrupt:
        print("\ndemo: stopping", file=sys.stderr)
        return 130
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait(5)
        collector.kill(signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
