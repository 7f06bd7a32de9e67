"""Which collector a rank reports to: a whole run on one replica, a run bigger than a block in blocks of ranks.

Every rank of a job and every collector compute the same placement from the same three facts, with no
coordination: the run's name, its world size and the list of collectors (``AMPWATCH_URL`` on the agents,
``--peers`` on the collectors), plus the block size (``AMPWATCH_BLOCK_RANKS`` / ``--block-ranks``, both
defaulting to :data:`BLOCK_RANKS`).

The rule, one row per case (``contract/tests/test_placement.py`` has a test for each):

- **No collector listed**: nowhere; :func:`collector_for` raises ``ValueError``.
- **One collector**: that collector.
- **A run of at most ``block_ranks`` ranks**: the run's first collector by rendezvous hashing (the highest
  random weight of run and collector), whatever the rank.
- **A bigger run**: contiguous blocks of ``block_ranks`` ranks (the last one shorter); block ``b`` goes to
  the run's ``b % n``-th collector in that same ranking, so a run's blocks spread evenly over ``n`` collectors.
- **The same collectors in another order, twice, or with a trailing ``/``**: the same collector (the list
  is a set of normalized URLs).
- **A collector added**: a run moves only if the new one ranks first for it (about 1 run in ``n + 1``).
- **A collector removed**: only the runs (or blocks) it held move.
- **A rank outside ``0 <= rank < world_size``, or a size below 1**: ``ValueError``.

A collector that is down keeps its runs: agents retry it (and spool), they never move to another
replica mid-run, so a run's counters never split between two collectors.

>>> urls = ["http://c1:9457", "http://c2:9457", "http://c3:9457"]
>>> len({collector_for("exp-7", rank, 64, urls) for rank in range(64)})
1
>>> [(b.first_rank, b.last_rank) for b in blocks("big", 20_000, urls, block_ranks=8_192)]
[(0, 8191), (8192, 16383), (16384, 19999)]
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

__all__ = ["BLOCK_RANKS", "Block", "normalize", "ranking", "blocks", "block_of", "block_collector", "collector_for"]

BLOCK_RANKS = 4_096
"""Ranks of one run a single collector holds before the run is split into blocks: the most at which one
collector, on one core of this project's 2-core machine, still shows every rank's first skip of a whole-job
storm in ``/metrics`` within 2 s (4,096: p99 1.62 s; 8,192: 4,662 of 8,191 ranks within 2 s, p99 3.45 s;
docs/benchmarks.md, "9b. A 16,384-rank job on 2 replicas"), so a run is split only where one replica could not
take its storm whole."""


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One contiguous range of a run's ranks and the collector that holds it."""

    index: int
    first_rank: int
    last_rank: int  # inclusive
    collector: str

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.first_rank <= rank <= self.last_rank


def normalize(url: str) -> str:
    """The form a collector's URL is compared in: no surrounding space, no trailing ``/``, scheme and host lower case.

    >>> normalize(" HTTP://C1.example:9457/ ")
    'http://c1.example:9457'
    """
    url = url.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{slash}{path}"


def _weight(run: str, collector: str) -> int:
    digest = hashlib.blake2b(f"{run}\x00{collector}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranking(run: str, collectors: Iterable[str]) -> tuple[str, ...]:
    """The collectors in the order ``run`` prefers them (rendezvous hashing), normalized and without repeats."""
    unique = {normalize(url) for url in collectors if url.strip()}
    return tuple(sorted(unique, key=lambda url: (_weight(run, url), url), reverse=True))


def block_collector(order: tuple[str, ...], index: int) -> str:
    """The collector of block ``index`` of a run whose :func:`ranking` is ``order``: blocks are dealt out in turn."""
    return order[index % len(order)]


def _check(world_size: int, block_ranks: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks >= 1, got {world_size!r}")
    if isinstance(block_ranks, bool) or not isinstance(block_ranks, int) or block_ranks < 1:
        raise ValueError(f"block_ranks (AMPWATCH_BLOCK_RANKS, --block-ranks) must be a whole number of ranks >= 1, "
                         f"got {block_ranks!r}")


def block_of(rank: int, world_size: int, block_ranks: int = BLOCK_RANKS) -> int:
    """The index of the block holding ``rank`` (0 for a run of at most ``block_ranks`` ranks)."""
    _check(world_size, block_ranks)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for a world of {world_size}, got {rank!r}")
    return 0 if world_size <= block_ranks else rank // block_ranks


def blocks(run: str, world_size: int, collectors: Iterable[str], block_ranks: int = BLOCK_RANKS) -> tuple[Block, ...]:
    """Every block of ``run`` in rank order, each with its collector (one block when the run fits in one)."""
    _check(world_size, block_ranks)
    order = ranking(run, collectors)
    if not order:
        raise ValueError("no collector configured: set AMPWATCH_URL or pass collector=")
    if world_size <= block_ranks:
        return (Block(0, 0, world_size - 1, order[0]),)
    return tuple(Block(index, first, min(first + block_ranks, world_size) - 1, block_collector(order, index))
                 for index, first in enumerate(range(0, world_size, block_ranks)))


def collector_for(run: str, rank: int, world_size: int, collectors: Iterable[str],
                  block_ranks: int = BLOCK_RANKS) -> str:
    """The one collector ``rank`` of ``run`` reports to (normalized URL)."""
    index = block_of(rank, world_size, block_ranks)
    order = ranking(run, collectors)
    if not order:
        raise ValueError("no collector configured: set AMPWATCH_URL or pass collector=")
    return block_collector(order, index)
