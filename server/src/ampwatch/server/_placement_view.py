"""Where each run this collector holds is placed among ``--peers``: split or whole, its blocks, which are here.

The collector applies the agents' rule (:mod:`ampwatch.contract.placement`) to the same facts: the run's name, its
world size (from its batches), ``--peers`` and ``--block-ranks``. A run's view is computed when its first batch comes
and again only when its world size changes, never per request; each applied batch then costs one dictionary read and
a division (:meth:`Placements.note`).

| case | ``split`` | blocks here | misplaced ranks |
|---|---|---|---|
| no ``--peers`` (one collector) | no view at all: nothing changes | | |
| a run of at most ``--block-ranks`` ranks placed here | false | its one block | 0 |
| a bigger run | true | each block ``b`` with ``b % len(peers)`` this collector's place in the run's ranking | 0 |
| a rank placed on another replica by the rule | | | counted once per rank, logged once per run; applied all the same |

(A misplaced rank: the agents and the collectors disagree on the block size or the URL list.)
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.parse
from collections.abc import Collection, Mapping

from ampwatch.contract.placement import Block, block_collector, block_of, collector_for, ranking

__all__ = ["RunPlacement", "Placements", "BLOCKS_LISTED"]

log = logging.getLogger("ampwatch.server")

BLOCKS_LISTED = 64
"""Blocks a run's view lists at most (``block_count`` says how many there are): a world size is the agents' word, and
``--block-ranks 1`` with a huge one must not make a huge answer."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlacement:
    """One run's placement as this collector computes it, for one world size."""

    run: str
    world_size: int
    block_ranks: int
    here: str
    """This collector's URL (``--advertise-url``, resolved)."""
    order: tuple[str, ...]
    """The collectors in the run's ranking (:func:`~ampwatch.contract.placement.ranking`)."""
    block_count: int
    blocks: tuple[Block, ...]
    """The first :data:`BLOCKS_LISTED` blocks, in rank order, each with its collector."""

    @classmethod
    def of(cls, run: str, world_size: int, peers: Collection[str], here: str, block_ranks: int) -> RunPlacement:
        order = ranking(run, peers)
        count = 1 if world_size <= block_ranks else -(-world_size // block_ranks)
        blocks = tuple(Block(index, index * block_ranks, min((index + 1) * block_ranks, world_size) - 1,
                             block_collector(order, index)) for index in range(min(count, BLOCKS_LISTED)))
        return cls(run, world_size, block_ranks, here, order, count, blocks)

    @property
    def split(self) -> bool:
        return self.block_count > 1

    @property
    def held_ranks(self) -> int:
        """How many of the run's ranks the rule places here (over every block, listed or not)."""
        count, n, size, place = self.block_count, len(self.order), self.block_ranks, self.order.index(self.here)
        if place >= count:
            return 0
        blocks_here = (count - 1 - place) // n + 1  # blocks place, place + n, ... (block_collector)
        short = count * size - self.world_size  # the last block's missing ranks
        return blocks_here * size - (short if block_collector(self.order, count - 1) == self.here else 0)

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` (of this world size) belongs here by the rule."""
        return block_collector(self.order, block_of(rank, self.world_size, self.block_ranks)) == self.here

    def to_json(self, misplaced: int) -> dict:
        """The ``placement`` object of ``GET /v1/runs/{run}`` (docs/collector.md)."""
        return {"world_size": self.world_size, "block_ranks": self.block_ranks, "split": self.split,
                "collector": self.here, "block_count": self.block_count,
                "blocks": [{"index": b.index, "first_rank": b.first_rank, "last_rank": b.last_rank,
                            "collector": b.collector, "here": b.collector == self.here} for b in self.blocks],
                "misplaced_ranks": misplaced}

    def mine(self) -> list[Block]:
        return [b for b in self.blocks if b.collector == self.here]

    def where(self) -> str:
        """The ranks this collector holds, as an alert says it: ``ranks 0-1 of 4 (block 1 of 2)``."""
        mine = self.mine()
        if not mine:  # every rank of it here is misplaced (or its blocks here are past those listed)
            return f"no block placed here of the {self.world_size} ranks ({self.block_count} blocks)"
        ranges = ", ".join(f"{b.first_rank}-{b.last_rank}" for b in mine)
        numbers = ", ".join(str(b.index + 1) for b in mine)
        return f"ranks {ranges} of {self.world_size} (block{'s' if len(mine) > 1 else ''} {numbers} of " \
               f"{self.block_count})"

    def others(self) -> list[tuple[Block, str]]:
        """The other blocks listed, each with the address of its run on that replica's status page."""
        return [(b, f"{b.collector}/#run={urllib.parse.quote(self.run, safe='')}")
                for b in self.blocks if b.collector != self.here]

    def label(self) -> str:
        """The ``block`` label of this split run's built-in alerts here: its block numbers, ``1`` or ``1,3``."""
        return ",".join(str(b.index + 1) for b in self.mine()) or "none"

    def texts(self) -> dict[str, str]:
        """What a built-in alert of this split run adds: ``block``, ``other_blocks`` and a sentence each for its
        summary and description."""
        others = self.others()
        listed = "; ".join(f"block {b.index + 1} (ranks {b.first_rank}-{b.last_rank}): {url}" for b, url in others)
        more = self.block_count - len(self.blocks)
        if more > 0:
            listed += f"; {more} more blocks not listed"
        return {"block": self.where(), "other_blocks": listed,
                "summary": f" [{self.where()} on this replica]",
                "description": f" This collector holds {self.where()} of this split run and judged only those; "
                               f"the other blocks are on other replicas ({listed}). The whole run's view is "
                               "Prometheus's, which scrapes every replica."}


class Placements:
    """The placement of each run held (:class:`RunPlacement`) and the ranks sent here that belong elsewhere.

    Disabled (every method a no-op, :meth:`of` None) without ``--peers``. Written on the event loop
    (:meth:`note`), read from any thread: a view is replaced whole, never changed.
    """

    def __init__(self, peers: Collection[str], here: str | None, block_ranks: int) -> None:
        self.peers, self.here, self.block_ranks = tuple(peers), here, block_ranks
        self.enabled = bool(self.peers) and here is not None
        self._views: dict[str, RunPlacement] = {}
        self._blocks: dict[str, tuple[str, Mapping[str, str]]] = {}  # split runs only: what their alerts add, made once
        self._misplaced: dict[str, set[int]] = {}

    def note(self, run: str, rank: int, world_size: int) -> None:
        """A batch of ``rank`` of ``run`` (saying ``world_size``) was applied; O(1) but when the world size changes."""
        if not self.enabled:
            return
        view = self._views.get(run)
        if view is None or view.world_size != world_size:
            assert self.here is not None
            view = self._views[run] = RunPlacement.of(run, world_size, self.peers, self.here, self.block_ranks)
            if view.split:
                self._blocks[run] = (view.label(), view.texts())
            else:
                self._blocks.pop(run, None)
            self._misplaced.pop(run, None)  # judged again by the new world size, rank by rank
        if rank < world_size and not view.holds(rank):
            misplaced = self._misplaced.setdefault(run, set())
            if not misplaced:
                owner = collector_for(run, rank, world_size, self.peers, self.block_ranks)
                log.warning("rank %d of run %r (world size %d) belongs to %s by this collector's placement "
                            "(--peers, --block-ranks %d), not here (%s): its batches are kept, and every such rank "
                            "counted in the run's placement (misplaced_ranks). Give the agents the same "
                            "AMPWATCH_URL list and AMPWATCH_BLOCK_RANKS as the collectors' --peers and "
                            "--block-ranks", rank, run, world_size, owner, self.block_ranks, self.here)
            misplaced.add(rank)

    def of(self, run: str) -> RunPlacement | None:
        """The run's placement, or None (no ``--peers``, or no batch of it seen)."""
        return self._views.get(run)

    def misplaced(self, run: str) -> int:
        """Ranks of ``run`` sent here that its placement puts on another replica."""
        return len(self._misplaced.get(run, ()))

    def ranks_judged(self, run: str, world_size: int) -> int:
        """The ranks of ``run`` this collector judges a share of the run over: ``world_size``, but for a split run
        the ranks of its blocks here (and those misplaced here): a gradient spike on most of them is the job's."""
        view = self._views.get(run)
        if view is None or not view.split or view.world_size != world_size:
            return world_size
        return view.held_ranks + self.misplaced(run)

    def to_json(self, run: str) -> dict | None:
        view = self._views.get(run)
        return None if view is None else view.to_json(self.misplaced(run))

    def alert_block(self, run: str) -> tuple[str, Mapping[str, str]] | None:
        """What the built-in alerts of ``run`` add, None unless it is split: their ``block`` label (:meth:`RunPlacement.
        label`: the replicas' alerts of one run stay apart in Alertmanager) and texts (:meth:`RunPlacement.texts`)."""
        return self._blocks.get(run)

    def keep(self, runs: Collection[str]) -> None:
        """Forget the runs not in ``runs`` (those the collector no longer holds)."""
        for run in [run for run in self._views if run not in runs]:
            del self._views[run]
            self._blocks.pop(run, None)
            self._misplaced.pop(run, None)
