"""One agent process's record of a rank (an incarnation): applying a batch to it, and its database row.

Pure: :func:`next_incarnation` builds the record after a batch from the one before it (counters never go
down, events already applied are skipped); :meth:`Incarnation.to_row` and :meth:`Incarnation.from_row` are the
row the store keeps and recovery reads back. What a rank shows across its incarnations is in :mod:`._state`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec

from ampwatch.contract.batch import OPTIMIZER_LEVELS, RANK_LEVELS

from ._batch_parse import parse_batch
from ._schema import Batch, Began, DeviceInfo, IterationSamples, PoisonedStepEvent, Samples, SkipEvent
from ._stored_form import encode_batch_state
from ._totals import OptimizerTotals, RankTotals

__all__ = ["Incarnation", "next_incarnation", "with_levels_kept"]

# The database keeps a process's counters as {"": rank counters, optimizer: its counters} (optimizer names are
# never empty); this is the one place that knows.
_RANK_KEY = ""
_NO_OPTIMIZER = OptimizerTotals()


@dataclasses.dataclass(slots=True)
class Incarnation:
    """The last applied state of one agent process of a rank."""

    id: str
    first_seen: float
    last_seen: float
    last_seq: int
    max_event_id: int
    closed: bool
    batch: Batch  # the last applied batch, for gauges and identity (its events are not used)
    totals: RankTotals  # cumulative, never lower than a previously applied value (a buggy agent cannot undo)
    optimizers: dict[str, OptimizerTotals]  # likewise, per optimizer
    longest: dict[str, int]
    nonfinite: dict[str, tuple[int, str]]  # optimizer -> (event id, latest offending parameter)
    displaced: tuple[str, ...] = ()
    """The live processes of the rank this one appeared beside (:func:`._ownership.beside`): a restart after a
    crash, or a second process claiming the rank; which one, a displaced process's next batch of its own tells.
    Kept for the incarnation's life (a claim does not lapse with the claimant's later batches)."""
    conflict_with: str | None = None
    """Set once a displaced incarnation sent again (two processes claim the rank): this one is then never again
    the rank's current process, gauges or liveness, and its later batches are refused; what it counted before
    stays in the totals (exposed counters never go down)."""
    replayed_only: bool = False
    """Every batch of it so far came from another process replaying a dead one's spool (``replayed``): the
    rank's history, never its owner while a process that sent for itself is there."""
    diagnosis: dict[str, tuple[int, Began | None, Samples | None, list[IterationSamples]]] = \
        dataclasses.field(default_factory=dict)
    """optimizer -> (event id, began, samples) of its latest skip or poisoned step that said where it began or
    which samples it trained on: what the alerts' notifications add (memory only: a restart starts it afresh)."""
    device: DeviceInfo | None = None
    """The device the process trains on, as its last batch that carried one said (agents send it until it is
    accepted): what its evidence rows name (docs/suspects.md)."""
    gradient_outliers: int = 0
    """Local gradient-norm spikes of this process the collector judged outliers among the run's ranks
    (``gradient_outlier`` events, :mod:`._outliers`): a count the collector keeps, never the agent's."""

    def to_row(self, batch_json: str | None = None) -> dict:
        """Return the database row that restores this incarnation (``batch_json``: the body, when it has no events)."""
        # Re-serialising the batch was a tenth of the ingest CPU; an event-free body restores to the same model.
        counters = {_RANK_KEY: self.totals.to_json(), **{name: t.to_json() for name, t in self.optimizers.items()}}
        return {"incarnation": self.id, "first_seen": self.first_seen, "last_seen": self.last_seen,
                "last_seq": self.last_seq, "max_event_id": self.max_event_id, "closed": int(self.closed),
                "batch": batch_json or encode_batch_state(self.batch),
                "counters": msgspec.json.encode({"counters": counters, "longest": self.longest,
                                                 "nonfinite": self.nonfinite, **self._claims()}).decode()}

    def _claims(self) -> dict:
        # Kept in the counters' JSON column (no schema change); absent for nearly every incarnation.
        return {k: v for k, v in (("displaced", list(self.displaced)), ("conflict_with", self.conflict_with),
                                  ("replayed_only", self.replayed_only), ("device", self.device),
                                  ("gradient_outliers", self.gradient_outliers)) if v}

    @classmethod
    def from_row(cls, row: dict) -> Incarnation:
        """Rebuild from :meth:`to_row` output."""
        extra = json.loads(row["counters"])
        counters = extra["counters"]
        return cls(id=row["incarnation"], first_seen=row["first_seen"], last_seen=row["last_seen"],
                   last_seq=row["last_seq"], max_event_id=row["max_event_id"], closed=bool(row["closed"]),
                   batch=parse_batch(row["batch"]),
                   totals=RankTotals.from_json(counters.get(_RANK_KEY, {})),
                   optimizers={name: OptimizerTotals.from_json(values) for name, values in counters.items()
                               if name != _RANK_KEY},
                   longest=extra["longest"], nonfinite={k: tuple(v) for k, v in extra["nonfinite"].items()},
                   displaced=_ids(extra.get("displaced")), conflict_with=extra.get("conflict_with"),
                   replayed_only=extra.get("replayed_only", False),
                   device=msgspec.convert(extra["device"], DeviceInfo) if extra.get("device") else None,
                   gradient_outliers=extra.get("gradient_outliers", 0))


def _ids(stored: str | list[str] | None) -> tuple[str, ...]:
    """Read ``displaced`` back: a list of ids (a single id, or none, from collectors before the list)."""
    if not stored:
        return ()
    return (stored,) if isinstance(stored, str) else tuple(stored)


def next_incarnation(old: Incarnation | None, batch: Batch, now: float, max_label_length: int,
                     displaced: tuple[str, ...] = ()) -> Incarnation:
    """Return the incarnation after applying ``batch`` on ``old`` (pure: ``old`` is not changed).

    ``displaced``: for a new incarnation, the live processes it appeared beside (see ``Incarnation``).
    A ``replayed`` batch (another process sending a dead one's spool) says nothing of its process's life:
    ``last_seen`` stays (a new incarnation's is the batch's own ``sent_at``, never after it arrived).
    """
    if old is not None:
        batch = with_levels_kept(old.batch, batch)
    state = batch.state
    totals = RankTotals.of(state)
    optimizers = {name: OptimizerTotals.of(values) for name, values in state.optimizers.items()}
    longest = {name: values.longest_streak for name, values in state.optimizers.items()}
    nonfinite: dict[str, tuple[int, str]] = {}
    diagnosis = dict(old.diagnosis) if old is not None else {}
    max_event_id = 0
    closed = batch.closed
    if old is not None:
        totals = totals.at_least(old.totals)
        for name, values in old.optimizers.items():
            optimizers[name] = optimizers.get(name, _NO_OPTIMIZER).at_least(values)
        for name, value in old.longest.items():
            longest[name] = max(longest.get(name, 0), value)
        nonfinite.update(old.nonfinite)
        max_event_id = old.max_event_id
        closed = closed or old.closed
    newest = max_event_id
    for event in batch.events:
        if event.id <= max_event_id:
            continue  # already applied (a reordered or repeated batch); the store ignores it too
        newest = event.id
        if isinstance(event, SkipEvent) and event.params:
            nonfinite[event.optimizer] = (event.id, event.params[0].name[:max_label_length])
        if isinstance(event, (SkipEvent, PoisonedStepEvent)) and (event.began or event.samples):
            before = event.samples_before
            if not before and (event.streak or 1) > 1 and event.optimizer in diagnosis:
                before = diagnosis[event.optimizer][3]  # the streak's first event carried them
            diagnosis[event.optimizer] = (event.id, event.began, event.samples, before)
        elif event.kind == "close":
            closed = True
    if not batch.replayed:
        last_seen = now
    else:
        last_seen = old.last_seen if old else min(batch.sent_at, now)
    return Incarnation(id=batch.incarnation, first_seen=old.first_seen if old else now, last_seen=last_seen,
                       last_seq=batch.seq, max_event_id=newest, closed=closed, batch=batch, totals=totals,
                       optimizers=optimizers, longest=longest, nonfinite=nonfinite,
                       displaced=old.displaced if old else displaced, conflict_with=old.conflict_with if old else None,
                       replayed_only=batch.replayed and (old is None or old.replayed_only),
                       diagnosis=diagnosis, device=batch.device or (old.device if old else None),
                       gradient_outliers=old.gradient_outliers if old else 0)


def with_levels_kept(before: Batch, batch: Batch) -> Batch:
    """Return ``batch`` with the rolling levels its process sent before and this batch leaves out, kept.

    An agent sends its levels (``state.loss``, each optimizer's ``grad_norm`` and ``local_grad_norm``) in one batch
    every few heartbeats, not in each (docs/protocol.md: they cost bytes, and a level over 128 iterations moves
    slowly): a batch without them keeps the ones its process sent last. ``batch`` itself when nothing is kept (the
    common case costs one look per optimizer).
    """
    state = batch.state
    kept: dict[str, Any] = {field: getattr(before.state, field) for field in RANK_LEVELS
                            if getattr(state, field) is None and getattr(before.state, field) is not None}
    optimizers: dict[str, Any] | None = None
    for name, values in state.optimizers.items():
        earlier = before.state.optimizers.get(name)
        if earlier is None:
            continue
        carried = {field: getattr(earlier, field) for field in OPTIMIZER_LEVELS
                   if getattr(values, field) is None and getattr(earlier, field) is not None}
        if carried:
            optimizers = optimizers or dict(state.optimizers)
            optimizers[name] = msgspec.structs.replace(values, **carried)
    if optimizers is not None:
        kept["optimizers"] = optimizers
    if not kept:
        return batch
    return msgspec.structs.replace(batch, state=msgspec.structs.replace(state, **kept))
