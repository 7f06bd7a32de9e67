"""Cost of the collector's built-in alerts: per applied batch, and per 1 s evaluation tick.

    python -m bench.experiments.alerts [--ranks 1024] [--seconds 60]

Reports the time per ``observe`` (on the ingest path) and per ``evaluate`` tick
(every second, on the event loop), and the tick's share of that second.
"""

from __future__ import annotations

import argparse
import sys
import time

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, ladder
from ampwatch.server.alerting.evaluator import BuiltinAlerts


def _snapshot(rank: int, now: float, iteration: int) -> RankSnapshot:
    counters = OptimizerTotals(steps=iteration, skipped=1, streaks_reached=ladder({1: 1}))
    return RankSnapshot(run=f"run-{rank // 64}", rank=rank, last_seen=now, iteration=iteration,
                        loss_scale=65536.0, optimizers={"gen": counters, "disc": counters})


def main(argv: list[str]) -> int:
    """Run the benchmark and print one line per measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--seconds", type=int, default=60, help="simulated seconds of one batch per rank")
    args = parser.parse_args(argv)
    alerts = BuiltinAlerts(DEFAULT_THRESHOLDS)
    started = time.perf_counter()
    for second in range(args.seconds):
        for rank in range(args.ranks):
            alerts.observe(_snapshot(rank, 1000.0 + second, 10 * second))
    observe_s = (time.perf_counter() - started) / (args.seconds * args.ranks)
    started = time.perf_counter()
    for i in range(20):
        alerts.evaluate(1000.0 + args.seconds + i * 0.01)
    tick_s = (time.perf_counter() - started) / 20
    print(f"observe per batch: {observe_s * 1e6:.1f} us")
    print(f"evaluate tick at {args.ranks} ranks x 2 optimizers: {tick_s * 1e3:.1f} ms "
          f"({tick_s:.1%} of the 1 s tick period)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
