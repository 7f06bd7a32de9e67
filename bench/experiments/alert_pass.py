"""CPU time of one periodic built-in alert pass over N healthy ranks, reading every window vs skipping quiet ranks.

The ranks (2 optimizers each) report every 15 s for 50 simulated minutes, their first three batches with
calibration skips, so that the longest alert window (30 min) has rolled past those skips and every rank is
quiet (``RankHistory.quiet``). Both ways run in this process, alternating, on the same histories: *every
window* with the shortcut turned off, *quiet ranks skipped* as the collector runs it. Thread CPU time,
median of 5 passes each.

    python -m bench.experiments.alert_pass [--ranks 16384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from ampwatch.contract.thresholds import DEFAULT_THRESHOLDS as T
from ampwatch.server._state import RankSnapshot
from ampwatch.server._totals import OptimizerTotals, RankTotals
from ampwatch.server.alerting import conditions
from ampwatch.server.alerting.history import HistoryLayout, RankHistory

__all__ = ["main"]

PUSH_S, MINUTES, CALIBRATION_BATCHES = 15.0, 50, 3


def _histories(ranks: int) -> list[RankHistory]:
    layout = HistoryLayout(T)
    out = []
    for rank in range(ranks):
        h = RankHistory("bench", rank, layout, 5.0)
        for k in range(1, int(MINUTES * 60 / PUSH_S)):
            skipped = min(k, CALIBRATION_BATCHES)
            steps = 10 * k - skipped
            h.record(RankSnapshot(run="bench", rank=rank, last_seen=k * PUSH_S, iteration=10 * k,
                                  loss_scale=2.0 ** (16 - skipped), totals=RankTotals(backoffs=skipped),
                                  optimizers={name: OptimizerTotals(steps=steps, skipped=skipped)
                                              for name in ("gen", "disc")}),
                     T.calibration_iterations)
        out.append(h)
    return out


def main(argv: list[str] | None = None) -> int:
    """Time both ways; print the medians and their ratio."""
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.alert_pass", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16384)
    args = parser.parse_args(argv)
    histories = _histories(args.ranks)
    now = MINUTES * 60.0
    assert all(h.quiet(now) for h in histories)
    times: dict[str, list[float]] = {"every window": [], "quiet ranks skipped": []}
    for _ in range(5):
        for way in times:
            start = time.thread_time()
            found = conditions.evaluate(histories, now, T, skip_quiet=way != "every window")
            times[way].append(time.thread_time() - start)
            assert not found, found[:3]
    medians = {way: statistics.median(runs) for way, runs in times.items()}
    for way, median in medians.items():
        print(f"{args.ranks:,} quiet ranks, {way}: {median * 1000:.1f} ms CPU a pass")
    print(f"ratio: {medians['quiet ranks skipped'] / medians['every window']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
