"""Suspect devices and samples, judged at read time over the stored evidence (docs/suspects.md has the rules).

Pure: :func:`judge` takes the ``evidence`` rows (:mod:`._evidence`) and the settings and returns what
``GET /v1/suspects`` answers; :class:`SuspectJudge` reads the rows and keeps the answer until they change.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ._evidence import device_key

__all__ = ["SuspectSettings", "SuspectJudge", "judge", "for_run"]

_DECODE = msgspec.json.decode
_SHOWN_EVENTS = 20  # the events listed per suspect (all are counted)
_ROUNDS = 4  # samples and devices judged in turn until neither moves (two rounds settle every case we know)
_LISTED = 100  # suspects listed of each kind, most events first (``devices_total``, ``samples_total``: all)


@dataclasses.dataclass(frozen=True, slots=True)
class SuspectSettings:
    events: int = 3
    """K: a device is a suspect once it is the sole origin of this many events with different samples."""
    max_origins: int = 1
    """An event with more origin ranks than this is a whole-job overflow: never evidence against a device."""
    stand_out_ratio: float = 3.0
    """A suspect's count must be at least this many times the median count of its runs' other devices (0: off)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class _Row:
    run: str
    rank: int
    iteration: int
    optimizer: str
    kind: str
    time: float
    world_size: int
    host: str
    local_rank: int
    device: dict
    key: str
    origin: int | None
    calibration: bool
    samples: dict | None

    @classmethod
    def of(cls, row: dict) -> _Row:
        device = _DECODE(row["device"]) if row["device"] else {}
        return cls(row["run"], row["rank"], row["iteration"], row["optimizer"], row["kind"], row["time"],
                   row["world_size"], row["host"], row["local_rank"], device,
                   device_key(row["host"], row["local_rank"], device.get("uuid")), row["origin"],
                   bool(row["calibration"]), _DECODE(row["samples"]) if row["samples"] else None)

    def shown(self) -> dict[str, Any]:
        return {"run": self.run, "rank": self.rank, "iteration": self.iteration, "optimizer": self.optimizer,
                "kind": self.kind, "time": self.time, "samples": self.samples}


def _origin_set(rows: list[_Row]) -> list[_Row]:
    """The rows of one (run, iteration, optimizer) that started it: those saying ``origin: true`` when any row
    carries the flag, else every row (no rank can be told from the others)."""
    if any(r.origin is not None for r in rows):
        return [r for r in rows if r.origin == 1]
    return rows


def _one_per_rank(rows: list[_Row]) -> list[_Row]:
    """The rows of one event, a rank's ``gradient_outlier`` row left out where the rank sent a row of its own for it
    (a skip it started: the same origin, counted once, rule 13)."""
    sent = {r.rank for r in rows if r.kind != "gradient_outlier"}
    return [r for r in rows if r.kind != "gradient_outlier" or r.rank not in sent]


def judge(rows: Iterable[dict], settings: SuspectSettings,
          ranks_judged: Callable[[str, int], int] = lambda run, world_size: world_size) -> dict[str, Any]:
    """Return ``{"devices": [...], "samples": [...], "settings": {...}}`` judged over evidence ``rows``.

    ``ranks_judged(run, world_size)``: the ranks of a run an origin set is compared with (rules 4 and 5): its world
    size, but for a run split over several collectors the ranks this one holds (it sees only their evidence)."""
    occurrences: dict[tuple[str, int, str], list[_Row]] = defaultdict(list)
    devices: dict[str, _Row] = {}  # each device's latest row: its host, local rank and identity
    run_devices: dict[str, set[str]] = defaultdict(set)
    for raw in rows:
        row = _Row.of(raw)
        occurrences[_event_of(row)].append(row)
        if row.key not in devices or row.time >= devices[row.key].time:
            devices[row.key] = row
        run_devices[row.run].add(row.key)
    sole: dict[str, list[_Row]] = defaultdict(list)  # device -> the events it was the sole origin of
    origin_rows: list[_Row] = []  # the origin sets' rows that name samples
    for found in occurrences.values():
        if len(found) > 1:
            found = _one_per_rank(found)
        if any(r.calibration for r in found):
            continue  # the scaler settling: evidence of nothing
        origins = _origin_set(found)
        ranks = {r.rank for r in origins}
        job = ranks_judged(found[0].run, max(r.world_size for r in found))
        if len(ranks) >= job and any(r.origin is not None for r in found):
            continue  # every rank's own gradients overflowed: the job's cause (scale, learning rate), no sample's
        origin_rows += (row for row in origins if row.samples)
        if 0 < len(ranks) <= settings.max_origins and len(ranks) < job:
            for row in origins:
                sole[row.key].append(row)
    # Samples and devices explain events each other's way (rules 6, 8 and 12): the samples first, then the devices
    # over what they leave, then the samples again without the suspect devices' own events (a faulty device's
    # batches are no evidence against a sample), until neither moves.
    blamed: dict[str, dict[str, Any]] = {}
    for _ in range(_ROUNDS):
        blamed_rows = {id(r) for key in blamed for r in sole[key]}
        sample_rows = _explaining_samples([r for r in origin_rows if id(r) not in blamed_rows])
        found_devices = _suspect_devices(sole, sample_rows, devices, run_devices, settings)
        if found_devices.keys() == blamed.keys():
            break
        blamed = found_devices
    suspect_samples = {sample: len({_event_of(r) for r in hits}) for sample, hits in sample_rows.items()}
    suspects = list(found_devices.values())
    listed = sorted(suspect_samples, key=lambda i: (-suspect_samples[i], str(i)))[:_LISTED]
    samples = [_sample_entry(sample, sample_rows[sample]) for sample in listed]
    suspects.sort(key=lambda d: (-d["events"], d["device"]))
    return {"devices": suspects[:_LISTED], "samples": samples[:_LISTED], "devices_total": len(suspects),
            "samples_total": len(samples), "settings": settings.to_json(),
            "origin_events": [dict(_identity(devices[key]), origin_events=len(sole[key])) for key in sorted(sole)]}


def _explaining_samples(rows: list[_Row]) -> dict[Any, list[_Row]]:
    """The suspect samples among the origin ``rows`` (rules 6 and 12), each with the rows it explains.

    The sample in events on the most devices (then the most events) is taken first and explains its events; every
    other sample is then judged on the events left, so a batch-mate of a bad sample, or a sample a faulty device
    happened to train on, is not listed for having shared one event with it. A sample needs two events or more on
    two devices or more. Scores only fall as events are taken, so a heap with lazy rescoring finds each next one.
    """
    hits: dict[Any, list[_Row]] = defaultdict(list)  # an int and a string are different keys: 1 is not "1"
    for row in rows:
        for sample in row.samples["ids"]:  # type: ignore[index] # rows that name samples
            hits[sample].append(row)
    explained: set[tuple[str, int, str]] = set()

    def score(sample: Any) -> tuple[int, int]:
        left = [r for r in hits[sample] if _event_of(r) not in explained]
        return len({r.key for r in left}), len({_event_of(r) for r in left})

    heap = [(-devices, -events, str(sample), n, sample) for n, (sample, rows_of) in enumerate(hits.items())
            if len(rows_of) >= 2 for devices, events in [score(sample)] if devices >= 2 and events >= 2]
    heapq.heapify(heap)
    chosen: dict[Any, list[_Row]] = {}
    while heap:
        devices, events, order, n, sample = heapq.heappop(heap)
        now = score(sample)
        if now != (-devices, -events):
            if now[0] >= 2 and now[1] >= 2:
                heapq.heappush(heap, (-now[0], -now[1], order, n, sample))
            continue
        chosen[sample] = [r for r in hits[sample] if _event_of(r) not in explained]
        explained.update(_event_of(r) for r in chosen[sample])
    return chosen


def _suspect_devices(sole: dict[str, list[_Row]], sample_rows: dict[Any, list[_Row]], devices: dict[str, _Row],
                     run_devices: dict[str, set[str]], settings: SuspectSettings) -> dict[str, dict[str, Any]]:
    """The suspect devices (rules 7-11): each device's sole-origin events that name samples, none of them a
    suspect sample, in ``settings.events`` different batches or more, standing out from its runs' other devices."""
    counted = {key: [r for r in found if r.samples is not None
                     and not any(i in sample_rows for i in r.samples["ids"])]
               for key, found in sole.items()}
    suspects: dict[str, dict[str, Any]] = {}
    for key, found in counted.items():
        digests = {r.samples["digest"] for r in found if r.samples}
        if len(digests) < settings.events:
            continue
        runs = {r.run for r in found}
        peers = set().union(*(run_devices[run] for run in runs)) - {key}
        peer_counts = [len({r.samples["digest"] for r in counted.get(p, ()) if r.run in runs and r.samples})
                       for p in peers]
        median = statistics.median(peer_counts) if peer_counts else 0
        if settings.stand_out_ratio and len(digests) < settings.stand_out_ratio * median:
            continue  # routine overflows spread over the job: this device is not the odd one
        suspects[key] = _device_entry(devices[key], found, digests, median, len(sole[key]))
    return suspects


def _event_of(row: _Row) -> tuple[str, int, str]:
    return (row.run, row.iteration, row.optimizer)


def _identity(row: _Row) -> dict[str, Any]:
    return {"device": row.key, "host": row.host, "local_rank": row.local_rank, "uuid": row.device.get("uuid"),
            "pci_bus_id": row.device.get("pci_bus_id"), "type": row.device.get("type"),
            "index": row.device.get("index")}


def _device_entry(latest: _Row, found: list[_Row], digests: set[str], median: float, sole: int) -> dict[str, Any]:
    found = sorted(found, key=lambda r: r.time)
    return dict(_identity(latest), events=len(digests), sole_origin_events=sole, peers_median=median,
                runs=sorted({r.run for r in found}), ranks=_pairs((r.run, r.rank) for r in found),
                iterations=len({_event_of(r) for r in found}), digests=sorted(digests),
                first=found[0].time, last=found[-1].time, evidence=[r.shown() for r in found[-_SHOWN_EVENTS:]])


def _sample_entry(sample: int | str, hits: list[_Row]) -> dict[str, Any]:
    hits = sorted(hits, key=lambda r: r.time)
    events = {_event_of(r) for r in hits}
    return {"id": sample, "devices": sorted({r.key for r in hits}), "runs": sorted({r.run for r in hits}),
            "iterations": [{"run": run, "iteration": it, "optimizer": opt} for run, it, opt in sorted(events)],
            "ranks": _pairs((r.run, r.rank) for r in hits), "events": len(events),
            "evidence": [r.shown() | {"device": r.key} for r in hits[-_SHOWN_EVENTS:]]}


def _pairs(pairs: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"run": run, "rank": rank} for run, rank in sorted(set(pairs))]


def for_run(body: dict[str, Any], run: str) -> dict[str, Any]:
    """Return ``body`` with only the suspects whose evidence includes ``run`` (judged over every run)."""
    return dict(body, devices=[d for d in body["devices"] if run in d["runs"]],
                samples=[s for s in body["samples"] if run in s["runs"]],
                origin_events=body["origin_events"])


_READ = ("SELECT run, rank, iteration, optimizer, kind, time, world_size, host, local_rank, device, origin, "
         "calibration, samples FROM evidence")
_VERSION = "SELECT count(*) AS n, coalesce(max(rowid), 0) AS last FROM evidence"


class SuspectJudge:
    """Judges the stored evidence again once it changed (its row count and newest row: one indexed read to tell),
    one caller at a time, and no sooner than :data:`WAIT_FACTOR` times the last judgement took after it (judging
    then costs at most a sixth of one core however often the evidence changes: ~1.4 s at 50,000 rows of 64 ids, so
    an answer is at most ~7 s behind then; milliseconds and fresh with little evidence). Every reader (the API,
    /metrics, the built-in alert) shares the answer. Call it from a worker thread (it reads the database)."""

    WAIT_FACTOR = 5.0

    def __init__(self, query: Callable[..., list[dict]], settings: SuspectSettings,
                 clock: Callable[[], float] = time.monotonic,
                 ranks_judged: Callable[[str, int], int] = lambda run, world_size: world_size) -> None:
        """``ranks_judged``: as :func:`judge` takes it (a split run's ranks here)."""
        self.query, self.settings, self.clock, self.ranks_judged = query, settings, clock, ranks_judged
        self._lock = threading.Lock()
        self._body: dict[str, Any] | None = None
        self._version: tuple | None = None
        self._next = -math.inf  # when a change may be judged again

    def current(self) -> dict[str, Any]:
        with self._lock:
            version = tuple(self.query(_VERSION)[0].values())
            if self._body is None or (version != self._version and self.clock() >= self._next):
                started = self.clock()
                self._body = dict(judge(self.query(_READ), self.settings, self.ranks_judged),
                                  evidence_rows=version[0])
                self._version = version
                self._next = self.clock() + self.WAIT_FACTOR * (self.clock() - started)
            return self._body
