"""Built-in notifications in a whole-job storm, this tree beside an earlier commit, in one run.

Each side runs in a fresh process with its default notification settings and one ``webhook``
target, a real HTTP receiver on loopback (``ampwatch_support.webhook_receiver``): 1,024 ranks x 3
alerts (3,072) fire at once, as when every rank of a DDP job skips; once each is sent or dropped,
all resolve. Reported per phase: POSTs the receiver got, their bytes, alerts dropped, seconds.
The earlier side imports ``ampwatch.server`` from ``git archive <ref>``.

    python -m bench.experiments.notify_storm [--ranks 1024] [--before d90d65f]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench._before_after import PATH_FIRST, before_after, print_and_store
from bench._before_after import ROOT as _ROOT
from bench.experiments._job1024 import add_comparison_options

__all__ = ["measure", "main"]

KEY = "notify_storm"

_NAMES = ("AmpConsecutiveSkippedSteps", "AmpHighSkippedStepRatio", "AmpSchedulerStepsOnSkipped")


def measure(ranks: int) -> dict:
    """Send the storm through ``ampwatch.server``'s notifier to a real receiver; return what arrived."""
    from ampwatch.server.alerting.alert import Alert
    from ampwatch.server.alerting.notifications import Notifier, Target
    from ampwatch_support.webhook_receiver import WebhookReceiver

    alerts = [Alert(name=name, labels={"run": "storm", "rank": str(rank), "severity": "warning"},
                    annotations={"summary": f"{name} on rank {rank}", "description": "every rank skips"},
                    starts_at=1_800_000_000.0, value=1.0) for rank in range(ranks) for name in _NAMES]
    out = {}
    with WebhookReceiver() as receiver:
        target = Target(kind="webhook", url=receiver.url)
        with Notifier([target]) as notifier:
            done = 0
            for phase, batch in (("firing", alerts), ("resolved", [a.resolved(a.starts_at + 60) for a in alerts])):
                before = len(receiver.requests)
                started = time.monotonic()
                notifier.submit(batch)
                done += len(batch)
                while True:
                    counts = notifier.counts()
                    if counts[(target.name, "sent")] + counts[(target.name, "dropped")] >= done:
                        break
                    time.sleep(0.05)
                got = receiver.requests[before:]
                out[phase] = {"posts": len(got), "bytes": sum(len(json.dumps(r["body"])) for r in got),
                              "seconds": round(time.monotonic() - started, 1),
                              "dropped_so_far": counts[(target.name, "dropped")]}
    return out


def _side(ranks: int, path: str | None) -> dict:
    code = (PATH_FIRST + "import json;"
            "import ampwatch.server; from bench.experiments.notify_storm import measure;"
            "r = measure(int(sys.argv[2])); r['server'] = ampwatch.server.__file__; print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, path or "", str(ranks)], cwd=_ROOT, check=True,
                         capture_output=True, text=True, timeout=900).stdout
    return json.loads(out.strip().splitlines()[-1])


def _lines(name: str, r: dict, ranks: int) -> str:
    lines = []
    for phase in ("firing", "resolved"):
        p = r[phase]
        lines.append(f"{name:>6} {phase:>8}: {len(_NAMES) * ranks} alerts -> {p['posts']} POSTs, "
                     f"{p['bytes'] / 1e6:.2f} MB, {p['seconds']} s, dropped so far {p['dropped_so_far']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    add_comparison_options(parser, KEY, before="d90d65f")
    args = parser.parse_args(argv)
    result = before_after(args.before, lambda path: _side(args.ranks, path))
    return print_and_store(result, KEY, args.out, lambda name, r: _lines(name, r, args.ranks))


if __name__ == "__main__":
    main()
