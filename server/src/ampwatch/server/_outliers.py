"""The rank whose gradients stand out: local gradient-norm spikes judged across a run's ranks (the rule table:
docs/protocol.md#gradient_outlier).

An agent watching with ``ddp=`` judges its rank's own gradient norm (before DDP's all-reduce) against its own
history and sends a ``grad_norm_spike`` with ``local: true`` when it spikes. Here each such spike is compared with
the other ranks' rolling levels of the same optimizer (their ``local_grad_norm``): far above the median of their
means, by a robust spread, it is a ``gradient_outlier``. Work is done per local spike, never per batch: a healthy
run sends none, and its batches cost one dict lookup (``OutlierJudge.waiting``).

:func:`verdict` is the rule, pure; :class:`OutlierJudge` keeps the spikes waiting for the other ranks to report
their iteration (memory only) and decides when each is judged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ampwatch.contract.protocol import HEARTBEAT_INTERVAL_S
from ampwatch.contract.thresholds import AlertThresholds

from ._evidence import outlier_evidence_row
from ._floats import wire_float
from ._schema import Batch, DeviceInfo, GradNormSpikeEvent, Samples

__all__ = ["LocalSpike", "Level", "Outlier", "verdict", "whole_job", "local_spikes", "levels_of", "OutlierJudge",
           "WAIT_S", "MAD_SCALE"]

WAIT_S = 2.0 * HEARTBEAT_INTERVAL_S
"""How long a spike waits for every other rank to report its iteration before it is judged with what is known."""
MAD_SCALE = 1.4826
"""1.4826 x the median absolute deviation estimates a normal distribution's standard deviation."""
_SEEN_FOR_S = 10 * WAIT_S  # how long the ranks that spiked at an iteration are remembered (rows 3 and 7)


@dataclasses.dataclass(frozen=True, slots=True)
class LocalSpike:
    """A ``grad_norm_spike`` with ``local: true``: rank ``rank``'s own gradient norm spiked at ``iteration``."""

    run: str
    rank: int
    incarnation: str
    event_id: int
    iteration: int
    optimizer: str
    value: float
    time: float
    world_size: int
    samples: Samples | None
    arrived: float

    @property
    def key(self) -> tuple[str, str, int]:
        """The run's iteration of one optimizer: the ranks that spiked there are counted together (row 3)."""
        return (self.run, self.optimizer, self.iteration)


@dataclasses.dataclass(frozen=True, slots=True)
class Level:
    """Another rank's rolling level of its own gradient norm (``local_grad_norm``), and how far it has got."""

    rank: int
    mean: float
    std: float
    iteration: int
    closed: bool = False
    """The rank closed: its last level still describes its last window, but it reports no further iteration."""


@dataclasses.dataclass(frozen=True, slots=True)
class Outlier:
    """A spike judged a gradient outlier: what its ``gradient_outlier`` event says."""

    spike: LocalSpike
    reference: float
    """The median of the other ranks' means."""
    spread: float
    """max(1.4826 x MAD of their means, the median of their deviations), floored as the agent floors a deviation."""
    z: float | None
    """(value - reference) / spread; None for a non-finite value."""
    ranks_compared: int

    def body(self, now: float) -> dict[str, Any]:
        """The event as stored and listed (``GET /v1/runs/{run}/events``), non-finite values as the protocol
        writes them."""
        s = self.spike
        return {"id": -s.event_id, "kind": "gradient_outlier", "time": now, "iteration": s.iteration,
                "optimizer": s.optimizer, "rank": s.rank, "value": wire_float(s.value), "reference": self.reference,
                "spread": self.spread, "z": self.z, "ranks_compared": self.ranks_compared,
                "spike_id": s.event_id}

    def rows(self, batch: Batch, device: DeviceInfo | None, now: float) -> tuple[tuple, tuple]:
        """Its ``events`` row and its ``evidence`` row, under the process that sent the spike (``batch``: its last
        applied one; ``device``: its device as last known). Their id is minus the spike's: stored once, and never
        one an agent numbers (from 1) or a ``rank_conflict`` (0)."""
        s = self.spike
        event = (s.run, s.rank, s.incarnation, -s.event_id, "gradient_outlier", now, s.iteration, s.optimizer,
                 json.dumps(self.body(now)))
        evidence = outlier_evidence_row(s.run, s.rank, s.incarnation, -s.event_id, min(s.time, now), s.iteration,
                                        s.optimizer, s.world_size, batch.host, batch.local_rank, device, s.samples)
        return event, evidence


def verdict(spike: LocalSpike, others: Sequence[Level], spiking_ranks: int, t: AlertThresholds,
            after_another: bool = False) -> Outlier | None:
    """Return the outlier ``spike`` is, or None (the rows of the table in docs/protocol.md#gradient_outlier).

    ``others``: the other ranks' levels (closed ones: their last) for the spike's optimizer; ``spiking_ranks``: how
    many ranks (this one included) sent a local spike of that optimizer at that iteration; ``after_another``:
    another rank's own gradient norm spiked within ``outlier_after_iterations`` before it.
    """
    if not others:
        return None  # 1: nothing to compare with
    if whole_job(spiking_ranks, spike.world_size, t):
        return None  # 3: the whole job spiked, not one rank
    if after_another:
        return None  # 3b: a consequence of another rank's spike, which reached every rank's weights
    means = [o.mean for o in others]
    reference = statistics.median(means)
    mad = statistics.median(abs(m - reference) for m in means)
    spread = max(MAD_SCALE * mad, statistics.median(o.std for o in others), 1e-6 * abs(reference), 1e-12)
    if not math.isfinite(spike.value):
        return Outlier(spike, reference, spread, None, len(others))  # 4: its own gradients went non-finite alone
    z = (spike.value - reference) / spread
    if z >= t.outlier_sigma:
        return Outlier(spike, reference, spread, z, len(others))  # 5
    return None  # 6


def whole_job(spiking_ranks: int, world_size: int, t: AlertThresholds) -> bool:
    """Row 3: more than ``outlier_rank_share`` of the run's ranks, and more than one, spiked at one iteration."""
    return spiking_ranks > 1 and spiking_ranks > t.outlier_rank_share * world_size


def local_spikes(batch: Batch, applied: int, now: float) -> list[LocalSpike]:
    """The local gradient-norm spikes among the events of ``batch`` not applied before (an id above ``applied``, the
    process's newest applied one)."""
    return [LocalSpike(batch.run, batch.rank, batch.incarnation, e.id, e.iteration, e.optimizer, float(e.value),
                       e.time, batch.world_size, e.samples, now)
            for e in batch.events if isinstance(e, GradNormSpikeEvent) and e.local and e.id > applied]


@dataclasses.dataclass(slots=True)
class _Iteration:
    """The local spikes of one (run, optimizer, iteration): those not judged yet, every rank that sent one, and the
    ranks it waits for (row 2: those with a level that had not reported the iteration when it was first looked at;
    each leaves as its batch reports it, so a waiting spike costs each batch of its run O(1))."""

    arrived: float
    waiting: list[LocalSpike] = dataclasses.field(default_factory=list)
    ranks: set[int] = dataclasses.field(default_factory=set)
    lagging: set[int] | None = None


class OutlierJudge:
    """The spikes waiting to be judged (memory only: a restart loses those not judged yet), and which ranks spiked
    at each iteration. One per collector; called on the event loop only."""

    def __init__(self, thresholds: AlertThresholds, wait_s: float = WAIT_S) -> None:
        self.thresholds, self.wait_s = thresholds, wait_s
        self.ranks_judged: Callable[[str, int], int] = lambda run, world_size: world_size
        """(run, world size) -> the ranks of the run this collector judges: the world size, but for a run split
        over several collectors (the ranks of its blocks here: ``_placement_view.Placements.ranks_judged``)."""
        self.waiting: dict[str, set[tuple[str, str, int]]] = {}
        """run -> its iterations with spikes not judged yet (empty in a healthy run: what each batch checks)."""
        self._iterations: dict[tuple[str, str, int], _Iteration] = {}

    def note(self, spikes: Iterable[LocalSpike]) -> None:
        """Take a batch's local spikes; a (rank, iteration, optimizer) already taken is not taken again (row 7)."""
        for spike in spikes:
            it = self._iterations.get(spike.key)
            if it is None:
                it = self._iterations[spike.key] = _Iteration(spike.arrived)
            if spike.rank in it.ranks:
                continue
            it.ranks.add(spike.rank)
            it.waiting.append(spike)
            self.waiting.setdefault(spike.run, set()).add(spike.key)

    def due(self, run: str, ranks: Mapping[int, Any], now: float, reported: tuple[int, int] | None = None
            ) -> list[Outlier]:
        """Judge the spikes of ``run`` that are due (every other rank compared reported the iteration, row 2, or
        they waited :attr:`wait_s`); return the outliers. ``ranks``: the run's ``RankState`` by rank;
        ``reported``: (rank, iteration) of the batch just applied, if any."""
        keys = self.waiting.get(run)
        if not keys:
            return []
        found: list[Outlier] = []
        for key in list(keys):
            it, (_, optimizer, iteration) = self._iterations[key], key
            if whole_job(len(it.ranks), self.ranks_judged(run, it.waiting[0].world_size), self.thresholds):
                it.waiting.clear()  # row 3, whatever comes later: no need to wait or to compare
            else:
                if it.lagging is None:
                    it.lagging = {level.rank for level in levels_of(ranks, optimizer)
                                  if level.iteration < iteration and not level.closed}
                elif reported is not None and reported[1] >= iteration:
                    it.lagging.discard(reported[0])
                if it.lagging - it.ranks and now - it.arrived < self.wait_s:
                    continue
                levels = levels_of(ranks, optimizer)
                before = self._spiked_before(run, iteration)
                for spike in it.waiting:
                    others = [level for level in levels if level.rank != spike.rank]
                    outlier = verdict(spike, others, len(it.ranks), self.thresholds,
                                      after_another=bool(before - {spike.rank}))
                    if outlier is not None:
                        found.append(outlier)
                it.waiting.clear()
            keys.discard(key)
        if not keys:
            del self.waiting[run]
        return found

    def _spiked_before(self, run: str, iteration: int) -> set[int]:
        """The ranks of ``run`` whose own gradient norm (any optimizer's) spiked in the ``outlier_after_iterations``
        iterations before ``iteration`` (row 3b). Scans what is remembered: a few entries, only when judging."""
        since = iteration - self.thresholds.outlier_after_iterations
        return {rank for (spiked_run, _, at), it in self._iterations.items()
                if spiked_run == run and since <= at < iteration for rank in it.ranks}

    def runs_waiting(self) -> list[str]:
        """The runs with spikes not judged yet."""
        return list(self.waiting)

    def forget(self, now: float) -> None:
        """Drop what is remembered of judged iterations whose first spike is older than ``_SEEN_FOR_S`` (bounded
        memory)."""
        old = [key for key, it in self._iterations.items() if now - it.arrived > _SEEN_FOR_S and not it.waiting]
        for key in old:
            del self._iterations[key]


def levels_of(ranks: Mapping[int, Any], optimizer: str) -> list[Level]:
    """The ranks of ``ranks`` (``RankState`` by rank) with a ``local_grad_norm`` level for ``optimizer``, as their
    newest process last sent it; a rank that closed too (a spike near a job's end is compared with the ranks that
    closed just after it), though none waits for it."""
    found = []
    for number, rank in ranks.items():
        view = rank.view
        if view.current is None:
            continue
        state = view.current.batch.state
        sent = state.optimizers.get(optimizer)
        level = sent.local_grad_norm if sent is not None else None
        if level is not None:
            found.append(Level(number, level.mean, level.std, state.iteration, view.closed))
    return found
