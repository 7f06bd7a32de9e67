"""Built-in alerts' memory per rank after a full alert window, this tree beside an earlier commit, in one run.

Each side runs in a fresh process: 1,024 ranks x 2 optimizers report every 2 s (4 iterations a
second, a skip now and then) for the longest alert window (30 min by default) plus a minute, on a
simulated clock, with an ``evaluate()`` tick every 5 s; the last minute is a whole-job skip storm
(every rank skips every step, so streak counters move). The snapshots are built as
``RankView.snapshot()`` builds them (new totals per batch, one dict per snapshot). The figure is the
process's resident memory after the run minus before the evaluator existed (the snapshots of the
ranks' current state, which the collector's state holds anyway, are counted too), per rank.
The earlier side imports ``ampwatch.server`` from ``git archive <ref>``.

    python -m bench.experiments.alert_memory [--ranks 1024] [--before d90d65f] [--minutes 31]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from array import array

from bench._before_after import PATH_FIRST, before_after, print_and_store
from bench._before_after import ROOT as _ROOT
from bench.experiments._job1024 import add_comparison_options
from bench.experiments._resident import resident_kib

__all__ = ["measure", "main"]

KEY = "alert_memory"


def measure(ranks: int, minutes: float, push_s: float = 2.0) -> dict:
    """Run the simulated job against ``ampwatch.server``'s alerts in this process; return memory and time."""
    from ampwatch.contract.protocol import STREAK_LADDER
    from ampwatch.server._state import RankSnapshot
    from ampwatch.server._totals import NO_STREAKS, OptimizerTotals, RankTotals
    from ampwatch.server.alerting.evaluator import BuiltinAlerts

    gc.collect()
    before = resident_kib()
    t0 = 1_800_000_000.0
    alerts = BuiltinAlerts(clock=lambda: t0)
    opts = ("adamw", "sgd")
    state = {rank: [0, RankTotals(), {o: OptimizerTotals() for o in opts}, 0] for rank in range(ranks)}
    storm_from = minutes * 60 - 60
    steps_per_push = int(4 * push_s)
    started = time.process_time()
    transitions = 0
    for tick in range(int(minutes * 60 / push_s)):
        now = t0 + tick * push_s
        storm = tick * push_s >= storm_from
        for rank in range(ranks):
            s = state[rank]
            s[0] += steps_per_push
            skipped = steps_per_push if storm else int((s[0] // steps_per_push + rank) % 250 == 0)
            s[3] = s[3] + skipped if storm else 0
            s[1] = RankTotals(backoffs=s[1].backoffs + skipped, growths=s[1].growths + (0 if storm else
                                                                                     int(s[0] % 8000 == 0)))
            new = {}
            for name, opt in s[2].items():
                reached = opt.streaks_reached
                if storm:
                    reached = tuple(int(s[3] >= length) for length in STREAK_LADDER)
                    reached = reached if any(reached) else NO_STREAKS
                new[name] = OptimizerTotals(opt.steps + steps_per_push - skipped, opt.skipped + skipped,
                                            opt.streaks + int(skipped > 0), 0, 0, reached)
            s[2] = new
            snap = RankSnapshot(run="bench", rank=rank, last_seen=now, iteration=s[0], loss_scale=65536.0,
                                totals=s[1], optimizers=dict(new), consecutive_skipped={o: s[3] for o in opts})
            transitions += len(alerts.observe(snap, now))
        if tick % int(5 / push_s) == 0:
            transitions += len(alerts.evaluate(now))
    cpu = time.process_time() - started
    gc.collect()
    after = resident_kib()
    # The histories' own arrays, where they are arrays (this tree): the rest is alert states and snapshots.
    arrays = sum(sys.getsizeof(getattr(h, name)) for h in alerts._ranks.values()
                 for name in ("_times", "_rows", "_rose", "_origin") if isinstance(getattr(h, name, None), array))
    return {"ranks": ranks, "minutes": minutes, "rss_kib": after - before,
            "kib_per_rank": round((after - before) / ranks, 1), "cpu_s": round(cpu, 1),
            "history_array_kib_per_rank": round(arrays / 1024 / ranks, 1) if arrays else None,
            "firing": len(alerts.firing()), "transitions": transitions}


def _side(ranks: int, minutes: float, path: str | None) -> dict:
    code = (PATH_FIRST + "import json;"
            "import ampwatch.server; from bench.experiments.alert_memory import measure;"
            "r = measure(int(sys.argv[2]), float(sys.argv[3])); r['server'] = ampwatch.server.__file__;"
            "print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, path or "", str(ranks), str(minutes)], cwd=_ROOT,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    return (f"{name:>6}: {r['kib_per_rank']:>7} KiB/rank ({r['rss_kib'] / 1024:.1f} MiB at {r['ranks']} ranks, "
            f"{r['minutes']} simulated min), {r['cpu_s']} s CPU, {r['firing']} firing, "
            f"{r['transitions']} transitions, history arrays {r['history_array_kib_per_rank']} KiB/rank  "
            f"[{r['server']}]")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=31.0, help="simulated minutes (the window is 30)")
    add_comparison_options(parser, KEY, before="d90d65f")
    args = parser.parse_args(argv)
    result = before_after(args.before, lambda path: _side(args.ranks, args.minutes, path))
    return print_and_store(result, KEY, args.out, _line)


if __name__ == "__main__":
    main()
