"""The options of the benches stored in bench/experiments/results/job1024_before_after.json
(docs/benchmarks.md section 7).

Each of them measures a 1,024-rank job on this tree beside an earlier commit, and can keep its
result under its own key in that file; ``--before`` and ``--out`` read the same in all of them.
"""

from __future__ import annotations

import argparse

__all__ = ["add_comparison_options"]


def add_comparison_options(parser: argparse.ArgumentParser, key: str, before: str) -> None:
    """Add ``--before`` (the earlier commit, default ``before``) and ``--out`` (store under ``key``) to ``parser``."""
    parser.add_argument("--before", default=before, help="the commit to compare with")
    parser.add_argument("--out", help=f"also store the result under {key!r} in this JSON file (the committed "
                                      f"bench/experiments/results/job1024_before_after.json renders as "
                                      f"docs/benchmarks.md section 7)")
