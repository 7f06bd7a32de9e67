"""Command line: ``ampwatch-dashboards generate [--out DIR] [--kubernetes-out DIR] [--check]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import generated_files, stale_names, write_files
from .kubernetes import KUBERNETES_DIR, kubernetes_files
from .rules import DEFAULT_RUNBOOK_BASE_URL

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return the exit status."""
    parser = argparse.ArgumentParser(
        prog="ampwatch-dashboards",
        description="Generate the ampwatch Prometheus rules and Grafana dashboard from the thresholds.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="write (or --check) dashboards/generated/ and "
                                                     "deploy/kubernetes/generated/")
    generate.add_argument("--out", type=Path, default=Path("dashboards/generated"),
                          help="folder of the generated files (default: dashboards/generated, "
                               "run from the repository root)")
    generate.add_argument("--kubernetes-out", type=Path, default=Path(KUBERNETES_DIR),
                          help="folder of the PrometheusRule and Grafana dashboard ConfigMap "
                               f"(default: {KUBERNETES_DIR})")
    generate.add_argument("--check", action="store_true",
                          help="write nothing; exit 1 if the files in --out or --kubernetes-out differ from the code")
    generate.add_argument("--runbook-base-url", default=DEFAULT_RUNBOOK_BASE_URL,
                          help="URL of docs/alerts.md that runbook_url links point into")
    args = parser.parse_args(argv)

    outputs = [(args.out, generated_files(runbook_base_url=args.runbook_base_url)),
               (args.kubernetes_out, kubernetes_files(runbook_base_url=args.runbook_base_url))]
    if args.check:
        status = 0
        for out, files in outputs:
            stale = stale_names(out, files)
            if stale:
                print(f"ampwatch-dashboards: out of date in {out}: {', '.join(stale)}; "
                      "run `ampwatch-dashboards generate` and commit the result", file=sys.stderr)
                status = 1
            else:
                print(f"ampwatch-dashboards: {out} is up to date")
        return status
    for out, files in outputs:
        for path in write_files(out, files):
            print(f"wrote {path}")
    return 0
