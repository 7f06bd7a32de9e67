"""In-memory per-rank state: each rank's view across its incarnations (:mod:`._incarnation`), totals, snapshots,
expiry, and the limits a new rank or run must fit."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ._evidence import device_key
from ._incarnation import Incarnation
from ._ownership import owner
from ._scale_trace import ScaleTrace
from ._schema import Batch
from ._totals import OptimizerTotals, RankTotals

if TYPE_CHECKING:
    from ._config import ServerConfig

__all__ = ["RankState", "RankView", "RankSnapshot", "CollectorState", "LimitExceeded", "RUNS_RETRY_AFTER_S"]

_NO_RANK = RankTotals()
_NO_OPTIMIZER = OptimizerTotals()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RankSnapshot:
    """What the collector knows about one rank at one moment: what the alert conditions read."""

    run: str
    rank: int
    last_seen: float
    """Unix time the collector received the rank's latest batch."""
    iteration: int = 0
    loss_scale: float | None = None
    """The loss scale as ``/metrics`` exposes it (``ampwatch_loss_scale``): None without an enabled GradScaler."""
    scaler_enabled: bool = True
    closed: bool = False
    totals: RankTotals = _NO_RANK
    optimizers: Mapping[str, OptimizerTotals] = dataclasses.field(default_factory=dict)
    """Totals over the rank's processes, by optimizer."""
    consecutive_skipped: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """The current skip streak of each optimizer (the newest process's gauge); 0 when left out."""
    host: str = ""
    local_rank: int = 0
    conflicts: int = 0
    """Processes that claimed the rank while it was live and were kept out (``ampwatch_rank_conflicts_total``)."""
    gradient_outliers: int = 0
    """Iterations the collector judged this rank's own gradient norm an outlier among the run's ranks
    (``ampwatch_rank_gradient_outliers_total``, :mod:`._outliers`)."""
    device: str = ""
    """The device the rank runs on, as the evidence names it (``_evidence.device_key``)."""
    on_suspect_device: int = 0
    """1 while that device is a suspect (GET /v1/suspects), else 0 (``ampwatch_rank_on_suspect_device``)."""
    diagnosis: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    """optimizer -> (event id, began, samples) of the newest process's latest skip or poisoned step that said
    where it began or on which samples (``Incarnation.diagnosis``): what the notifications add."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankView:
    """One rank as of one applied batch: replaced whole, never changed, so a reader in another thread sees one batch.

    :meth:`RankState.install` builds the next view (O(optimizers + incarnations)); a reader
    (``/metrics`` rendered in a worker thread) takes ``rank.view`` once and reads only that.
    """

    run: str
    rank: int
    incarnations: Mapping[str, Incarnation]
    current: Incarnation | None  # the rank's owner (:func:`._ownership.owner`); its gauges are the rank's gauges
    totals: RankTotals
    optimizer_totals: Mapping[str, OptimizerTotals]  # in the order the optimizers first appeared
    first_seen: float = float("inf")  # when the collector first saw any of the rank's processes
    gradient_outliers: int = 0  # over every process of the rank (Incarnation.gradient_outliers): never falls

    def installed(self, new: Incarnation) -> RankView:
        """Return the view after ``new`` became the applied state of its incarnation (totals move by the difference)."""
        old = self.incarnations.get(new.id)
        totals = self.totals.moved_by(new.totals, old.totals if old else _NO_RANK)
        optimizer_totals = dict(self.optimizer_totals)
        for name, counters in new.optimizers.items():
            before = old.optimizers.get(name, _NO_OPTIMIZER) if old else _NO_OPTIMIZER
            optimizer_totals[name] = optimizer_totals.get(name, _NO_OPTIMIZER).moved_by(counters, before)
        incarnations = dict(self.incarnations)
        incarnations[new.id] = new
        current = self.current
        if current is not None and current.id == new.id and current.replayed_only == new.replayed_only:
            current = new  # the owner's next batch: nearly every batch
        else:
            current = owner(incarnations.values())
        outliers = self.gradient_outliers + new.gradient_outliers - (old.gradient_outliers if old else 0)
        return RankView(self.run, self.rank, incarnations, current, totals, optimizer_totals,
                        min(self.first_seen, new.first_seen), outliers)

    def excluded(self, claimant: Incarnation) -> RankView:
        """Return the view with ``claimant`` (from :func:`._ownership.claimants`) out of the rank (see
        :meth:`RankState.exclude`); the totals do not move."""
        incarnations = dict(self.incarnations)
        incarnations[claimant.id] = claimant  # the same counters
        return dataclasses.replace(self, incarnations=incarnations, current=owner(incarnations.values()))

    def _own(self) -> Iterable[Incarnation]:
        """The rank's incarnations, less those in conflict."""
        return (inc for inc in self.incarnations.values() if inc.conflict_with is None)

    @property
    def conflicting(self) -> list[Incarnation]:
        """Incarnations put out of the rank (rank_conflict): counted in ``ampwatch_rank_conflicts_total``."""
        return [inc for inc in self.incarnations.values() if inc.conflict_with is not None]

    @property
    def owner(self) -> Incarnation:
        """``current``, of a rank that applied a batch: such a rank has one for good (the process that sends again
        is never put out of it), and readers are handed no other."""
        if self.current is None:
            raise LookupError(f"rank {self.rank} of run {self.run!r} has applied no batch")
        return self.current

    @property
    def last_seen(self) -> float:
        return max((inc.last_seen for inc in self._own()), default=0.0)

    @property
    def closed(self) -> bool:
        return self.current is not None and self.current.closed

    def longest_streak(self, optimizer: str) -> int:
        """Longest skip streak of ``optimizer`` over every incarnation."""
        return max((inc.longest.get(optimizer, 0) for inc in self._own()), default=0)

    def latest_nonfinite(self, optimizer: str) -> str | None:
        """The latest parameter named on a skip of ``optimizer``, newest incarnation first (a replayed one last)."""
        best = None
        for inc in self._own():
            hit = inc.nonfinite.get(optimizer)
            if hit is not None and (best is None or (not inc.replayed_only, inc.first_seen, hit[0]) > best[0]):
                best = ((not inc.replayed_only, inc.first_seen, hit[0]), hit[1])
        return best[1] if best else None

    def consecutive_skipped(self, optimizer: str) -> int:
        """The current skip streak of ``optimizer``, as the newest process last reported it (0 if it did not)."""
        values = self.current.batch.state.optimizers.get(optimizer) if self.current else None
        return values.consecutive_skipped if values is not None else 0

    def optimizers(self) -> Iterable[str]:
        """The rank's optimizer names, over every process, in the order they first appeared."""
        return self.optimizer_totals.keys()

    def shown(self) -> tuple:
        """What the run view shows of this rank, progress counters (iteration, steps, last seen) left out.

        The run's change generation moves when this does; O(optimizers).
        """
        if self.current is None:
            return ()
        batch = self.current.batch
        return (self.closed, repr(batch.state.loss_scale), batch.scaler.enabled, batch.host,
                tuple((o.skipped, o.poisoned_steps) for o in self.optimizer_totals.values()),
                tuple(values.consecutive_skipped for values in batch.state.optimizers.values()))

    def device(self) -> str:
        """The device the rank's newest process runs on, as the evidence names it (``_evidence.device_key``)."""
        owner = self.owner
        return device_key(owner.batch.host, owner.batch.local_rank, owner.device.uuid if owner.device else None)

    def snapshot(self, suspect_devices: frozenset[str] = frozenset()) -> RankSnapshot:
        """Return this rank, for the alert evaluator (shares the immutable totals: no copy); ``suspect_devices``:
        the devices now suspected (``SuspectJudge``)."""
        batch = self.owner.batch
        device = self.device()
        return RankSnapshot(run=self.run, rank=self.rank, last_seen=self.last_seen, iteration=batch.state.iteration,
                            loss_scale=batch.state.loss_scale if batch.scaler.enabled else None,
                            scaler_enabled=batch.scaler.enabled,
                            closed=self.closed, totals=self.totals, optimizers=self.optimizer_totals,
                            consecutive_skipped={name: values.consecutive_skipped
                                                 for name, values in batch.state.optimizers.items()},
                            host=batch.host, local_rank=batch.local_rank, conflicts=len(self.conflicting),
                            gradient_outliers=self.gradient_outliers,
                            device=device, on_suspect_device=int(device in suspect_devices),
                            diagnosis=self.owner.diagnosis)


class RankState:
    """One (run, rank): its incarnations and the totals over all of them, as one :class:`RankView`.

    Readers take ``rank.view`` (one attribute read) and read everything from it: :meth:`install` and
    :meth:`exclude` swap in the next view (one reference assignment), so a thread holding an older view
    keeps a consistent rank. Nothing here forwards to the view, so no reader can mix two batches' views.
    """

    __slots__ = ("run", "rank", "view", "scale_trace")

    def __init__(self, run: str, rank: int) -> None:
        self.run, self.rank = run, rank
        self.view = RankView(run, rank, {}, None, _NO_RANK, {})
        self.scale_trace = ScaleTrace()  # the newest process's loss scale over iterations (memory only)

    def install(self, new: Incarnation) -> None:
        """Make ``new`` the applied state of its incarnation; totals move by the difference only."""
        before = self.view.current
        self.view = self.view.installed(new)
        if self.view.current is new:
            self.scale_trace.record_batch(new.batch, new_process=before is None or before.id != new.id)

    def recount(self, new: Incarnation) -> None:
        """Make ``new`` the applied state of its incarnation: the same process and batch, with a count the collector
        keeps itself moved (``gradient_outliers``); no batch was applied, so the loss-scale trace stays."""
        self.view = self.view.installed(new)

    def exclude(self, claimant: Incarnation) -> None:
        """Put ``claimant`` (from :func:`._ownership.claimants`) out of the rank: it is never again its current
        process, its gauges, liveness or parameter names; the rank's owner is chosen again among the others.

        What it counted until now stays in the totals: counters exposed to Prometheus must never go down
        (a drop reads as a reset, and ``increase()`` would count the whole rank again). It counts no more:
        the collector refuses its later batches.
        """
        self.view = self.view.excluded(claimant)


class LimitExceeded(Exception):
    """A batch would exceed a limit; ``retry`` says whether the same batch may pass later.

    Permanent (``retry`` False, answered 422): resending cannot help, as the rank's own batches
    will always break it (too many optimizers, a name too long, a rank past its run's limit).
    Back-pressure (``retry`` True, answered 429 with ``retry_after``): it clears by itself
    (finished runs retire and free room).
    """

    def __init__(self, message: str, *, retry: bool, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.retry, self.retry_after = message, retry, retry_after

    @property
    def status(self) -> int:
        return 429 if self.retry else 422


RUNS_RETRY_AFTER_S = 60
"""Retry-After of a batch refused because the collector holds --max-runs runs (runs retire over minutes)."""


class CollectorState:
    """Every rank shown in /metrics, grouped by run."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config  # its max_runs, max_ranks_per_run, max_optimizers_per_rank and max_label_length
        self.runs: dict[str, dict[int, RankState]] = {}
        # (run, rank) with history in the database but not held here: only these need a database read
        # when a batch arrives (a brand-new rank does not).
        self.stored: set[tuple[str, int]] = set()
        self.generations: dict[str, int] = {}  # run -> its latest change to what its run view shows (see moved())
        self._changes = 0  # over every run: a run that leaves and comes back never repeats an earlier generation

    def moved(self, run: str) -> None:
        """Note that what the run view of ``run`` shows changed (its cached bodies are stale); O(1)."""
        self._changes += 1
        self.generations[run] = self._changes

    def generation(self, run: str) -> int:
        """The run's change generation: equal values mean the run view would show the same ranks."""
        return self.generations.get(run, 0)

    def get(self, run: str, rank: int) -> RankState | None:
        ranks = self.runs.get(run)
        return ranks.get(rank) if ranks else None

    def rank_count(self) -> int:
        """Ranks held; safe to call from another thread (see :meth:`views`)."""
        return sum(map(len, list(self.runs.values())))

    def views(self) -> list[tuple[RankState, RankView]]:
        """Return every rank held that has applied a batch, each with its view as of now; O(ranks).

        Safe to call from a thread other than the event loop's while ingest goes on: each
        ``list(...)`` copy is one C call, which another Python thread cannot interleave with
        (the GIL), and a view never changes once built. A batch applied meanwhile shows or not,
        but whole, per rank.
        """
        out = []
        for ranks in list(self.runs.values()):
            for rank in list(ranks.values()):
                view = rank.view
                if view.current is not None:
                    out.append((rank, view))
        return out

    def check_limits(self, batch: Batch, known: RankState | None) -> None:
        """Raise :class:`LimitExceeded` when ``batch`` would grow the state past a limit."""
        lim = self.config
        too_long = [name for name in (batch.run, *batch.state.optimizers) if len(name) > lim.max_label_length]
        if too_long:
            raise LimitExceeded(f"name {too_long[0][:40]!r}... is {len(too_long[0])} characters, over this "
                                f"collector's label limit of {lim.max_label_length}: use a shorter run or "
                                f"optimizer name, or raise --max-label-length", retry=False)
        ranks = self.runs.get(batch.run)
        if ranks is None and len(self.runs) >= lim.max_runs:
            raise LimitExceeded(f"this collector already holds {len(self.runs)} runs (--max-runs "
                                f"{lim.max_runs}); retry later, when finished runs retire, or raise the limit",
                                retry=True, retry_after=RUNS_RETRY_AFTER_S)
        if known is None and ranks is not None and len(ranks) >= lim.max_ranks_per_run:
            raise LimitExceeded(f"run {batch.run!r} already has {len(ranks)} ranks (--max-ranks-per-run "
                                f"{lim.max_ranks_per_run}); send this rank to another collector or raise "
                                f"the limit", retry=False)
        names = set(batch.state.optimizers)
        if known is not None:
            names.update(known.view.optimizers())
        if len(names) > lim.max_optimizers_per_rank:
            raise LimitExceeded(f"rank {batch.rank} of run {batch.run!r} would have {len(names)} optimizers "
                                f"(--max-optimizers-per-rank {lim.max_optimizers_per_rank}); watch fewer "
                                f"optimizers or raise the limit", retry=False)

    def adopt(self, rank: RankState) -> None:
        """Hold ``rank`` (new, or restored from the database)."""
        ranks = self.runs.setdefault(rank.run, {})
        if ranks.get(rank.rank) is not rank:
            ranks[rank.rank] = rank
            self.moved(rank.run)
        self.stored.discard((rank.run, rank.rank))

    def retire(self, now: float, expire_after: float, run_retention: float) -> list[tuple[str, int]]:
        """Drop ranks silent past ``expire_after`` and runs closed for ``run_retention``; return what left."""
        gone: list[tuple[str, int]] = []
        for run, ranks in list(self.runs.items()):
            if ranks and all(r.view.closed for r in ranks.values()) and \
                    max(r.view.last_seen for r in ranks.values()) + run_retention <= now:
                gone.extend((run, rank) for rank in ranks)
                del self.runs[run]
                self.generations.pop(run, None)
                continue
            for rank_id, rank in list(ranks.items()):
                view = rank.view
                if not view.closed and view.last_seen + expire_after <= now:
                    gone.append((run, rank_id))
                    del ranks[rank_id]
                    self.moved(run)
            if not ranks:
                del self.runs[run]
                self.generations.pop(run, None)
        self.stored.update(gone)
        return gone
