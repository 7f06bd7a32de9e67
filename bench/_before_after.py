"""Measure this tree beside an earlier commit in one run, and keep the result in a JSON file.

The earlier commit's ``server/src`` (or ``agent/src``) is extracted with ``git archive`` and put first on
a child process's ``sys.path``, so both sides run on the same machine, minutes apart, with the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable

__all__ = ["PATH_FIRST", "ROOT", "before_after", "before_after_main", "checked_side", "commit", "print_and_store",
           "source_of", "store"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PATH_FIRST = "import os, sys; sys.path[:0] = sys.argv[1].split(os.pathsep) if sys.argv[1] else [];"
"""Code a side's child (``python -c``) starts with: puts :func:`source_of`'s folders (``sys.argv[1]``, empty for
this tree) first on its ``sys.path``."""


def source_of(ref: str, into: str, *folders: str) -> str:
    """Extract ``folders`` of ``ref`` into ``into``; return them as a PYTHONPATH to put first.

    The default is the collector with the contract it was written against (``server/src``, ``contract/src``): an
    earlier collector run against today's contract fails where a name it reads has changed since."""
    folders = folders or ("server/src", "contract/src")
    archive = os.path.join(into, "src.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, ref, *folders], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return os.pathsep.join(os.path.join(into, *folder.split("/")) for folder in folders)


def before_after(ref: str, side: Callable[[str | None], dict]) -> dict:
    """Return ``{"before": side(<ref's server/src>) + {"ref"}, "after": side(None)}``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = source_of(ref, tmp)
        old = checked_side(side(path), path)
    return {"before": dict(old, ref=ref), "after": checked_side(side(None), None)}


def before_after_main(argv: list[str] | None, description: str, before: str, before_is: str, key: str,
                      side: Callable[[str | None], dict], module: str | None = None) -> dict:
    """The ``main()`` of a bench that runs ``side`` at ``--before`` (default ``before``, which ``before_is`` says
    in --help) and at this tree: print the result as JSON, store it under ``--key`` in ``--out``; return it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--before", default=before, help=f"the commit to compare with (default: {before_is})")
    parser.add_argument("--key", default=key, help="the name to store the result under (default: %(default)s)")
    parser.add_argument("--out", help="also store the result under --key in this JSON file")
    args = parser.parse_args(argv)
    result = before_after(args.before, side)
    print(json.dumps(result, indent=1))
    if args.out:
        store(args.out, args.key, result, sys.argv, module=module or key)
    return result


def checked_side(result: dict, path: str | None) -> dict:
    """Return a side's ``result`` once its ``server`` (the ``ampwatch.server`` it imported) is the one asked for:
    from ``path``'s folders, or this tree's when None. Raises if not (the earlier commit silently not run)."""
    server = result.get("server")
    if server is not None:
        ours = os.path.realpath(server).startswith(os.path.realpath(ROOT) + os.sep)
        if ours != (path is None):
            raise RuntimeError(f"the {'before' if path else 'after'} side imported the collector from {server}, "
                               f"not from {path or ROOT}")
    return result


def commit() -> str:
    """This tree's commit, short, with ``+uncommitted changes`` when the working tree differs from it."""
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" +uncommitted changes" if dirty else "")


def store(path: str, key: str, result: dict, argv: list[str], module: str | None = None) -> None:
    """Put ``result`` under ``key`` in the JSON file at ``path`` (created if missing), with its command, date,
    the commit it ran at and the machine's load average (1, 5, 15 min) as it ended, which says how far its
    absolute figures can be trusted. The command is ``python -m`` the module running as ``__main__`` (else
    ``bench.<module>``, ``module`` defaulting to ``key``) with ``argv``'s arguments."""
    document = {}
    if os.path.exists(path):
        with open(path) as f:
            document = json.load(f)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    running = spec.name if spec is not None and spec.name.startswith("bench.") else "bench." + (module or key)
    document[key] = dict(result, command=" ".join(["python -m " + running, *argv[1:]]),
                         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         load_average=[round(x, 2) for x in os.getloadavg()], commit=commit())
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
        f.write("\n")


def print_and_store(result: dict, key: str, out: str | None, line: Callable[[str, dict], str],
                    rows: Iterable[tuple[str, dict]] | None = None, module: str | None = None) -> dict:
    """End a bench's ``main()``: print ``line(side, result[side])`` for before then after, and with ``out`` (its
    ``--out``) ``store`` the result under ``key`` there with this command; return the result.

    ``rows``, pairs of a name and a row to print instead of the two sides, serves a result that is not split
    in before and after; ``line`` may return several lines joined by newlines (a side measured in phases).
    """
    for name, row in rows if rows is not None else ((side, result[side]) for side in ("before", "after")):
        print(line(name, row))
    if out:
        store(out, key, result, sys.argv, module)
    return result
