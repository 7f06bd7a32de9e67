"""Command line: ``ampwatch-dashboards generate [--out DIR] [--check]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import stale_files, write_generated
from .rules import DEFAULT_RUNBOOK_BASE_URL

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="ampwatch-dashboards",
        description="Generate the ampwatch Prometheus rules and Grafana dashboard from the thresholds.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="write (or --check) dashboards/generated/")
    generate.add_argument("--out", type=Path, default=Path("dashboards/generated"),
                          help="folder of the generated files (default: dashboards/generated, "
                               "run from the repository root)")
    generate.add_argument("--check", action="store_true",
                          help="write nothing; exit 1 if the files in --out differ from the code")
    generate.add_argument("--runbook-base-url", default=DEFAULT_RUNBOOK_BASE_URL,
                          help="URL of docs/alerts.md that runbook_url links point into")
    args = parser.parse_args(argv)

    if args.check:
        stale = stale_files(args.out, runbook_base_url=args.runbook_base_url)
        if stale:
            print(f"ampwatch-dashboards: out of date in {args.out}: {', '.join(stale)}; "
                  "run `ampwatch-dashboards generate` and commit the result", file=sys.stderr)
            return 1
        print(f"ampwatch-dashboards: {args.out} is up to date")
        return 0
    for path in write_generated(args.out, runbook_base_url=args.runbook_base_url):
        print(f"wrote {path}")
    return 0
